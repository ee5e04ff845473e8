"""The access middleware in front of a stand-in ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from rollfleet_engine.access import AccessPolicy
from rollfleet_engine.engine_hooks import current_caller_id
from rollfleet_engine.middleware import RollfleetMiddleware
from rollfleet_engine.protocol import LOAD_PATH, MIXED_WEIGHTS_MARK, PAUSE_AND_LOOK_PATH, REQUESTS_PATH, STATE_PATH
from rollfleet_engine.runtime import Runtime


class App:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], str | None]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.calls.append((scope["path"], headers, current_caller_id.get()))
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(
    mw: RollfleetMiddleware,
    path: str,
    headers: dict[str, str],
    body: dict[str, Any] | None = None,
    sent: list[dict[str, Any]] | None = None,
) -> dict:
    sent = [] if sent is None else sent
    payload = json.dumps(body or {}).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"mode=keep",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    asyncio.run(mw(scope, receive, send))
    start = sent[0]
    return {"status": start["status"], "headers": {k.decode(): v.decode() for k, v in start["headers"]}}


class Engine:
    """What the middleware asks vLLM's engine client: the version after a version route, and the cache
    resets after a finished update (each recorded, with what had been sent by then)."""

    def __init__(self, sent: list[dict[str, Any]] | None = None, resets: bool = True) -> None:
        self.sent = sent if sent is not None else []
        self.resets = resets
        self.calls: list[tuple[str, Any, int]] = []

    async def get_weight_version(self) -> str:
        return "v8"

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.calls.append(("prefix", reset_running_requests, len(self.sent)))
        return self.resets

    async def reset_mm_cache(self) -> None:
        self.calls.append(("mm", None, len(self.sent)))

    async def reset_encoder_cache(self) -> None:
        self.calls.append(("encoder", None, len(self.sent)))


CONTROL = {"Authorization": "Bearer ctl"}


def make(backend: str = "http") -> tuple[RollfleetMiddleware, App, Runtime]:
    app = App()
    runtime = Runtime(engine=Engine(), policy=AccessPolicy("ctl"), model_name="m", weight_backend=backend)
    runtime.weight_version = "v7"
    return RollfleetMiddleware(app, runtime), app, runtime


def test_refused_control_call_reaches_nothing() -> None:
    mw, app, runtime = make()
    assert call(mw, "/pause", {})["status"] == 401
    assert call(mw, "/pause", {"Authorization": "Bearer wrong"})["status"] == 401
    assert app.calls == [] and runtime.pause_mode is None
    assert call(mw, "/pause", {"Authorization": "Bearer ctl"})["status"] == 200
    assert runtime.pause_mode == "keep"


def test_caller_id_from_header_body_or_new() -> None:
    mw, app, runtime = make()
    r = call(mw, "/v1/completions", {"X-Request-Id": "h1"})
    assert r["headers"]["x-request-id"] == "h1" and r["headers"]["x-rollfleet-weight-version"] == "v7"
    assert app.calls[-1][2] == "h1"
    call(mw, "/v1/completions", {}, {"request_id": "b1"})
    assert app.calls[-1][1]["x-request-id"] == "b1" and app.calls[-1][2] == "b1"
    r = call(mw, "/v1/chat/completions", {})
    assert r["headers"]["x-request-id"].startswith("rf-")
    assert runtime.tracker.get("h1") is not None and runtime.tracker.view().in_flight == []


def test_in_flight_id_cannot_be_reused() -> None:
    mw, app, runtime = make()
    runtime.tracker.open("dup")
    assert call(mw, "/v1/completions", {"X-Request-Id": "dup"})["status"] == 409
    assert app.calls == []


def test_a_collective_update_leaves_the_weights_no_one_version_until_it_finishes() -> None:
    mw, app, runtime = make("gloo")
    assert call(mw, "/start_weight_update", CONTROL)["status"] == 200
    assert runtime.weights_intact is False
    reached = len(app.calls)
    assert call(mw, "/resume", CONTROL)["status"] == 409  # refused here: vLLM never sees it
    assert len(app.calls) == reached
    assert call(mw, "/finish_weight_update", CONTROL)["status"] == 200
    assert (runtime.weights_intact, runtime.weight_version) == (True, "v8")
    assert call(mw, "/resume", CONTROL)["status"] == 200


def test_a_finished_update_drops_the_old_weights_caches_before_its_answer_leaves() -> None:
    sent: list[dict[str, Any]] = []
    mw, _, runtime = make()
    runtime.engine = engine = Engine(sent)
    assert call(mw, "/finish_weight_update", CONTROL, sent=sent)["status"] == 200
    # Held requests' blocks too (they recompute on the new weights), and all before the caller could resume.
    assert engine.calls == [("prefix", True, 0), ("mm", None, 0), ("encoder", None, 0)]
    assert (runtime.weights_intact, runtime.weight_version) == (True, "v8")
    engine.calls.clear()
    for path in ("/pause", "/start_weight_update", "/update_weights", "/update_weight_version", "/resume"):
        assert call(mw, path, CONTROL)["status"] == 200
    assert engine.calls == []  # only a finished update replaced the weights


def test_caches_that_cannot_be_dropped_keep_the_engine_from_resuming_until_a_full_update() -> None:
    mw, _, runtime = make()
    runtime.engine = Engine(resets=False)
    assert call(mw, "/finish_weight_update", CONTROL)["status"] == 200
    assert runtime.weights_intact is False
    assert call(mw, "/resume", CONTROL)["status"] == 409
    runtime.engine = Engine()
    assert call(mw, "/finish_weight_update", CONTROL)["status"] == 200
    assert call(mw, "/resume", CONTROL)["status"] == 200


def test_the_engine_reports_the_manifest_its_last_update_was_verified_against_and_a_relabel_keeps_it() -> None:
    mw, _, runtime = make()
    assert runtime.weights_manifest_sha256 is None  # the weights it started with: no manifest

    def update(*infos: Any) -> str | None:
        assert call(mw, "/start_weight_update", CONTROL)["status"] == 200
        for info in infos:
            assert call(mw, "/update_weights", CONTROL, {"update_info": info})["status"] == 200
        assert call(mw, "/finish_weight_update", CONTROL)["status"] == 200
        return runtime.weights_manifest_sha256

    assert update({"url": "http://w:8471/weights", "manifest_sha256": "aa11"}) == "aa11"
    assert call(mw, "/update_weight_version", CONTROL)["status"] == 200  # a new label, the same bytes
    assert runtime.weights_manifest_sha256 == "aa11"
    assert update({"url": "file:///dev/shm/staged", "manifest_sha256": "bb22"}) == "bb22"  # prefetched
    assert update({"url": "rank-staged://cc33"}) == "cc33"  # each rank staged its part against it
    assert (
        update({"url": "http://w:8471/weights", "manifest_sha256": "dd44"}, {"url": "x", "manifest_sha256": "dd44"})
        == "dd44"
    )
    # Not pinned to one manifest: nothing to prove.
    assert update({"url": "http://w:8471/weights"}) is None
    assert update({"url": "a", "manifest_sha256": "ee55"}, {"url": "b", "manifest_sha256": "ff66"}) is None
    assert update([{"url": "a", "manifest_sha256": "ee55"}]) is None  # an update_info per rank


def test_an_in_place_update_has_no_manifest_to_prove_from_its_start() -> None:
    mw, _, runtime = make("gloo")
    runtime.weights_manifest_sha256 = "aa11"
    assert call(mw, "/start_weight_update", CONTROL)["status"] == 200
    assert runtime.weights_manifest_sha256 is None
    assert call(mw, "/update_weights", CONTROL, {"update_info": {"names": ["w"]}})["status"] == 200
    assert call(mw, "/finish_weight_update", CONTROL)["status"] == 200
    assert runtime.weights_manifest_sha256 is None


def test_an_http_update_loads_at_finish_so_its_start_leaves_the_weights_intact() -> None:
    mw, _, runtime = make("http")
    assert call(mw, "/start_weight_update", CONTROL)["status"] == 200
    assert runtime.weights_intact is True
    assert call(mw, "/resume", CONTROL)["status"] == 200


class FailingApp:
    """vLLM's answer to a weight route whose worker raised: a 500 with the error, then the exception."""

    def __init__(self, error: str) -> None:
        self.error = error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = json.dumps({"error": {"message": self.error}}).encode()
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": body})
        raise RuntimeError(self.error)


def test_a_load_that_failed_midway_leaves_the_weights_not_intact_and_a_transfer_that_failed_does_not() -> None:
    _, _, runtime = make("http")
    for error, intact in (("sha256 mismatch", True), (f"{MIXED_WEIGHTS_MARK} does not fit", False)):
        mw = RollfleetMiddleware(FailingApp(error), runtime)
        with contextlib.suppress(RuntimeError):
            call(mw, "/update_weights", CONTROL)
        assert runtime.weights_intact is intact, error


def test_a_request_s_weight_lag_bound_is_kept_with_it_and_a_bad_one_refused() -> None:
    mw, app, runtime = make()
    call(mw, "/v1/completions", {"X-Request-Id": "b0", "X-Rollfleet-Max-Weight-Lag": "0"})
    tracked = runtime.tracker.get("b0")
    assert tracked is not None and tracked.max_weight_lag == 0
    call(mw, "/v1/completions", {"X-Request-Id": "free"})
    free = runtime.tracker.get("free")
    assert free is not None and free.max_weight_lag is None
    for bad in ("-1", "one", "1.5", "", "1000001"):
        r = call(mw, "/v1/completions", {"X-Request-Id": f"bad{bad}", "X-Rollfleet-Max-Weight-Lag": bad})
        assert r["status"] == 400, bad
    assert [c[2] for c in app.calls] == ["b0", "free"]  # a refused one never reached vLLM


class _Output:
    def __init__(self, token_ids: list[int], finish_reason: str | None = None, spans: list[Any] | None = None):
        self.token_ids, self.finish_reason, self.weight_versions = token_ids, finish_reason, spans


class _RequestOutput:
    def __init__(self, outputs: list[_Output], finished: bool = False) -> None:
        self.outputs, self.finished = outputs, finished


def test_tokens_in_flight_carry_the_version_served_when_they_came_out() -> None:
    """vLLM gives a request's version spans only with its final output: in flight, the tracker must still know
    which weights made its tokens, or the sync sidecar cannot tell a stale request from a fresh one."""
    from rollfleet_engine.engine_hooks import install_generate_hook

    runtime = Runtime(engine=None, policy=AccessPolicy("ctl"), model_name="m", weight_backend="http")
    runtime.weight_version = "A"
    seen: list[list[str]] = []

    class _Engine:
        async def _gen(self) -> Any:
            yield _RequestOutput([_Output([])])  # nothing decoded yet
            seen.append(runtime.tracker.get("r").weight_versions)  # type: ignore[union-attr]
            yield _RequestOutput([_Output([5])])
            seen.append(runtime.tracker.get("r").weight_versions)  # type: ignore[union-attr]
            runtime.weight_version = "B"  # a push swapped the weights in a pause
            yield _RequestOutput([_Output([5, 6])])  # cumulative outputs: every token so far
            seen.append(runtime.tracker.get("r").weight_versions)  # type: ignore[union-attr]
            yield _RequestOutput([_Output([5, 6, 7, 8])])

        def generate(self, prompt: Any, params: Any, request_id: str) -> Any:
            return self._gen()

    engine = _Engine()
    install_generate_hook(engine, runtime.tracker, lambda: runtime.weight_version)

    async def run() -> None:
        runtime.tracker.open("r")
        token = current_caller_id.set("r")
        try:
            async for _ in engine.generate([1], object(), "cmpl-r"):
                pass
        finally:
            current_caller_id.reset(token)

    asyncio.run(run())
    assert seen == [[], ["A"], ["A", "B"]]
    tracked = runtime.tracker.get("r")
    assert tracked is not None
    segments = [(s.version, s.start, s.end) for s in tracked.weight_segments]
    assert segments == [("A", 0, 1), ("B", 1, 4)]  # the token counts add up to the 4 tokens out


class ScriptedApp:
    """vLLM's routes as a load in one call meets them: each path's answer (status, body), and whether it raises
    after answering (as vLLM's error middleware does); every call recorded with its body."""

    def __init__(self, answers: dict[str, tuple[int, bytes]], raises: frozenset[str] = frozenset()) -> None:
        self.answers, self.raises = answers, raises
        self.calls: list[tuple[str, str, bytes, str | None]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        authorization = dict(scope["headers"]).get(b"authorization", b"").decode()
        self.calls.append((scope["method"], scope["path"], message["body"], authorization))
        status, body = self.answers.get(scope["path"], (200, b"{}"))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})
        if scope["path"] in self.raises:
            raise RuntimeError(body.decode())


def load(mw: RollfleetMiddleware, body: Any, headers: dict[str, str] = CONTROL) -> tuple[int, Any]:
    sent: list[dict[str, Any]] = []
    answer = call(mw, LOAD_PATH, headers, body, sent)
    return answer["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def scripted(app: ScriptedApp) -> tuple[RollfleetMiddleware, Runtime]:
    runtime = Runtime(engine=Engine(), policy=AccessPolicy("ctl"), model_name="m", weight_backend="http")
    return RollfleetMiddleware(app, runtime), runtime


LOAD = {"update_info": {"url": "file:///dev/shm/staged/aa11", "manifest_sha256": "aa11"}, "weight_version": "v9"}
STATE = json.dumps({"weight_version": "v9", "weights_manifest_sha256": "aa11"}).encode()


def test_a_load_in_one_call_runs_vllms_three_in_order_with_their_bookkeeping_then_answers_the_state() -> None:
    app = ScriptedApp({STATE_PATH: (200, STATE)})
    mw, runtime = scripted(app)
    assert load(mw, LOAD) == (200, json.loads(STATE))
    assert [(m, p) for m, p, _, _ in app.calls] == [
        ("POST", "/start_weight_update"),
        ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"),
        ("GET", STATE_PATH),
    ]
    sent = json.loads(app.calls[1][2])["update_info"]
    assert sent["manifest_sha256"] == "aa11" and "second_url" not in sent  # vLLM's http backend takes no more
    assert json.loads(app.calls[2][2]) == {"weight_version": "v9"}
    assert {auth for *_, auth in app.calls} == {"Bearer ctl"}  # each step with the caller's credential
    # The steps' own bookkeeping ran: the proof of the bytes, the caches dropped before the answer.
    assert runtime.weights_manifest_sha256 == "aa11" and runtime.weights_intact
    assert [name for name, *_ in runtime.engine.calls] == ["prefix", "mm", "encoder"]


def test_a_load_in_one_call_passes_over_a_refused_start_and_answers_the_first_failure_after_it() -> None:
    # A session a dead sidecar left open: start is refused, update and finish continue it.
    app = ScriptedApp({"/start_weight_update": (409, b'{"error": "open"}'), STATE_PATH: (200, STATE)})
    mw, _ = scripted(app)
    assert load(mw, LOAD)[0] == 200 and len(app.calls) == 4

    # An update that fails answers for the call; nothing is finished.
    error = json.dumps({"error": {"message": "sha256 mismatch"}}).encode()
    app = ScriptedApp({"/update_weights": (500, error)}, raises=frozenset({"/update_weights"}))
    mw, runtime = scripted(app)
    assert load(mw, LOAD) == (500, json.loads(error))
    assert [p for _, p, _, _ in app.calls] == ["/start_weight_update", "/update_weights"]
    assert runtime.engine.calls == []  # not finished: the old weights and their caches stand


def test_a_load_in_one_call_is_refused_without_the_token_or_a_whole_body_and_changes_nothing() -> None:
    app = ScriptedApp({})
    mw, _ = scripted(app)
    assert load(mw, LOAD, {"Authorization": "Bearer wrong"})[0] == 401
    for bad in ({"weight_version": "v9"}, {"update_info": LOAD["update_info"]}, dict(LOAD, weight_version="")):
        status, answer = load(mw, bad)
        assert status == 400 and "a load needs update_info and weight_version" in answer["error"], bad
    assert app.calls == []


def test_a_pause_and_a_look_in_one_call_runs_vllms_pause_with_its_mode_then_answers_the_requests() -> None:
    view = json.dumps({"in_flight": [], "recently_finished": []}).encode()
    app = ScriptedApp({REQUESTS_PATH: (200, view)})
    mw, runtime = scripted(app)
    sent: list[dict[str, Any]] = []
    assert call(mw, PAUSE_AND_LOOK_PATH, CONTROL, sent=sent)["status"] == 200  # the query string: mode=keep
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:])) == json.loads(view)
    assert [(m, p) for m, p, _, _ in app.calls] == [("POST", "/pause"), ("GET", REQUESTS_PATH)]
    assert runtime.pause_mode == "keep"  # the pause's own bookkeeping ran
    refused = ScriptedApp({"/pause": (400, b'{"error": "no"}')})
    mw, runtime = scripted(refused)
    assert call(mw, PAUSE_AND_LOOK_PATH, CONTROL)["status"] == 400 and runtime.pause_mode is None
    assert [p for _, p, _, _ in refused.calls] == ["/pause"]  # nothing looked at after a refused pause
