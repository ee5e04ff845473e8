"""The gateway's HTTP server at the edges a client can reach: limits, malformed input, pipelining, HEAD,
100-continue, a client that leaves, and shutdown that lets a request in flight finish. Real sockets."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvloop

from rollfleet.gateway.httpserver import Client, HttpServer, Limits, Message, Receive, Send


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
