"""HTTP/1.1 for the hot paths: pooled keep-alive connections, responses read as they arrive.

Owns the gateway's inference connections to engines, and a RolloutRequest runner's sample
calls to its fleet's gateway. One `asyncio.Protocol` per
connection parses the engine's answer with httptools (the parser uvicorn uses) and hands
the body to the proxy in whatever pieces arrived together, with no stream object, task
or queue per request. Why not aiohttp's client: per request it builds a request object,
multidicts, trace hooks and a stream reader; on this project's 2-core host that cost
more CPU than the rest of the proxy (docs/gateway.md, "Client and server stack"). Why not httpx's
in the runner: its pool scans every connection at each request start and end, which capped a
runner below the gateway (docs/requests.md, "Throughput").

A connection goes back to its engine's idle list only once its response was read to the
end; an idle one is dropped after `idle_s`, before the engine's own keep-alive timeout
(uvicorn's 5 s in vLLM) can close it under a request. Anything else that goes wrong
(refused, reset, closed mid-body, unparseable) is an `UpstreamError`: the proxy fails
the attempt over. Closing a response early closes its connection: vLLM aborts a request
whose client left.

Talks to engines (from the gateway) and to gateways (from a runner). Calls to the engines' own
API (abort, state) go through `rollfleet.engine_client`.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections import deque
from collections.abc import Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 1 << 20  # unread body bytes at which reading from the engine pauses (a slow client)

SocketOption = tuple[int, int, int]  # (level, option, value) for socket.setsockopt


class UpstreamError(OSError):
    """The engine could not be reached, or its answer broke off."""


class ConnectFailed(UpstreamError):
    """No connection could be opened: the peer never saw the request, so even a POST may be sent again."""


class LocalResourceError(ConnectFailed):
    """This process could not open a connection for want of its own resources (file descriptors,
    buffers, memory): no fault of the peer, which must not be ejected for it."""


# connect()'s errors that say this process or machine is out of something, not that the peer failed.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Connection(asyncio.Protocol):
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()  # made by create_connection, in the loop: looked up once, not per wait
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0

    # --- asyncio.Protocol -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # an idle connection the engine talks on: not HTTP we can use
            self.close()
            return
        response = self.response
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            response._fail(UpstreamError(f"unparseable answer from {self.pool.name}: {err}"))
            self.close()
        # Woken once per read, not per piece of body: a chunked SSE stream is a piece per event.
        response._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.response is not None and not self.response.complete:
            what = f": {exc}" if exc else ""
            self.response._fail(UpstreamError(f"{self.pool.name} closed the connection mid-answer{what}"))

    def pause_writing(self) -> None:  # request bodies are small: nothing waits on the write buffer
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks --------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        assert self.response is not None
        self.response.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._data(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response.complete = True
        self.response._keep_alive = self.parser.should_keep_alive()

    # --- for the pool and the response ----------------------------------------------
    def send(self, data: bytes, response: Response) -> None:
        assert self.transport is not None
        self.response = response
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(data)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()
        self.pool.forget(self)


class Response:
    """An engine's answer: status and headers (raw, lowercase names), then the body as it arrives."""

    def __init__(self, connection: _Connection) -> None:
        self._conn = connection
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.complete = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False

    def header(self, name: bytes) -> str | None:
        """A header's value; `name` in lowercase."""
        value = self.headers.get(name)
        return None if value is None else value.decode("latin-1")

    async def read_any(self) -> bytes:
        """Whatever body arrived since the last call (several pieces joined); b"" once the body ended."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered >= HIGH_WATER and self._conn.transport is not None and not self._conn.closed:
            self._conn.transport.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while data := await self.read_any():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Done with it: a response read to its end gives its connection back, any other closes it."""
        if self.complete and self._keep_alive and self._error is None:
            self._conn.response = None
            self._conn.pool.release(self._conn)
        else:
            self._conn.close()

    # --- from the connection --------------------------------------------------------
    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _data(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered >= HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.pause_reading()

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        self._wake()


class _Pool:
    """The idle connections to one engine (host and port)."""

    def __init__(self, host: str, port: int, idle_s: float) -> None:
        self.host, self.port, self.idle_s = host, port, idle_s
        self.name = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # also the Host header
        self.idle: deque[_Connection] = deque()

    def take(self, now: float) -> _Connection | None:
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to be timed out
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    def release(self, conn: _Connection) -> None:
        if not conn.closed:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        if conn.response is None and conn in self.idle:
            self.idle.remove(conn)

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


class Upstream:
    """Keep-alive connections to every peer this process calls (engines from a gateway, gateways from a runner,
    engines' control routes from `rollfleet.engine_client`)."""

    MAX_PEERS = 8192  # past this many peers, those with no idle connection are forgotten (pods come and go)

    def __init__(
        self, connect_timeout_s: float = 5.0, idle_s: float = 4.0, socket_options: Iterable[SocketOption] = ()
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.socket_options = tuple(socket_options)  # set on each new connection's socket (TCP keepalive)
        self._pools: dict[str, _Pool] = {}

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
        connect_timeout_s: float | None = None,
    ) -> Response:
        """Send a request and wait for the answer's status and headers; read its body from the Response
        and `close()` it when done. ConnectFailed when no connection could be opened (within
        `connect_timeout_s`, else the client's), UpstreamError when the answer broke off."""
        base, path = _split(url)
        pool = self._pools.get(base) or self._pool(base)
        head = [f"{method} {path} HTTP/1.1\r\nHost: {pool.name}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers:
            if "\n" in v or "\r" in v or "\n" in k or "\r" in k:  # would end the header: another one, or a request
                raise ValueError(f"header {k!r}: a line break in a header's name or value")
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        conn = pool.take(time.monotonic()) or await self._connect(pool, connect_timeout_s or self.connect_timeout_s)
        response = Response(conn)
        conn.send("".join(head).encode("latin-1") + body, response)
        try:
            while response.status == 0:
                if response._error is not None:
                    raise response._error
                await response._wait()
        except BaseException:
            conn.close()
            raise
        return response

    def _pool(self, base: str) -> _Pool:
        parts = urlsplit(base)
        if parts.scheme != "http" or parts.hostname is None:
            raise UpstreamError(f"engine URL {base!r}: only http://host:port is spoken to engines")
        if len(self._pools) >= self.MAX_PEERS:
            self._pools = {k: p for k, p in self._pools.items() if p.idle}
        pool = self._pools[base] = _Pool(parts.hostname, parts.port or 80, self.idle_s)
        return pool

    async def _connect(self, pool: _Pool, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(pool), pool.host, pool.port)
        except TimeoutError:
            raise ConnectFailed(f"connecting to {pool.name} took over {timeout_s:g}s") from None
        except OSError as err:
            if err.errno in _LOCAL_ERRNOS:
                raise LocalResourceError(
                    f"cannot open a connection to {pool.name} for want of resources here: {err}"
                ) from err
            raise ConnectFailed(f"cannot connect to {pool.name}: {err}") from err
        if self.socket_options and conn.transport is not None:
            sock = conn.transport.get_extra_info("socket")
            for option in self.socket_options:
                sock.setsockopt(*option)
        return conn

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _split(url: str) -> tuple[str, str]:
    """("http://host:port", "/path?query") of a URL."""
    scheme_end = url.find("://")
    slash = url.find("/", scheme_end + 3 if scheme_end >= 0 else 0)
    if slash < 0:
        return url, "/"
    return url[:slash], url[slash:]
