"""One engine across two processes, as across two pods: vLLM's own multi-node modes on CPU, through the
launcher, with the flags the operator gives a LeaderWorkerSet group's pods (``--group-leader``, ``--group-pods``,
``--pod-rank``; the leader serves with Rollfleet's routes, the other rank runs ``serve --headless``).

- ``tp2``: tensor parallel 2 over vLLM's multiproc executor across nodes (``--nnodes 2``), each process
  one rank; the ranks talk over gloo (vLLM's CPU shared-memory all-reduce needs one host's memory).
- ``dp2``: data parallel 2, the leader's API server in front of its own engine core and the headless
  rank's (``--data-parallel-start-rank 1``); ``X-data-parallel-rank`` pins a request to a rank.

Each guarantee is checked at every rank: greedy tokens equal transformers', a weight update loads on
every rank (tensor-parallel ranks each pulling only their cut of each tensor: the model's bytes once),
abort by id ends the request wherever it runs, a keep-mode pause holds every rank and loses no token.
Issue 34 (docs/engine.md, "Engines across pods").
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from rollfleet_engine.protocol import STAGE_PATH
from rollfleet_engine.tiny_model import LONG_GENERATION as LONG
from rollfleet_engine.tiny_model import WEIGHTS_B_DIR, ensure_tiny_model
from rollfleet_engine.weights_server import WeightsServer

from .calls import (
    GREEDY_PROMPTS,
    PROMPT,
    Stream,
    complete,
    control,
    in_flight_ids,
    metric_reaches,
    rid,
    state,
    tracked,
)
from .conftest import START_TIMEOUT_S, TOKEN, Engine, engine_command, free_loopback_address, process, running
from .test_engine_live import _reference_greedy

pytestmark = [pytest.mark.engine, pytest.mark.multipod]

GREEDY_TOKENS = 12
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's: the data-parallel rank that serves this request


def shape_args(shape: str) -> list[str]:
    """vLLM's arguments of the engine; the launcher adds each rank's multi-node flags (rollfleet_engine.group)."""
    return ["--tensor-parallel-size", "2"] if shape == "tp2" else ["--data-parallel-size", "2"]


def rank_command(leader: list[str], rank: int) -> list[str]:
    """The leader's command as pod `rank` of the group runs it, as the operator's group manifest has it."""
    split = leader.index("--")
    ours = [*leader[:split], "--pod-rank", str(rank)]
    if rank:  # a headless rank serves no routes: no token, no port
        token = ours.index("--token-file")
        ours = [*ours[:token], *ours[token + 2 :], "--headless"]
    return [*ours, *leader[split:]]


@pytest.fixture(scope="module", params=["tp2", "dp2"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    shape = str(request.param)
    tmp = tmp_path_factory.mktemp(f"engine-{shape}")
    (tmp / "token").write_text(TOKEN + "\n")
    # Each group on a loopback address of its own: the group's ports (rollfleet_engine.group) are fixed.
    host, port = free_loopback_address()
    command = engine_command(ensure_tiny_model(), host, port, tmp / "token", "a-0")
    split = command.index("--")
    command = [*command[:split], "--group-leader", host, "--group-pods", "2", *command[split:], *shape_args(shape)]
    engine = Engine(f"http://{host}:{port}", TOKEN, "tiny", ensure_tiny_model(), tmp / "leader.log")
    # The other rank serves nothing: the leader is ready once every rank is.
    with (
        process(rank_command(command, 1), tmp / "rank.log"),
        running(rank_command(command, 0), engine, START_TIMEOUT_S) as ready,
    ):
        yield shape, ready


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    root = ensure_tiny_model()
    return {
        name: _reference_greedy(str(d), GREEDY_PROMPTS, GREEDY_TOKENS)
        for name, d in (("A", root), ("B", root / WEIGHTS_B_DIR))
    }


def ranks(shape: str) -> list[dict[str, str] | None]:
    """Headers that reach each rank that serves requests: DP pins a rank; TP's ranks serve every request."""
    return [{DP_RANK_HEADER: "0"}, {DP_RANK_HEADER: "1"}] if shape == "dp2" else [None]


def greedy(engine: Engine, headers: dict[str, str] | None) -> list[list[int]]:
    out = []
    for prompt in GREEDY_PROMPTS:
        r = complete(engine, prompt, GREEDY_TOKENS, headers=headers, ignore_eos=True).raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def test_every_rank_serves_transformers_tokens_and_loads_a_weight_update(
    group: tuple[str, Engine], references: dict[str, list[list[int]]]
) -> None:
    shape, engine = group
    assert references["A"] != references["B"]
    for headers in ranks(shape):
        assert greedy(engine, headers) == references["A"], headers
    host = engine.url.split("//")[1].split(":")[0]
    # Prefetch: every rank stages its part in its own process (its own pod) while the engine serves; the
    # load takes the staged parts. Tensor-parallel ranks move the model's bytes once between them (each its
    # cut of every tensor, the norms whole); each data-parallel rank holds the whole model and pulls it all.
    b_bytes = update_through_the_ranks_staging(
        engine, WeightsServer(engine.model_dir / WEIGHTS_B_DIR, host=host), "b-1"
    )
    for headers in ranks(shape):
        assert greedy(engine, headers) == references["B"], headers
    assert state(engine)["weight_version"] == "b-1"
    # Without prefetch (a sidecar's --no-prefetch), each rank pulls its part in the pause: the same bytes.
    a_bytes = update_pulled_in_the_pause(engine, WeightsServer(engine.model_dir, host=host), "a-2")
    for headers in ranks(shape):
        assert greedy(engine, headers) == references["A"], headers
    assert state(engine)["weight_version"] == "a-2"
    for sent, total in (b_bytes, a_bytes):
        assert (sent <= 1.05 * total) if shape == "tp2" else (sent >= 2 * total), (shape, sent, total)


def update_through_the_ranks_staging(engine: Engine, server: WeightsServer, version: str) -> tuple[int, int]:
    """Stage on every rank, then load what they staged; the bytes the weights server sent, and the model's."""
    server.start()
    try:
        r = control(engine, STAGE_PATH, json=server.update_info())
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while (staged := control(engine, STAGE_PATH + "?wait=10", method="GET").json())["state"] == "staging":
            assert time.monotonic() < deadline, staged
        assert staged["state"] == "staged" and staged["staged_url"].startswith("rank-staged://"), staged
        sent = server.bytes_sent  # all of it, before the pause
        load(engine, {"url": staged["staged_url"], "manifest_sha256": server.update_info()["manifest_sha256"]}, version)
        assert server.bytes_sent == sent  # the load read the staged parts only
    finally:
        server.stop()
    return sent, server.manifest.total_bytes


def update_pulled_in_the_pause(engine: Engine, server: WeightsServer, version: str) -> tuple[int, int]:
    server.start()
    try:
        load(engine, server.update_info(), version)
    finally:
        server.stop()
    return server.bytes_sent, server.manifest.total_bytes


def load(engine: Engine, info: dict[str, object], version: str) -> None:
    assert control(engine, "/init_weight_transfer_engine", json={"init_info": {}}).status_code == 200
    assert control(engine, "/start_weight_update").status_code == 200
    r = control(engine, "/update_weights", json={"update_info": info})
    assert r.status_code == 200, r.text
    assert control(engine, "/finish_weight_update", json={"weight_version": version}).status_code == 200


def test_abort_by_id_ends_the_request_on_whichever_rank_runs_it(group: tuple[str, Engine]) -> None:
    shape, engine = group
    streams = [Stream(engine, rid(f"abort-{shape}"), LONG, headers=h) for h in ranks(shape)]
    for s in streams:
        s.wait_tokens(4)
    ids = [s.request_id for s in streams]
    t0 = time.monotonic()
    r = control(engine, "/rollfleet/v1/abort", json={"request_ids": ids})
    assert r.status_code == 200 and r.json()["results"] == dict.fromkeys(ids, "aborted"), r.text
    for s in streams:
        s.join()
        assert s.finish_reason == "abort" and 4 <= len(s.tokens) < LONG, (s.finish_reason, len(s.tokens))
        assert tracked(engine, s.request_id)["phase"] == "finished"
    assert time.monotonic() - t0 < 10  # no rank waits on another's step: nothing deadlocks
    assert not in_flight_ids(engine) & set(ids)
    # At each engine core itself: vLLM's counters, which the leader reports per data parallel rank.
    for core in ["0", "1"] if shape == "dp2" else ["0"]:
        metric_reaches(engine, "vllm:num_requests_running", 0, timeout=5, engine=core)
    assert complete(engine, PROMPT, 4).status_code == 200  # and the engine serves on


def test_pause_keep_holds_every_rank_and_loses_no_token(group: tuple[str, Engine]) -> None:
    shape, engine = group
    tokens = 48  # tensor parallel over gloo decodes at about 7 tokens/s here
    baselines = [complete(engine, PROMPT, tokens, headers=h, ignore_eos=True).json() for h in ranks(shape)]
    streams = [Stream(engine, rid(f"keep-{shape}"), tokens, headers=h) for h in ranks(shape)]
    for s in streams:
        s.wait_tokens(5)
    assert control(engine, "/pause?mode=keep").status_code == 200
    try:
        paused_at = time.monotonic()
        assert state(engine)["paused"] is True
        time.sleep(1.5)  # the observation window: no token may arrive in it, at any rank
        resumed_at = time.monotonic()
    finally:  # a failure here must not leave the group paused for the tests after it
        assert control(engine, "/resume").status_code == 200
    for s, baseline in zip(streams, baselines, strict=True):
        s.join()
        assert [t for t in s.arrivals if paused_at + 0.2 < t < resumed_at] == []
        assert s.finish_reason == "length" and s.tokens == baseline["choices"][0]["token_ids"]
    assert state(engine)["paused"] is False
