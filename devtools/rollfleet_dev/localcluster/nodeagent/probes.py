"""Startup, readiness and liveness probes: one check (I/O) and the threshold logic (pure).

`pods` runs one loop per probe of a running container; checks talk to the pod's own
address (httpGet, tcpSocket) or run a command inside the container's mount
namespace (exec, through `processes`).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

Obj = dict[str, Any]
ExecFn = Callable[[list[str], float], Awaitable[int]]  # (argv, time limit in s) -> exit code

_NO_VERIFY = ssl.create_default_context()
_NO_VERIFY.check_hostname = False
_NO_VERIFY.verify_mode = ssl.CERT_NONE  # kubelet does not verify HTTPS probes either


@dataclass(frozen=True)
class ProbeTiming:
    initial_delay_s: float
    period_s: float
    timeout_s: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def of(cls, probe: Obj) -> ProbeTiming:
        """Kubernetes' defaults for whatever the probe leaves out."""
        return cls(
            initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
            period_s=float(probe.get("periodSeconds", 10)),
            timeout_s=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


class Tracker:
    """Turns single check results into the probe's result with success/failure thresholds (pure)."""

    def __init__(self, timing: ProbeTiming, initial: bool) -> None:
        self.timing = timing
        self.result = initial
        self._successes = 0
        self._failures = 0

    def record(self, ok: bool) -> bool:
        """Record one check; True when the probe's result flipped."""
        if ok:
            self._successes += 1
            self._failures = 0
            flip = not self.result and self._successes >= self.timing.success_threshold
        else:
            self._failures += 1
            self._successes = 0
            flip = self.result and self._failures >= self.timing.failure_threshold
        if flip:
            self.result = not self.result
        return flip

    @property
    def failed_out(self) -> bool:
        """failureThreshold consecutive failures (startup/liveness: the container gets killed)."""
        return self._failures >= self.timing.failure_threshold


def _port(value: int | str, container: Obj) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for p in container.get("ports") or []:
        if p.get("name") == value:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {value!r}")


async def check(
    probe: Obj, container: Obj, pod_ip: str, session: aiohttp.ClientSession, exec_in: ExecFn
) -> tuple[bool, str]:
    """Run one check; (ok, message on failure)."""
    timeout = ProbeTiming.of(probe).timeout_s
    try:
        if "httpGet" in probe:
            h = probe["httpGet"]
            scheme = h.get("scheme", "HTTP").lower()
            host = h.get("host") or pod_ip
            url = f"{scheme}://{host}:{_port(h['port'], container)}{h.get('path', '/')}"
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
            async with session.get(
                url,
                headers=headers,
                ssl=_NO_VERIFY if scheme == "https" else True,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as resp:
                ok = 200 <= resp.status < 400
                return ok, "" if ok else f"HTTP probe failed with statuscode: {resp.status}"
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(t.get("host") or pod_ip, _port(t["port"], container)), timeout
            )
            writer.close()
            return True, ""
        if "exec" in probe:
            code = await exec_in(list(probe["exec"]["command"]), timeout)
            return code == 0, "" if code == 0 else f"command exited with {code}"
        return False, f"unsupported probe handler: {sorted(k for k in probe if k.endswith(('Get', 'Socket', 'grpc')))}"
    except TimeoutError:
        return False, f"probe timed out after {timeout:g}s"
    except (OSError, aiohttp.ClientError, ValueError) as e:
        return False, str(e) or type(e).__name__
