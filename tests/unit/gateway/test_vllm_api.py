"""vLLM's RL control routes at the gateway (rollfleet.gateway.vllm_api), in static mode: a gateway in front of
two simulated engines on real sockets. What each route did is read at the engines (their pause state, which
requests they ended and how). The same routes in Kubernetes mode go through the fleet's pause record, the path
of POST /v1/fleet/pause (e2e/test_gateway_kube.py)."""

from __future__ import annotations

import threading

import pytest
from tests.unit.gateway.conftest import TOKEN, Stack, sse_chunks
from tests.unit.gateway.test_proxy import wait_until

from rollfleet_client.protocol import (
    TRL_PREFIX,
    TRL_WEIGHT_SYNC_PATHS,
    VLLM_ABORT_REQUESTS_PATH,
    VLLM_IS_PAUSED_PATH,
    VLLM_PAUSE_PATH,
    VLLM_RESUME_PATH,
    VLLM_UPDATE_WEIGHT_VERSION_PATH,
    VLLM_WEIGHT_INFO_PATH,
)
from rollfleet_dev import oneshot

ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def is_paused(gw: Stack) -> bool:
    r = oneshot.get(gw.url + VLLM_IS_PAUSED_PATH, timeout=10)
    assert r.status_code == 200, r.text
    return bool(r.json()["is_paused"])


@pytest.mark.parametrize("prefix", ["", TRL_PREFIX])
def test_a_keep_pause_and_a_resume_reach_every_engine_as_vllms_own_routes_answer(gw: Stack, prefix: str) -> None:
    try:
        r = oneshot.post(gw.url + prefix + VLLM_PAUSE_PATH, params={"mode": "keep"}, headers=ADMIN, timeout=10)
        assert (r.status_code, r.json()) == (200, {"status": "paused"})
        assert [sim.pause_mode for sim in gw.sims] == ["keep", "keep"]
        assert is_paused(gw)
        r = oneshot.post(gw.url + prefix + VLLM_RESUME_PATH, headers=ADMIN, timeout=10)
        assert (r.status_code, r.json()) == (200, {"status": "resumed"})
        assert [sim.pause_mode for sim in gw.sims] == [None, None]
        assert not is_paused(gw)
    finally:
        oneshot.post(gw.url + VLLM_RESUME_PATH, headers=ADMIN, timeout=10)


def test_a_pause_without_a_mode_is_vllms_default_abort_and_an_unknown_mode_is_refused(gw: Stack) -> None:
    try:
        r = oneshot.post(gw.url + VLLM_PAUSE_PATH, params={"mode": "freeze"}, headers=ADMIN, timeout=10)
        assert r.status_code == 400 and "freeze" in r.json()["error"]["message"], r.text
        assert [sim.pause_mode for sim in gw.sims] == [None, None]
        r = oneshot.post(gw.url + VLLM_PAUSE_PATH, headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
        assert [sim.pause_mode for sim in gw.sims] == ["abort", "abort"]
    finally:
        oneshot.post(gw.url + VLLM_RESUME_PATH, headers=ADMIN, timeout=10)


def test_a_caller_name_that_is_not_a_name_is_refused_before_anything_pauses(gw: Stack) -> None:
    headers = {**ADMIN, "X-Rollfleet-Caller": "../../x y"}
    r = oneshot.post(gw.url + VLLM_PAUSE_PATH, params={"mode": "keep"}, headers=headers, timeout=10)
    assert r.status_code == 400 and "X-Rollfleet-Caller" in r.text, r.text
    assert [sim.pause_mode for sim in gw.sims] == [None, None]


@pytest.mark.parametrize(
    ("path", "params"),
    [(VLLM_PAUSE_PATH, {"mode": "keep"}), (VLLM_RESUME_PATH, {}), (VLLM_ABORT_REQUESTS_PATH, {})],
)
def test_the_routes_that_change_the_fleet_need_the_admin_token(gw: Stack, path: str, params: dict[str, str]) -> None:
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        r = oneshot.post(gw.url + path, params=params, headers=headers, json={"request_ids": ["x"]}, timeout=10)
        assert r.status_code == 401, r.text
    assert [sim.pause_mode for sim in gw.sims] == [None, None]


def stream_in_background(gw: Stack, rid: str, out: dict[str, str]) -> threading.Thread:
    """A slow streamed completion with id `rid`, read to its end in a thread (its body lands in `out[rid]`)."""
    started = threading.Event()

    def run() -> None:
        body = {"prompt": "x", "max_tokens": 2000, "stream": True}
        with oneshot.stream(
            "POST", gw.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=30
        ) as r:
            started.set()
            out[rid] = r.read().decode()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(10), f"{rid} did not start"
    wait_until(lambda: any(rid in sim.running for sim in gw.sims))
    return thread


@pytest.mark.parametrize("named", [True, False])
def test_abort_requests_ends_requests_at_their_engines(gw: Stack, named: bool) -> None:
    """With ids, those; with none (vLLM: everything it runs), every request in flight at this replica."""
    for sim in gw.sims:
        sim.token_delay_ms = 5
    out: dict[str, str] = {}
    threads = [stream_in_background(gw, rid, out) for rid in ("vllm-abort-1", "vllm-abort-2")]
    body = {"request_ids": ["vllm-abort-1"]} if named else {}
    r = oneshot.post(gw.url + VLLM_ABORT_REQUESTS_PATH, json=body, headers=ADMIN, timeout=30)
    assert (r.status_code, r.json()) == (200, {"status": "aborted", "aborted": 1 if named else 2}), r.text
    aborted = ["vllm-abort-1"] if named else ["vllm-abort-1", "vllm-abort-2"]
    for rid in aborted:
        assert any(sim.finished.get(rid) == "abort" for sim in gw.sims), f"{rid} was not aborted at its engine"
    if named:
        assert any("vllm-abort-2" in sim.running for sim in gw.sims), "an id not named was stopped"
        for sim in gw.sims:
            sim.token_delay_ms = 0
    for thread in threads:
        thread.join(30)
    finish = {rid: sse_chunks(text)[-1]["choices"][-1]["finish_reason"] for rid, text in out.items()}
    assert finish == {"vllm-abort-1": "abort", "vllm-abort-2": "abort" if not named else "length"}


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b'{"request_ids": "one-id"}', b'{"request_ids": [%b]}' % b",".join([b'"x"'] * 4097)],
)
def test_abort_requests_with_a_body_vllm_refuses_is_refused_and_stops_nothing(gw: Stack, body: bytes) -> None:
    r = oneshot.post(gw.url + VLLM_ABORT_REQUESTS_PATH, content=body, headers=ADMIN, timeout=10)
    assert r.status_code == 400, r.text


def test_weight_info_is_the_engines_version_when_they_agree(gw: Stack) -> None:
    r = oneshot.get(gw.url + VLLM_WEIGHT_INFO_PATH, timeout=10)
    assert (r.status_code, r.json()) == (200, {"weight_version": "v1"})
    gw.sims[1].weight_version = "v2"  # mid-sync: no one version serves
    assert oneshot.get(gw.url + VLLM_WEIGHT_INFO_PATH, timeout=10).json() == {"weight_version": None}


@pytest.mark.parametrize("path", [*TRL_WEIGHT_SYNC_PATHS, VLLM_UPDATE_WEIGHT_VERSION_PATH])
def test_vllms_weight_transfer_routes_are_refused_with_the_way_to_sync_instead(gw: Stack, path: str) -> None:
    r = oneshot.post(gw.url + path, json={}, headers=ADMIN, timeout=10)
    assert r.status_code == 501 and "SyncClient.push" in r.json()["error"]["message"], r.text
