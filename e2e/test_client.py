"""The trainer client (`rollfleet_client`) against the live fleet's gateway and REAL vLLM engines.

Token ids in, token ids and logprobs out; a cancelled or timed-out generate is aborted at the
engine (its tracker says so); every failure is a typed error carrying the server's message; a
pause asked for by the client is the fleet's annotation, recorded with who asked and checked at
the engines.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from pathlib import Path

import pytest
from bench.bench_sync import free_port, process

from e2e.fleet_helpers import Fleet, fleet_manifest
from e2e.live_fleet import Endpoint, LiveFleet
from e2e.provider import wait_for
from rollfleet.contract import ANNOTATION_PAUSE, RECORD_MODEL, STATE_PATH, weights_record_name
from rollfleet.sync.protocol import FleetRecord, PushPhase, PushRecord, WeightsRef, encode_record
from rollfleet_client import (
    AsyncRolloutClient,
    GatewayUnreachable,
    PushInProgress,
    RequestRefused,
    RolloutClient,
    Unauthorized,
)
from rollfleet_client.protocol import (
    CALLER_HEADER,
    FLEET_PATH,
    FLEET_PAUSE_PATH,
    FLEET_RESUME_PATH,
    VLLM_IS_PAUSED_PATH,
    VLLM_PAUSE_PATH,
    VLLM_RESUME_PATH,
    VLLM_WEIGHT_INFO_PATH,
)
from rollfleet_dev import oneshot
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


@pytest.fixture
def fleet(live: LiveFleet) -> LiveFleet:
    live.ready()
    return live


def connect(fleet: LiveFleet, token: str | None = None) -> AsyncRolloutClient:
    return AsyncRolloutClient(fleet.gateways[0].url, model="tiny", token=token or fleet.token, caller="e2e-trainer")


def engine_pause(engine: Endpoint) -> str | None:
    """The pause mode the engine itself reports (None: running)."""
    state = oneshot.get(engine.url + STATE_PATH, timeout=10).raise_for_status().json()
    return state["pause_mode"] if state["paused"] else None


def stopped_at_engine(fleet: LiveFleet, rid: str) -> bool:
    seen = fleet.tracked(rid)
    running = {r for ids in fleet.in_flight().values() for r in ids}
    return seen is not None and seen.get("finish_reason") == "abort" and rid not in running


def test_generate_returns_token_ids_logprobs_and_the_weight_version(fleet: LiveFleet) -> None:
    async def go() -> None:
        async with connect(fleet) as client:
            g = await client.generate([5, 6, 7], max_tokens=12, ignore_eos=True, logprobs=0, temperature=1.0)
            text = await client.generate("once upon a time", max_tokens=4, ignore_eos=True)
        assert len(g.token_ids) == 12 and g.logprobs is not None and len(g.logprobs) == 12
        assert all(lp <= 0 for lp in g.logprobs) and g.finish_reason == "length"
        assert g.prompt_token_ids == [5, 6, 7] and g.weight_version is not None and g.engines
        assert len(text.token_ids) == 4 and text.logprobs is None and text.text

    asyncio.run(go())


def test_cancelling_or_timing_out_a_generate_aborts_it_at_the_engine(fleet: LiveFleet) -> None:
    cancelled, waited, deadline = (f"cl-{what}-{uuid.uuid4().hex[:6]}" for what in ("cancel", "wait-for", "deadline"))

    def on_engine() -> bool:
        return any(cancelled in ids for ids in fleet.in_flight().values())

    async def go() -> None:
        async with connect(fleet) as client:
            task = asyncio.create_task(client.generate("long", request_id=cancelled, max_tokens=LONG, ignore_eos=True))
            await asyncio.to_thread(wait_for, on_engine, 60, interval=0.05, what=f"{cancelled} on an engine")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The caller's own timeout is a cancellation too.
            with pytest.raises(TimeoutError):
                long = client.generate("long", request_id=waited, max_tokens=LONG, ignore_eos=True)
                await asyncio.wait_for(long, timeout=2.0)
            # timeout_s: the gateway stops it at the engine at the deadline and answers with what was made.
            partial = await client.generate(
                "long", request_id=deadline, timeout_s=1.0, max_tokens=LONG, ignore_eos=True
            )
            assert partial.finish_reason == "abort" and len(partial.token_ids) < LONG, partial

    asyncio.run(go())
    for rid in (cancelled, waited, deadline):
        wait_for(lambda rid=rid: stopped_at_engine(fleet, rid), 30, what=f"{rid} aborted at its engine")


def test_failures_are_typed_errors_with_the_servers_message(fleet: LiveFleet) -> None:
    async def go() -> None:
        async with connect(fleet) as client:
            with pytest.raises(RequestRefused, match=r"(?i)vocab") as refused:
                await client.generate([1, 10**9], max_tokens=2)
            assert refused.value.status == 400
        async with connect(fleet, token="not-the-fleet-token") as client:
            with pytest.raises(Unauthorized, match="admin-token"):
                await client.abort(["anything"])
        async with AsyncRolloutClient("http://127.0.0.1:9", model="tiny") as nowhere:
            with pytest.raises(GatewayUnreachable, match=re.escape("127.0.0.1:9")):
                await nowhere.generate("hi", max_tokens=1)

    asyncio.run(go())


def test_pause_and_resume_from_the_client_are_the_fleets_annotation_and_reach_every_engine(fleet: LiveFleet) -> None:
    with RolloutClient(fleet.gateways[0].url, model="tiny", token=fleet.token, caller="e2e-trainer") as client:
        try:
            paused = client.pause("keep", wait_s=120)
            # The same place as `kubectl annotate`: the annotation, and the status saying who asked.
            assert fleet.fleet.get()["metadata"]["annotations"][ANNOTATION_PAUSE] == "keep"
            assert paused.pause is not None and paused.pause.mode == "keep"
            assert paused.pause.requested_by == "rollfleet-client/e2e-trainer"
            assert paused.pause.paused_engines == 2 and {e.phase for e in paused.engines} == {"Paused"}
            assert [engine_pause(e) for e in fleet.engines] == ["keep", "keep"]  # checked at the engines
            wide = fleet.cluster.kubectl("-n", fleet.namespace, "get", "rf", "live", "-o", "wide").stdout
            header, row = wide.splitlines()[:2]
            shown = [row[header.index(column) :].split()[0] for column in ("PAUSED ", "PAUSED-BY")]  # by position
            assert shown == ["keep", "rollfleet-client/e2e-trainer"], wide

            # A pause asked for with kubectl is the same pause: the client sees who asked, and undoes it.
            fleet.cluster.kubectl(
                "-n", fleet.namespace, "annotate", "--overwrite", "rf", "live", f"{ANNOTATION_PAUSE}=wait"
            )
            fleet.fleet.wait(
                lambda st: (st.get("pause") or {}).get("requestedBy") == "kubectl-annotate", "kubectl's pause recorded"
            )
            assert client.fleet_state().pause.mode == "wait"  # type: ignore[union-attr]
        finally:
            resumed = client.resume(wait_s=120)
        assert resumed.pause is None and {e.phase for e in resumed.engines} == {"Ready"}
        assert ANNOTATION_PAUSE not in (fleet.fleet.get()["metadata"].get("annotations") or {})
        assert [engine_pause(e) for e in fleet.engines] == [None, None]
        g = client.generate([5, 6], max_tokens=3, ignore_eos=True)
        assert len(g.token_ids) == 3 and g.weight_generation is not None


def test_vllms_own_pause_route_at_the_gateway_is_the_fleets_pause(fleet: LiveFleet) -> None:
    """What an RL framework calls on one vLLM server (SkyRL's remote engines: /pause?mode=keep around a weight
    update), called on the gateway: the fleet's annotation, checked at every engine."""
    url, admin = fleet.gateways[0].url, {**fleet.admin, CALLER_HEADER: "e2e-framework"}
    try:
        r = oneshot.post(url + VLLM_PAUSE_PATH, params={"mode": "keep"}, headers=admin, timeout=330)
        assert (r.status_code, r.json()) == (200, {"status": "paused"}), r.text
        assert fleet.fleet.get()["metadata"]["annotations"][ANNOTATION_PAUSE] == "keep"
        assert (fleet.fleet.get()["status"].get("pause") or {}).get("requestedBy") == "rollfleet-client/e2e-framework"
        assert [engine_pause(e) for e in fleet.engines] == ["keep", "keep"]
        assert oneshot.get(url + VLLM_IS_PAUSED_PATH, headers=fleet.inference, timeout=30).json() == {"is_paused": True}
    finally:
        r = oneshot.post(url + VLLM_RESUME_PATH, headers=admin, timeout=330)
    assert (r.status_code, r.json()) == (200, {"status": "resumed"}), r.text
    assert [engine_pause(e) for e in fleet.engines] == [None, None]
    assert oneshot.get(url + VLLM_IS_PAUSED_PATH, headers=fleet.inference, timeout=30).json() == {"is_paused": False}
    version = fleet.fleet.get()["status"]["weightVersion"]
    info = oneshot.get(url + VLLM_WEIGHT_INFO_PATH, headers=fleet.inference, timeout=30).json()
    assert info == {"weight_version": version}


def test_control_calls_refuse_bad_input_with_the_field_and_what_is_allowed(fleet: LiveFleet) -> None:
    admin = {**fleet.admin}
    url = fleet.gateways[0].url
    bad = oneshot.post(url + FLEET_PAUSE_PATH, json={"mode": "soon"}, headers=admin, timeout=30)
    assert bad.status_code == 400 and "keep" in bad.text and "soon" in bad.text
    unknown = oneshot.post(url + FLEET_RESUME_PATH, json={"mode": "keep"}, headers=admin, timeout=30)
    assert unknown.status_code == 400 and "mode" in unknown.text
    assert oneshot.get(url + FLEET_PATH, timeout=30).status_code == 401
    assert ANNOTATION_PAUSE not in (fleet.fleet.get()["metadata"].get("annotations") or {})  # nothing changed


def test_a_pause_while_a_weight_push_runs_is_a_conflict_that_changes_nothing(live: LiveFleet, tmp_path: Path) -> None:
    """The gateway (run here against the cluster's API server) refuses a pause or resume while the fleet's
    weights record shows a push in progress, as the sync sidecar writes it; once the push has ended the
    same call pauses. A fleet of 0 engines beside the live one (the operator serves that namespace): what
    is under test is the refusal, not the engines."""
    cluster, ns, name = live.cluster, live.namespace, f"ctl-{uuid.uuid4().hex[:6]}"
    try:
        manifest = fleet_manifest(name, ns, 0, gateway={"enabled": False})
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        record = weights_record_name(name)

        def stamped() -> bool:  # the operator has written the record's model: our writes are not reset
            got = cluster.kubectl("-n", ns, "get", "cm", record, "-o", "json", check=False)
            return got.returncode == 0 and RECORD_MODEL in (json.loads(got.stdout).get("data") or {})

        wait_for(stamped, 60, interval=0.2, what=f"the operator to stamp {record}")

        def write(rec: FleetRecord) -> None:
            data = {"data": {k: v for k, v in encode_record(rec).items() if v is not None}}
            cluster.kubectl("-n", ns, "patch", "cm", record, "--type=merge", "-p", json.dumps(data))

        committed = WeightsRef("a", 0)
        pushing = PushRecord(PushPhase.IN_PROGRESS, WeightsRef("b-1", 1), committed, time.time())
        write(FleetRecord(committed=committed, push=pushing, history=(("a", 0),)))
        (tmp_path / "token").write_text(live.token)
        port = free_port()
        cmd = [sys.executable, "-m", "rollfleet.gateway", "--fleet", name, "--namespace", ns, "--port", str(port)]
        cmd += ["--kubeconfig", str(cluster.kubeconfig), "--token-file", str(tmp_path / "token")]
        url = f"http://127.0.0.1:{port}"
        gateway = process(cmd, url + "/health", tmp_path / "gateway.log")
        with gateway, RolloutClient(url, model="tiny", token=live.token, caller="e2e-trainer") as client:
            with pytest.raises(PushInProgress, match="b-1"):
                client.pause("keep", wait_s=5)
            with pytest.raises(PushInProgress):
                client.resume(wait_s=5)
            assert ANNOTATION_PAUSE not in (Fleet(cluster, name, ns).get()["metadata"].get("annotations") or {})
            assert client.fleet_state().push == "b-1"

            write(FleetRecord(committed=WeightsRef("b-1", 1), history=(("a", 0), ("b-1", 1))))
            paused = client.pause("abort", wait_s=60)
            assert paused.pause is not None and paused.pause.requested_by == "rollfleet-client/e2e-trainer"
            assert paused.generations == {"a": 0, "b-1": 1} and paused.weight_generation == 1
            assert client.resume(wait_s=60).pause is None
    finally:
        cluster.kubectl("-n", ns, "delete", "rf", name, "--wait=false", check=False)
