"""The gateway's HTTP/1.1 server: httptools (llhttp) on uvloop, one asyncio.Protocol per connection.

Owns connections from clients: parsing, body limits, keep-alive, pipelined requests in
order, backpressure, and shutdown that lets requests in flight finish. It refuses what a strict
HTTP/1.1 parser (h11, RFC 9112) refuses where llhttp is lenient: a missing or repeated Host,
transfer codings other than chunked, HTTP/0.9; trailers never become headers; a request head must
arrive within a deadline and within its byte limit as it arrives, and connections are capped. Each request is
handed over as an ASGI call (`scope`, `receive`, `send`), so the Starlette routes run
unchanged; routes named in `direct` skip the framework and get the same call with a
`Client` instead of `receive`, which says when the client leaves through a callback
rather than a task waiting on `receive()`. Why not uvicorn: per request it costs a task
and a middleware chain, and on this project's 2-core host the proxy's hot path is CPU
per request (docs/gateway.md, "Client and server stack").

Talks to clients only; what a request means is the app's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

log = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
Asgi = Callable[[Message, Receive, Send], Awaitable[None]]
MAX_HEAD_BYTES = 64 * 1024  # request line and headers


class Headers(Mapping[str, str]):
    """A request's headers by lowercase name (a repeated header: its last value), decoded when looked up."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = dict(raw)

    def get(self, name: str, default: Any = None) -> Any:
        value = self._raw.get(name.encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __getitem__(self, name: str) -> str:
        value = self._raw[name.encode("latin-1")]
        return value.decode("latin-1")

    def __iter__(self) -> Iterator[str]:
        return (k.decode("latin-1") for k in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@dataclass
class Client:
    """The client of one request, for handlers that take it directly: `on_leave` runs if its connection
    goes before the response ended."""

    headers: Headers
    body: bytes
    on_leave: Callable[[], None] | None = None


Direct = Callable[[Client, Send], Awaitable[None]]


@dataclass
class Limits:
    max_body_bytes: int = 8 * 1024 * 1024
    keep_alive_s: float = 75.0
    head_timeout_s: float = 10.0  # a new connection, or a request begun, has this long to send its head (408)
    max_connections: int = 4096  # past it a new connection gets a 503 and is closed (file descriptors are finite)
    max_pipelined: int = 16  # complete requests waiting behind the one answered before reading stops
    shutdown_grace_s: float = 25.0  # requests in flight get this long to finish on SIGTERM


def head_problem(version: str, headers: list[tuple[bytes, bytes]], upgrade: bool) -> tuple[int, str] | None:
    """Why a request head that llhttp accepted is refused, as h11 would refuse it (status, message)."""
    if version not in ("1.0", "1.1"):
        return 400, f"HTTP/{version} is not served: send HTTP/1.1"
    hosts, codings = 0, []
    for name, value in headers:  # one pass: this runs for every request
        if name == b"host":
            hosts += 1
        elif name == b"transfer-encoding":
            codings.append(value)
    if hosts > 1 or (hosts == 0 and version == "1.1"):
        return 400, f"an HTTP/1.1 request needs exactly one Host header ({hosts} sent)"
    if codings and (len(codings) > 1 or codings[0].strip().lower() != b"chunked"):
        return 501, "only Transfer-Encoding: chunked is served, once"
    if upgrade:
        return 501, "protocol upgrades are not served"
    return None


@dataclass
class _Request:
    method: str
    path: str
    query: bytes
    version: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool


class _Reply:
    """The response to one request: ASGI's send, onto the connection's transport."""

    def __init__(self, conn: _Connection, request: _Request) -> None:
        self.conn = conn
        self.request = request
        self.started = False
        self.ended = False
        self.chunked = False
        self._done: asyncio.Future[None] | None = None  # an ASGI receive() waiting for the end
        self._head = b""  # status line and headers, until the first piece of body

    def cut_short(self) -> None:
        """The app returned without ending its answer: end what can be ended, and close the connection after."""
        self.request.keep_alive = False
        conn = self.conn
        if self.started and not conn.closed and conn.transport is not None:
            conn.transport.write(self._head + (b"0\r\n\r\n" if self.chunked else b""))
        self._head = b""
        self.ended = True
        conn.response_ended(self)

    async def wait_done(self) -> None:
        """Until the client leaves or this answer ended."""
        if not self.ended and not self.conn.closed:
            self._done = self.conn.loop.create_future()
            await self._done

    def finish_waiting(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._start(message["status"], message.get("headers") or [])
            return
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if not self.started or self.ended:
            raise RuntimeError("http.response.body before http.response.start, or after the last one")
        conn = self.conn
        if conn.transport is None or conn.closed:
            return  # the client left: nothing to write to (it was told through on_leave)
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more:
                data += b"0\r\n\r\n"
        else:
            data = body if self.request.method != "HEAD" else b""  # a HEAD answer is the head alone
        if self._head:  # the head goes out with the first piece of body: one write, one segment
            data, self._head = self._head + data, b""
        if data:
            conn.transport.write(data)
        if not more:
            self.ended = True
            conn.response_ended(self)
        elif conn.write_paused:
            await conn.drained()

    def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.started:
            raise RuntimeError("http.response.start sent twice")
        self.started = True
        if self.conn.server.stopping:
            self.request.keep_alive = False  # tell the client: this connection closes after the answer
        fields, has_length = [], False
        for name, value in headers:
            fields.append(b"%b: %b\r\n" % (name, value))
            has_length = has_length or name.lower() == b"content-length"
        self.chunked = not has_length and self.request.version != "1.0" and self.request.method != "HEAD"
        if not has_length and not self.chunked:
            self.request.keep_alive = False  # the end of the body is the end of the connection
        self._head = b"".join(
            (
                _STATUS_LINES.get(status) or b"HTTP/1.1 %d %b\r\n" % (status, _reason(status)),
                *fields,
                b"transfer-encoding: chunked\r\n" if self.chunked else b"",
                b"" if self.request.keep_alive else b"connection: close\r\n",
                b"\r\n",
            )
        )


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        # Made by the server's protocol factory, in the loop. Kept: each lookup of the running loop is a getpid()
        # system call (CPython checks for a fork), and a request would make several.
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._queue: deque[_Request] = deque()  # complete requests waiting for the one before them
        self._reply: _Reply | None = None  # the request being answered
        self._client: Client | None = None
        self.idle_since = time.monotonic()  # when it last had nothing to answer (HttpServer closes idle ones)
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._in_head = False  # a request begun whose head is not complete (after it, headers are trailers)
        self._continue = False  # the client waits for "100 Continue" before it sends the body
        self._continue_owed = False  # ... and gets it once the answers before its request are written
        self._refusal: _Refusal | None = None  # to write once the answers before the refused request are
        self._queued_bytes = 0
        self._head_received = 0  # bytes of reads that were all head, for the limit (llhttp buffers a header whole)
        self.head_since: float | None = time.monotonic()  # waiting for a head since (the head deadline)

    # --- asyncio.Protocol -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        if len(self.server.connections) >= self.server.limits.max_connections:
            self._refuse(503, f"the gateway serves at most {self.server.limits.max_connections} connections")
            return
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused: nothing more is read
        in_head = self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            refusal = err.__context__  # what a callback raised
            if isinstance(refusal, _Refusal):
                self._refuse(refusal.status, refusal.message)
            else:
                self._refuse(400, f"malformed HTTP request: {err}")
            return
        if in_head and self._in_head:
            # The whole read is head: counted as it arrives, since llhttp hands a header over only once
            # it is complete (a single value of 64 MiB would be buffered whole first).
            self._head_received += len(data)
            if self._head_received > MAX_HEAD_BYTES:
                self._refuse(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._queue.clear()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        client, self._client = self._client, None
        if client is not None and client.on_leave is not None:
            client.on_leave()
        if self._reply is not None:
            self._reply.finish_waiting()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drained(self) -> None:
        if self.write_paused and not self.closed:
            self._drain = self.loop.create_future()
            await self._drain

    # --- httptools callbacks --------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._head_bytes, self._body, self._body_bytes = b"", [], 0, [], 0
        self._in_head, self._head_received = True, 0
        if self.head_since is None:
            self.head_since = time.monotonic()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Refusal(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Refusal(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")
        if not self._in_head:
            return  # a trailer: what a request says is in its head, never after its body
        name = name.lower()
        self._headers.append((name, value))
        if name == b"content-length":
            limit = self.server.limits.max_body_bytes
            if value.isdigit() and int(value) > limit:
                raise _Refusal(413, f"request body of {int(value)} bytes exceeds {limit}")
        elif name == b"expect" and value.lower() == b"100-continue":
            self._continue = True

    def on_headers_complete(self) -> None:
        self._in_head, self.head_since = False, None
        problem = head_problem(self.parser.get_http_version(), self._headers, self.parser.should_upgrade())
        if problem is not None:
            raise _Refusal(*problem)
        if self._continue:
            self._continue = False
            # Not inside the answer of a request before it (that would land in its body): after it.
            self._continue_owed = True
            self._write_continue_if_due()

    def _write_continue_if_due(self) -> None:
        if self._continue_owed and self._reply is None and not self._queue and self.transport is not None:
            self._continue_owed = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.server.limits.max_body_bytes:
            raise _Refusal(413, f"request body exceeds {self.server.limits.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._url.startswith(b"/"):  # origin form, what clients send to a server
            path, _, query = self._url.partition(b"?")
        else:  # absolute form (a client that thinks it talks to a proxy)
            url = httptools.parse_url(self._url)
            path, query = url.path or b"/", url.query or b""
        request = _Request(
            method=self.parser.get_method().decode("ascii"),
            path=path.decode("utf-8", "surrogateescape"),
            query=query,
            version=self.parser.get_http_version(),
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=self.parser.should_keep_alive(),
        )
        self._continue_owed = False  # the body came without it
        if self._reply is None:
            self._begin(request)
        else:
            self._queue.append(request)  # pipelined: answered in order
            self._queued_bytes += len(request.body)
            limits = self.server.limits
            if (len(self._queue) > limits.max_pipelined or self._queued_bytes > limits.max_body_bytes) and (
                self.transport is not None
            ):
                self.transport.pause_reading()  # a client that does not wait for its answers

    # --- answering ------------------------------------------------------------------
    def _begin(self, request: _Request) -> None:
        self._reply = _Reply(self, request)
        task = self.loop.create_task(self._answer(request, self._reply))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    async def _answer(self, request: _Request, reply: _Reply) -> None:
        direct = self.server.direct.get((request.method, request.path))
        try:
            if direct is not None:
                self._client = Client(Headers(request.headers), request.body)
                await direct(self._client, reply.send)
            else:
                await self.server.app(self._scope(request), self._receiver(request, reply), reply.send)
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path)
            if not reply.started:
                await reply.send({"type": "http.response.start", "status": 500, "headers": _TEXT})
                await reply.send({"type": "http.response.body", "body": b"internal server error\n"})
        finally:
            if not reply.ended:
                reply.cut_short()

    def response_ended(self, reply: _Reply) -> None:
        if reply is not self._reply:
            return
        reply.finish_waiting()
        self._reply, self._client = None, None
        if self.closed or self.transport is None:
            return
        if not reply.request.keep_alive or self.server.stopping:
            self.transport.close()
            return
        if self._queue:
            request = self._queue.popleft()
            self._queued_bytes -= len(request.body)
            if self._refusal is None:
                self.transport.resume_reading()  # (a no-op unless the queue had stopped it)
            self._begin(request)
        elif self._refusal is not None:
            self._write_refusal(self._refusal)
        else:
            self.idle_since = time.monotonic()
            self._write_continue_if_due()

    def _scope(self, request: _Request) -> Message:
        server = self.transport.get_extra_info("sockname") if self.transport is not None else None
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.version,
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode("utf-8", "surrogateescape"),
            "root_path": "",
            "query_string": request.query,
            "headers": request.headers,
            "server": tuple(server[:2]) if server else None,
            "client": tuple(peer[:2]) if peer else None,
            "state": {},
        }

    def _receiver(self, request: _Request, reply: _Reply) -> Receive:
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await reply.wait_done()  # the client left, or the answer ended
            return {"type": "http.disconnect"}

        return receive

    # --- limits ---------------------------------------------------------------------
    def sweep(self, idle_before: float, head_before: float) -> None:
        """Close the connection if it has been idle since before `idle_before` (keep-alive), or answer
        408 if a request head it owes has been under way since before `head_before`."""
        if self.transport is None or self.closed or self._reply is not None or self._queue:
            return
        if self.head_since is not None and self.head_since < head_before:
            self._refuse(408, "the request head did not arrive in time")
        elif self.head_since is None and self.idle_since < idle_before:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be read and close the connection. The answers of the requests
        before it come first: they ran, and their clients are owed them."""
        if self.transport is None or self.closed or self._refusal is not None:
            return
        self._refusal = _Refusal(status, message)
        self.transport.pause_reading()
        if self._reply is None and not self._queue:
            self._write_refusal(self._refusal)

    def _write_refusal(self, refusal: _Refusal) -> None:
        assert self.transport is not None
        render = self.server.refusal
        status, message = refusal.status, refusal.message
        body, kind = (render(status, message), b"application/json") if render else (message.encode(), b"text/plain")
        head = b"HTTP/1.1 %d %b\r\ncontent-type: %b\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, _reason(status), kind, len(body)) + body)
        self.transport.close()


class _Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class HttpServer:
    """Serves `app` (ASGI), and the `direct` routes ((method, path) -> handler) without it."""

    app: Asgi
    direct: Mapping[tuple[str, str], Direct] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    # The JSON body of a request the server turns away itself (too large, malformed); None: plain text.
    refusal: Callable[[int, str], bytes] | None = None
    connections: set[_Connection] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    stopping: bool = False
    _servers: list[asyncio.Server] = field(default_factory=list)
    _sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True, backlog=2048)
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._close_idle_connections())

    async def _close_idle_connections(self) -> None:
        # One sweep a while, not a timer per response: neither deadline needs precision.
        limits = self.limits
        while True:
            await asyncio.sleep(min(limits.keep_alive_s / 4, limits.head_timeout_s / 2, 5.0))
            now = time.monotonic()
            for conn in list(self.connections):
                conn.sweep(now - limits.keep_alive_s, now - limits.head_timeout_s)

    @property
    def ports(self) -> list[int]:
        return [int(s.getsockname()[1]) for srv in self._servers for s in srv.sockets]

    async def shutdown(self) -> None:
        """Stop accepting; give requests in flight `shutdown_grace_s` to finish; close every connection."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            if conn._reply is None and conn.transport is not None:
                conn.transport.close()
        deadline = time.monotonic() + self.limits.shutdown_grace_s
        while self.tasks and time.monotonic() < deadline:
            await asyncio.wait(set(self.tasks), timeout=deadline - time.monotonic())
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()


_TEXT = [(b"content-type", b"text/plain")]
_REASONS = {
    100: b"Continue",
    200: b"OK",
    202: b"Accepted",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    409: b"Conflict",
    413: b"Content Too Large",
    422: b"Unprocessable Content",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


_STATUS_LINES = {status: b"HTTP/1.1 %d %b\r\n" % (status, reason) for status, reason in _REASONS.items()}


def _reason(status: int) -> bytes:
    return _REASONS.get(status, b"Status")
