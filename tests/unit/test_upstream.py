"""The hot-path HTTP/1.1 client (rollfleet.upstream) against a real loopback server: what it refuses to
send, and the socket options a runner asks for."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rollfleet.upstream import Upstream

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def serve(received: list[bytes]) -> tuple[asyncio.Server, str]:
    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            received.append(head)
            writer.write(ANSWER)
            await writer.drain()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("header", [("x-id", "a\r\nx-admin: 1"), ("x-id", "a\nb"), ("x-id\r\nx-admin", "1")])
def test_a_header_with_a_line_break_is_refused_before_anything_is_sent(header: tuple[str, str]) -> None:
    async def scenario() -> list[bytes]:
        received: list[bytes] = []
        server, base = await serve(received)
        client = Upstream()
        try:
            with pytest.raises(ValueError, match="line break"):
                await client.request("POST", base + "/v1/completions", b"{}", [header])
            resp = await client.request("GET", base + "/ok", headers=[("x-id", "a")])  # the client still works
            assert (resp.status, await resp.read()) == (200, b"ok")
            resp.close()
        finally:
            client.close()
            server.close()
        return received

    [only] = asyncio.run(scenario())
    assert only.startswith(b"GET /ok ")


def test_socket_options_are_set_on_every_new_connection() -> None:
    async def scenario() -> int:
        server, base = await serve([])
        client = Upstream(socket_options=[(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)])
        try:
            resp = await client.request("GET", base + "/")
            await resp.read()
            conn = resp._conn
            resp.close()
            assert conn.transport is not None
            return int(conn.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
        finally:
            client.close()
            server.close()

    assert asyncio.run(scenario()) == 1
