"""The hot-path HTTP/1.1 client (rollfleet.upstream) against a real loopback server: what it refuses to
send, and the socket options a runner asks for."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rollfleet.upstream import ConnectFailed, Upstream

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


def test_peers_without_an_idle_connection_are_forgotten_past_the_bound_and_a_failed_connect_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engines come and go with new pod IPs: the client keeps no state for the gone ones. A connection that
    cannot be opened is ConnectFailed (the peer never saw the request: the engine client may send it again)."""
    monkeypatch.setattr(Upstream, "MAX_PEERS", 2)

    async def scenario() -> tuple[str, list[str]]:
        server, base = await serve([])
        client = Upstream(connect_timeout_s=2)
        try:
            resp = await client.request("GET", base + "/")
            await resp.read()
            resp.close()  # read to its end: kept, idle
            with socket.socket() as unused:
                unused.bind(("127.0.0.1", 0))
                closed = f"http://127.0.0.1:{unused.getsockname()[1]}"
            with pytest.raises(ConnectFailed, match="cannot connect"):
                await client.request("GET", closed + "/")  # a second peer, with no connection
            with pytest.raises(ConnectFailed):
                await client.request("GET", "http://127.0.0.1:1/")  # a third: past the bound
            return base, list(client._pools)
        finally:
            client.close()
            server.close()

    base, peers = asyncio.run(scenario())
    # The peer that failed had nothing idle and was forgotten; the one with an idle connection was kept.
    assert peers == [base, "http://127.0.0.1:1"]
