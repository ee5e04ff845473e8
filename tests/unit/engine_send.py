"""An httpx handler (httpx.MockTransport's kind: request -> response) as the engine client's `send`, for unit tests
that fake the HTTP boundary; the real exchanges are tested by tests/engine and e2e."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence

import httpx

from rollfleet.engine_client import Reply, Send
from rollfleet.upstream import ConnectFailed, UpstreamError

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


def handler_send(handler: Handler) -> Send:
    """Each exchange answered by `handler`; its httpx.ConnectError is a connection that failed, any other
    transport error an answer that broke off."""

    async def send(
        method: str, url: str, body: bytes, headers: Sequence[tuple[str, str]], connect_s: float | None
    ) -> Reply:
        request = httpx.Request(method, url, content=body, headers=list(headers), extensions={"connect_s": connect_s})
        try:
            answer = handler(request)
            response = await answer if inspect.isawaitable(answer) else answer
        except httpx.ConnectError as err:
            raise ConnectFailed(str(err)) from err
        except httpx.TransportError as err:
            raise UpstreamError(str(err)) from err
        return Reply(response.status_code, response.content)

    return send
