"""The gateway's HTTP server at the edges a client can reach: limits, malformed input, pipelining, HEAD,
100-continue, a client that leaves, and shutdown that lets a request in flight finish. Real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvloop
from tests.unit.gateway.http_answers import parse_answers

from rollfleet.gateway.httpserver import MAX_HEAD_BYTES, Client, HttpServer, Limits, Message, Receive, Send


async def _echo(scope: Message, receive: Receive, send: Send) -> None:
    """A tiny ASGI app: answers the method, path and body it got."""
    body = (await receive())["body"]
    out = f"{scope['method']} {scope['path']} {scope['query_string'].decode()} {len(body)}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


@asynccontextmanager
async def _serving(
    direct: dict[tuple[str, str], Callable[[Client, Send], Awaitable[None]]] | None = None, **limits: float
) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(_echo, direct or {}, Limits(**limits))  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    try:
        yield server, server.ports[0]
    finally:
        await server.shutdown()


async def _exchange(port: int, data: bytes, until: bytes = b"") -> bytes:
    """Send `data` on a new connection; what comes back until the server closes it (or 5 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    try:
        async with asyncio.timeout(5):
            while until not in out or not until:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                out += chunk
    except TimeoutError:
        pass
    writer.close()
    return out


def run(coro: Awaitable[None]) -> None:
    uvloop.run(coro)  # type: ignore[arg-type]


def test_pipelined_requests_are_answered_in_order_and_head_gets_no_body() -> None:
    async def main() -> None:
        async with _serving() as (_, port):
            requests = (
                b"POST /a?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
                b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n"
                b"HEAD /c HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
            )
            out = await _exchange(port, requests)
            assert out.count(b"HTTP/1.1 200 OK") == 3
            assert out.index(b"POST /a x=1 3") < out.index(b"GET /b  0")
            assert b"HEAD /c" not in out and out.rstrip().endswith(b"connection: close")

    run(main())


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST / HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n", b"413"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
    ],
)
def test_requests_it_cannot_take_are_refused_with_a_status_and_the_connection_closed(
    request_bytes: bytes, status: bytes
) -> None:
    async def main() -> None:
        async with _serving(max_body_bytes=1024) as (_, port):
            out = await _exchange(port, request_bytes)
            assert out.startswith(b"HTTP/1.1 " + status), out[:200]
            assert b"connection: close" in out

    run(main())


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def main() -> None:
        async with _serving() as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /up HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
            writer.write(b"data")
            answer = await reader.readuntil(b"POST /up  4")
            assert answer.startswith(b"HTTP/1.1 200 OK")
            writer.close()

    run(main())


def test_a_client_that_leaves_is_told_to_its_direct_handler_and_shutdown_waits_for_the_one_in_flight() -> None:
    async def main() -> None:
        left, started, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def slow(client: Client, send: Send) -> None:
            client.on_leave = left.set
            started.set()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"late", "more_body": False})

        async with _serving({("POST", "/slow"): slow}, shutdown_grace_s=5.0) as (server, port):
            gone = socket.create_connection(("127.0.0.1", port))
            gone.sendall(b"POST /slow HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            gone.close()
            await asyncio.wait_for(left.wait(), 5)
            release.set()

            started.clear()
            release.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /slow HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            shutting = asyncio.create_task(server.shutdown())
            await asyncio.sleep(0.1)
            assert not shutting.done()  # the request in flight holds it
            release.set()
            answer = await asyncio.wait_for(reader.read(), 5)
            await shutting
            assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"4\r\nlate\r\n0\r\n\r\n")
            assert b"transfer-encoding: chunked" in answer and b"connection: close" in answer

    run(main())


def _streaming(headers: list[tuple[bytes, bytes]], pieces: int, started: asyncio.Event | None = None) -> Any:
    """A direct handler that streams `pieces` small pieces with `headers`, a few ms apart."""

    async def handler(client: Client, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if started is not None:
            started.set()
        for i in range(pieces):
            await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"piece %d;" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return handler


def test_a_header_value_that_names_content_length_does_not_unframe_a_streamed_answer() -> None:
    """D1: a caller's id `content-length:0`, echoed in the answer's headers, left a stream with neither
    a length nor chunks on a kept connection (the next answer read as its body)."""

    async def main() -> None:
        handler = _streaming([(b"x-request-id", b"content-length:0")], pieces=3)
        async with _serving({("POST", "/s"): handler}) as (_, port):
            out = await _exchange(
                port,
                b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"
                b"GET /after HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
            )
            answers, rest = parse_answers(out)
            assert [a.status for a in answers] == [200, 200] and not rest, out
            assert answers[0].body == b"piece 0;piece 1;piece 2;" and answers[1].body == b"GET /after  0"

    run(main())


def test_100_continue_for_a_request_behind_a_stream_comes_after_that_stream() -> None:
    """D7: the interim answer was written into the chunked body of the stream before it."""

    async def main() -> None:
        started = asyncio.Event()
        async with _serving({("POST", "/s"): _streaming([], pieces=20, started=started)}) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(started.wait(), 5)
            writer.write(b"POST /up HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
            first = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            assert b"100 Continue" not in first
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
            writer.write(b"data")
            answer = await asyncio.wait_for(reader.readuntil(b"POST /up  4"), 5)
            assert answer.startswith(b"HTTP/1.1 200 OK")
            writer.close()

    run(main())


def test_a_huge_header_is_refused_as_it_arrives_not_once_buffered() -> None:
    """D2: a single header value of 64 MiB was buffered whole before the 64 KiB limit applied."""

    async def main() -> None:
        async with _serving() as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nX: ")
            sent = 0
            with contextlib.suppress(ConnectionError):
                while sent < 64 * 1024 * 1024 and not reader.at_eof():
                    writer.write(b"a" * 65536)
                    await writer.drain()
                    sent += 65536
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.01):
                            head = await reader.read(12)
                            if head:
                                break
            assert sent <= 8 * MAX_HEAD_BYTES, f"{sent} bytes taken before the refusal"
            writer.close()

    run(main())


def test_a_request_head_must_arrive_in_time() -> None:
    """A slow client (slowloris) gets 408 and is closed, a fresh connection that sends nothing too."""

    async def main() -> None:
        async with _serving(head_timeout_s=0.4) as (_, port):
            begun = asyncio.create_task(_exchange(port, b"GET / HTTP/1.1\r\nHost: h\r\nX-Slow: "))
            silent = asyncio.create_task(_exchange(port, b""))
            for out in await asyncio.gather(begun, silent):
                assert out.startswith(b"HTTP/1.1 408 Request Timeout") and b"connection: close" in out, out
            # A kept connection between requests waits for keep-alive, not the head deadline.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /one HTTP/1.1\r\nHost: h\r\n\r\n")
            await reader.readuntil(b"GET /one  0")
            await asyncio.sleep(1.0)
            writer.write(b"GET /two HTTP/1.1\r\nHost: h\r\n\r\n")
            assert (await asyncio.wait_for(reader.readuntil(b"GET /two  0"), 5)).startswith(b"HTTP/1.1 200")
            writer.close()

    run(main())


def test_connections_are_capped() -> None:
    async def main() -> None:
        async with _serving(max_connections=2) as (server, port):
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await asyncio.sleep(0.05)
            assert len(server.connections) == 2
            refused = await _exchange(port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            assert refused.startswith(b"HTTP/1.1 503") and b"at most 2 connections" in refused, refused
            held[0][1].close()
            await asyncio.sleep(0.05)
            served = await _exchange(port, b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
            assert served.startswith(b"HTTP/1.1 200"), served
            held[1][1].close()

    run(main())
