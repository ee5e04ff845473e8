"""Pod phase, conditions and restart decisions from container observations."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from rollfleet_dev.localcluster.nodeagent.status import (
    BACKOFF_CAP_S,
    ContainerObs,
    PodView,
    Running,
    Terminated,
    Waiting,
    backoff_delay,
    pod_phase,
    pod_status,
    should_restart,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def run(name: str = "c", ready: bool = True) -> ContainerObs:
    return ContainerObs(name, "img", Running(T0), ready=ready, started=True)


def done(code: int, name: str = "c") -> ContainerObs:
    return ContainerObs(name, "img", Terminated(code, "Completed" if code == 0 else "Error", T0, T0))


def crashloop(name: str = "c") -> ContainerObs:
    return ContainerObs(
        name, "img", Waiting("CrashLoopBackOff"), last_state=Terminated(1, "Error", T0, T0), restart_count=1
    )


@pytest.mark.parametrize(
    ("policy", "init", "main", "phase"),
    [
        ("Always", [], [ContainerObs("c", "img")], "Pending"),
        ("Always", [], [run()], "Running"),
        ("Always", [], [crashloop()], "Running"),
        ("Always", [], [done(0)], "Running"),
        ("OnFailure", [], [done(0)], "Succeeded"),
        ("OnFailure", [], [done(1)], "Running"),
        ("Never", [], [done(0)], "Succeeded"),
        ("Never", [], [done(0, "a"), done(2, "b")], "Failed"),
        ("Never", [], [done(0, "a"), run("b")], "Running"),
        ("Never", [done(1, "i")], [ContainerObs("c", "img")], "Failed"),
        ("Always", [done(1, "i")], [ContainerObs("c", "img")], "Pending"),
        ("Always", [done(0, "i")], [run()], "Running"),
        ("Always", [ContainerObs("i", "img", Running(T0))], [ContainerObs("c", "img")], "Pending"),
    ],
)
def test_phase_like_kubelet(policy: str, init: list[ContainerObs], main: list[ContainerObs], phase: str) -> None:
    assert pod_phase(policy, init, main) == phase


def view(**kw: object) -> PodView:
    base = {
        "restart_policy": "Always",
        "pod_ip": "127.10.0.2",
        "host_ip": "127.10.0.1",
        "start_time": T0,
        "sandbox_ready": True,
    }
    return PodView(**{**base, **kw})  # type: ignore[arg-type]


def conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_ready_conditions_and_transition_times_kept() -> None:
    s1 = pod_status(view(), [], [run("a"), run("b", ready=False)], {}, T0)
    c = conds(s1)
    assert (
        c["ContainersReady"]["status"] == "False"
        and c["ContainersReady"]["message"] == "containers with unready status: [b]"
    )
    assert c["Initialized"]["status"] == "True" and c["Initialized"]["reason"] is None
    assert s1["podIP"] == "127.10.0.2" and s1["podIPs"] == [{"ip": "127.10.0.2"}]
    later = T0 + timedelta(seconds=30)
    s2 = pod_status(view(), [], [run("a"), run("b", ready=False)], s1, later)
    assert s2 == s1  # nothing changed: nothing to patch
    s3 = pod_status(view(), [], [run("a"), run("b")], s2, later)
    c3 = conds(s3)
    assert c3["Ready"]["status"] == "True" and c3["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:30Z"
    assert c3["Ready"]["reason"] is None and c3["Ready"]["message"] is None  # cleared by the merge patch
    assert c3["Initialized"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert "PodScheduled" not in c3  # the scheduler's, left alone


def test_readiness_gates_hold_ready_back() -> None:
    gated = view(readiness_gates=("example.com/gate",))
    assert conds(pod_status(gated, [], [run()], {}, T0))["Ready"]["status"] == "False"
    prev = {"conditions": [{"type": "example.com/gate", "status": "True"}]}
    assert conds(pod_status(gated, [], [run()], prev, T0))["Ready"]["status"] == "True"


def test_container_status_api_shape() -> None:
    s = pod_status(view(), [done(0, "init")], [crashloop()], {}, T0)
    cs = s["containerStatuses"][0]
    assert cs["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}
    assert cs["lastState"]["terminated"]["exitCode"] == 1 and cs["restartCount"] == 1
    assert s["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"


def test_completed_pod_conditions_say_pod_completed() -> None:
    s = pod_status(view(restart_policy="Never"), [], [done(0)], {}, T0)
    assert s["phase"] == "Succeeded"
    assert conds(s)["Ready"]["reason"] == "PodCompleted"


def test_restart_policy() -> None:
    assert should_restart("Always", 0) and should_restart("OnFailure", 1)
    assert not should_restart("OnFailure", 0) and not should_restart("Never", 1)


def test_backoff_doubles_caps_and_resets() -> None:
    delays = []
    d = None
    for _ in range(8):
        d = backoff_delay(d, ran_for_s=0.1)
        delays.append(d)
    assert delays[:5] == [1, 2, 4, 8, 16] and max(delays) == BACKOFF_CAP_S
    assert backoff_delay(BACKOFF_CAP_S, ran_for_s=10 * BACKOFF_CAP_S) == 1


def test_a_condition_someone_else_overwrote_is_put_back_and_theirs_are_left_alone() -> None:
    from rollfleet_dev.localcluster.nodeagent.pods import _overwritten

    sent = {"conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}
    # The node lifecycle controller marked the pod not ready: the agent patches its view back.
    assert _overwritten(sent, {"conditions": [{"type": "Ready", "status": "False"}]})
    # Its own status echoed by the watch, or with a condition only others write: nothing to do.
    assert not _overwritten(sent, sent)
    assert not _overwritten(sent, {"conditions": [*sent["conditions"], {"type": "DisruptionTarget", "status": "True"}]})
