"""The operator's HTTP client for engine control routes: state, pause and resume.

Bodies and paths come from `rollfleet_engine.protocol` (state) and vLLM's RL routes
(`POST /pause?mode=`, `POST /resume`). Control calls carry the fleet's admin token
(Secret `<fleet>-admin-token`). Talks to engines only.
"""

from __future__ import annotations

import aiohttp

from rollfleet.contract import ENGINE_PORT, STATE_PATH, PauseMode
from rollfleet_engine.protocol import EngineState

STATE_TIMEOUT_S = 5.0
# pause?mode=wait returns once in-flight requests have finished, which can take long.
PAUSE_TIMEOUT_S = {"keep": 30.0, "abort": 60.0, "wait": 900.0}


class EngineCallError(RuntimeError):
    """An engine could not be reached, or refused a call."""


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession, port: int = ENGINE_PORT) -> None:
        self._session = session
        self._port = port

    def _url(self, ip: str, path: str) -> str:
        return f"http://{ip}:{self._port}{path}"

    async def state(self, ip: str) -> EngineState:
        """The engine's weight version, pause state and in-flight counts (an open route)."""
        try:
            async with self._session.get(self._url(ip, STATE_PATH),
                                         timeout=aiohttp.ClientTimeout(total=STATE_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    raise EngineCallError(f"GET {STATE_PATH} on {ip}: HTTP {resp.status}")
                return EngineState.model_validate(await resp.json())
        except (aiohttp.ClientError, TimeoutError) as err:
            raise EngineCallError(f"GET {STATE_PATH} on {ip}: {err!r}") from err

    async def pause(self, ip: str, mode: PauseMode, token: str) -> None:
        await self._control(ip, f"/pause?mode={mode}", token, aiohttp.ClientTimeout(total=PAUSE_TIMEOUT_S[mode]))

    async def resume(self, ip: str, token: str) -> None:
        await self._control(ip, "/resume", token, aiohttp.ClientTimeout(total=30.0))

    async def _control(self, ip: str, path: str, token: str, limit: aiohttp.ClientTimeout) -> None:
        try:
            async with self._session.post(self._url(ip, path), headers={"Authorization": f"Bearer {token}"},
                                          timeout=limit) as resp:
                if resp.status != 200:
                    raise EngineCallError(f"POST {path} on {ip}: HTTP {resp.status}: {(await resp.text())[:200]}")
        except (aiohttp.ClientError, TimeoutError) as err:
            raise EngineCallError(f"POST {path} on {ip}: {err!r}") from err
