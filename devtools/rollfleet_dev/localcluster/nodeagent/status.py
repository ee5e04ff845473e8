"""Pod status from container observations, and restart decisions (pure).

`pods` records what it sees of each container in `ContainerObs`; `pod_status` turns
that into the `status` of the Pod (phase, conditions, containerStatuses) the way
kubelet would. Talks to nobody.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

Obj = dict[str, Any]

BACKOFF_START_S = 1.0
BACKOFF_CAP_S = 30.0
# A container that ran this long before exiting starts its back-off afresh (kubelet: 10 min at a 5 min cap).
BACKOFF_RESET_AFTER_S = 2 * BACKOFF_CAP_S


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Waiting:
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Running:
    started_at: datetime


@dataclass(frozen=True)
class Terminated:
    exit_code: int
    reason: str
    started_at: datetime | None
    finished_at: datetime
    message: str = ""
    signal: int | None = None


State = Waiting | Running | Terminated


@dataclass
class ContainerObs:
    """What the agent knows of one container right now."""

    name: str
    image: str
    state: State = field(default_factory=lambda: Waiting("ContainerCreating"))
    last_state: Terminated | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""


def exit_reason(exit_code: int, oom: bool = False) -> str:
    if oom:
        return "OOMKilled"
    return "Completed" if exit_code == 0 else "Error"


def should_restart(restart_policy: str, exit_code: int) -> bool:
    return restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)


def backoff_delay(previous_delay: float | None, ran_for_s: float) -> float:
    """The CrashLoopBackOff delay before the next start: 1 s, doubling, capped at 30 s
    (kubelet: 10 s to 5 min, too slow for tests); reset after a long healthy run."""
    if previous_delay is None or ran_for_s >= BACKOFF_RESET_AFTER_S:
        return BACKOFF_START_S
    return min(previous_delay * 2, BACKOFF_CAP_S)


def _state_api(state: State) -> Obj:
    if isinstance(state, Waiting):
        w: Obj = {"reason": state.reason}
        if state.message:
            w["message"] = state.message
        return {"waiting": w}
    if isinstance(state, Running):
        return {"running": {"startedAt": rfc3339(state.started_at)}}
    t: Obj = {"exitCode": state.exit_code, "reason": state.reason, "finishedAt": rfc3339(state.finished_at)}
    if state.started_at is not None:
        t["startedAt"] = rfc3339(state.started_at)
    if state.message:
        t["message"] = state.message
    if state.signal is not None:
        t["signal"] = state.signal
    return {"terminated": t}


def container_status_api(obs: ContainerObs) -> Obj:
    out: Obj = {
        "name": obs.name,
        "image": obs.image,
        "imageID": obs.image,
        "state": _state_api(obs.state),
        "lastState": _state_api(obs.last_state) if obs.last_state else {},
        "ready": obs.ready,
        "restartCount": obs.restart_count,
        "started": obs.started,
    }
    if obs.container_id:
        out["containerID"] = obs.container_id
    return out


def pod_phase(restart_policy: str, init: list[ContainerObs], main: list[ContainerObs]) -> str:
    """kubelet's getPhase for a pod whose sandbox exists."""
    for c in init:
        if isinstance(c.state, Terminated) and c.state.exit_code == 0:
            continue
        if isinstance(c.state, Terminated) and restart_policy == "Never":
            return "Failed"
        return "Pending"
    running = waiting = stopped = succeeded = 0
    for c in main:
        if isinstance(c.state, Running):
            running += 1
        elif isinstance(c.state, Terminated):
            stopped += 1
            succeeded += c.state.exit_code == 0
        elif c.last_state is not None:  # waiting to be restarted
            stopped += 1
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if not stopped:
        return "Pending"
    if restart_policy == "Always":
        return "Running"
    if stopped == succeeded and all(isinstance(c.state, Terminated) for c in main):
        return "Succeeded"
    if restart_policy == "Never":
        return "Failed"
    return "Running"


def _condition(ctype: str, ok: bool, reason: str, message: str, previous: dict[str, Obj], now: str) -> Obj:
    status = "True" if ok else "False"
    old = previous.get(ctype)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    cond: Obj = {"type": ctype, "status": status, "lastProbeTime": None, "lastTransitionTime": since}
    # null removes a stale reason/message: the agent sends status as a strategic merge patch
    cond["reason"] = None if ok else reason
    cond["message"] = message if not ok and message else None
    return cond


@dataclass(frozen=True)
class PodView:
    """Everything `pod_status` needs besides the containers."""

    restart_policy: str
    pod_ip: str | None
    host_ip: str
    start_time: datetime
    sandbox_ready: bool
    readiness_gates: tuple[str, ...] = ()


def pod_status(view: PodView, init: list[ContainerObs], main: list[ContainerObs], previous: Obj, now: datetime) -> Obj:
    """The fields of the pod's `status` that the node owns, given the old status for transition times.

    Only the node's own conditions are listed: the agent sends this as a strategic merge patch,
    which merges conditions by type, so those of others (PodScheduled, DisruptionTarget,
    readiness gates) stay as they are.
    """
    ts = rfc3339(now)
    prev_conds = {c["type"]: c for c in previous.get("conditions") or []}
    phase = pod_phase(view.restart_policy, init, main)
    terminal = phase in ("Succeeded", "Failed")
    done_reason = "PodCompleted" if terminal else ""
    init_done = all(isinstance(c.state, Terminated) and c.state.exit_code == 0 for c in init)
    pending_init = [c.name for c in init if not (isinstance(c.state, Terminated) and c.state.exit_code == 0)]
    unready = [c.name for c in main if not c.ready]
    containers_ready = not unready
    gates_ok = all(prev_conds.get(g, {}).get("status") == "True" for g in view.readiness_gates)
    ours = {
        "PodReadyToStartContainers": _condition(
            "PodReadyToStartContainers", view.sandbox_ready and not terminal, "", "", prev_conds, ts
        ),
        "Initialized": _condition(
            "Initialized",
            init_done,
            done_reason or "ContainersNotInitialized",
            "" if terminal else f"containers with incomplete status: [{' '.join(pending_init)}]",
            prev_conds,
            ts,
        ),
        "ContainersReady": _condition(
            "ContainersReady",
            containers_ready,
            done_reason or "ContainersNotReady",
            "" if terminal else f"containers with unready status: [{' '.join(unready)}]",
            prev_conds,
            ts,
        ),
        "Ready": _condition(
            "Ready",
            containers_ready and gates_ok,
            done_reason or ("ContainersNotReady" if not containers_ready else "ReadinessGatesNotReady"),
            ""
            if terminal
            else (f"containers with unready status: [{' '.join(unready)}]" if unready else "readiness gates not ready"),
            prev_conds,
            ts,
        ),
    }
    status: Obj = {
        "phase": phase,
        "conditions": list(ours.values()),
        "hostIP": view.host_ip,
        "hostIPs": [{"ip": view.host_ip}],
        "startTime": rfc3339(view.start_time),
        "containerStatuses": [container_status_api(c) for c in main],
    }
    if init:
        status["initContainerStatuses"] = [container_status_api(c) for c in init]
    if view.pod_ip:
        status["podIP"] = view.pod_ip
        status["podIPs"] = [{"ip": view.pod_ip}]
    return status
