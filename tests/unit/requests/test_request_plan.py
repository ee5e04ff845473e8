"""Pure planning of a RolloutRequest: ids, gateway calls, answers, schedule, abort/deadline/TTL, staleness."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rollfleet.api.request import Prompt, RolloutRequestSpec
from rollfleet.contract import ANNOTATION_ABORT
from rollfleet.controller.requests import plan
from rollfleet.controller.requests.plan import Outcome, SampleResult

UID = "0b8f7a52-3f0e-4d2c-9a57-8d7f6f0d2c11"


def spec(**kw: object) -> RolloutRequestSpec:
    return RolloutRequestSpec.model_validate({"fleet": "tiny", "prompts": [{"text": "a"}], **kw})


def test_sample_ids_are_stable_unique_and_parse_back() -> None:
    ids = {plan.sample_id(UID, (p, s)) for p in range(64) for s in range(4)}
    assert len(ids) == 256
    assert plan.sample_id(UID, (3, 1)) == f"{UID}-3-1"  # same input, same id: what makes restarts safe
    assert all(plan.parse_sample_id(UID, i) is not None for i in ids)
    assert plan.parse_sample_id(UID, f"{UID}-12-3") == (12, 3)
    assert plan.parse_sample_id("other-uid", f"{UID}-12-3") is None
    assert plan.parse_sample_id(UID, f"{UID}-12") is None


def test_jsonl_prompts_accept_objects_and_strings_and_name_the_bad_line() -> None:
    text = '"plain"\n\n{"text": "t"}\n{"messages": [{"role": "user", "content": "hi"}]}\n{"tokenIds": [1, 2]}\n'
    prompts = plan.prompts_from_jsonl(text, "cm/k")
    assert [p.text for p in prompts[:2]] == ["plain", "t"]
    assert prompts[2].messages is not None and prompts[3].token_ids == [1, 2]
    with pytest.raises(plan.PromptError, match="cm/k line 2"):
        plan.prompts_from_jsonl('"ok"\n{"text": "a", "tokenIds": [1]}\n', "cm/k")
    with pytest.raises(plan.PromptError, match="line 1: not a prompt"):
        plan.prompts_from_jsonl("{nope", "cm/k")


def test_digest_changes_with_the_prompts() -> None:
    a = [Prompt(text="x"), Prompt(text="y")]
    assert plan.prompts_digest(a) == plan.prompts_digest([Prompt(text="x"), Prompt(text="y")])
    assert plan.prompts_digest(a) != plan.prompts_digest([Prompt(text="y"), Prompt(text="x")])


def test_calls_pick_the_route_by_prompt_form_and_carry_id_group_and_seed() -> None:
    s = spec(sampling={"maxTokens": 8, "seed": 100, "temperature": 0.7}, stickiness="Prompt")
    c = plan.build_call(s, "tiny", UID, (2, 3), Prompt(text="hello"))
    assert c.path == plan.COMPLETIONS_PATH
    assert c.body == {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 8,
        "temperature": 0.7,
        "seed": 103,
        "return_token_ids": True,
    }
    assert c.headers == {"X-Request-Id": f"{UID}-2-3", "X-Group-Id": f"{UID}-2"}
    chat = plan.build_call(
        spec(stickiness="None"),
        "tiny",
        UID,
        (0, 0),
        Prompt.model_validate({"messages": [{"role": "user", "content": "hi"}]}),
    )
    assert chat.path == plan.CHAT_PATH and chat.body["messages"] == [{"role": "user", "content": "hi"}]
    assert "X-Group-Id" not in chat.headers
    gen = plan.build_call(spec(stickiness="Request"), "tiny", UID, (0, 1), Prompt(token_ids=[5, 6]), timeout_s=3)
    assert gen.path == plan.GENERATE_PATH and gen.body["token_ids"] == [5, 6]
    assert gen.body["sampling_params"]["max_tokens"] == 256
    assert gen.headers["X-Group-Id"] == UID and gen.headers["X-Rollfleet-Timeout"] == "3.000"
    bounded = plan.build_call(spec(maxWeightStaleness=1), "tiny", UID, (0, 0), Prompt(text="hi"))
    assert bounded.headers["X-Rollfleet-Max-Weight-Lag"] == "1"  # routed within it, aborted at a push past it


def test_answers_are_interpreted_without_trusting_a_broken_call() -> None:
    kw = {"uid": UID, "key": (1, 2), "started_at": 10.0, "finished_at": 12.5}
    ok = {"choices": [{"text": "hi", "token_ids": [1, 2, 3], "finish_reason": "length"}]}
    outcome, result = plan.interpret(200, ok, {"x-rollfleet-weight-version": "v1,v2"}, abort_wanted=False, **kw)
    assert outcome is Outcome.COMPLETED and result is not None
    assert (result.text, result.token_ids, result.weight_version, result.weight_versions) == (
        "hi",
        [1, 2, 3],
        "v1",
        ["v1", "v2"],
    )
    chat = {"choices": [{"message": {"content": "yo"}, "token_ids": [4], "finish_reason": "stop"}]}
    assert plan.interpret(200, chat, {}, abort_wanted=False, **kw)[1].text == "yo"  # type: ignore[union-attr]
    aborted = {"choices": [{"text": "par", "token_ids": [9], "finish_reason": "abort"}]}
    assert plan.interpret(200, aborted, {}, abort_wanted=True, **kw)[0] is Outcome.ABORTED
    # Aborted by a pause or a drain, not by us: the id is free and the sample runs again.
    assert plan.interpret(200, aborted, {}, abort_wanted=False, **kw) == (Outcome.RETRY, None)
    assert plan.interpret(409, {"error": {}}, {}, abort_wanted=False, **kw) == (Outcome.UNSURE, None)
    assert plan.interpret(502, None, {}, abort_wanted=False, **kw) == (Outcome.UNSURE, None)
    assert plan.interpret(429, {}, {}, abort_wanted=False, **kw) == (Outcome.RETRY, None)
    outcome, failed = plan.interpret(400, {"error": {"message": "prompt too long"}}, {}, abort_wanted=False, **kw)
    assert outcome is Outcome.FAILED and failed is not None and failed.error == "HTTP 400: prompt too long"
    # An answer without choices ended the id: a failed sample, not one to resend for ever.
    outcome, empty = plan.interpret(200, {"choices": []}, {}, abort_wanted=False, **kw)
    assert outcome is Outcome.FAILED and empty is not None and "without choices" in (empty.error or "")


def test_each_tokens_logprob_is_kept_in_every_dialect_and_survives_the_stored_line() -> None:
    kw = {"uid": UID, "key": (0, 0), "started_at": 1.0, "finished_at": 2.0, "abort_wanted": False}
    completions = {
        "token_logprobs": [-0.5, -1.25],
        "tokens": ["a", "b"],
        "top_logprobs": [{}, {}],
        "text_offset": [0, 1],
    }
    chat = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}, {"token": "b", "logprob": -1.25}]}
    token_in = {"content": [{"token_id": 7, "logprob": -0.5, "top_logprobs": []}, {"token_id": 8, "logprob": -1.25}]}
    for logprobs in (completions, chat, token_in):
        body = {"choices": [{"text": "ab", "token_ids": [7, 8], "finish_reason": "length", "logprobs": logprobs}]}
        _, result = plan.interpret(200, body, {}, **kw)
        assert result is not None and result.logprobs == [-0.5, -1.25]
        assert plan.SampleResult.from_line(result.line()) == result
    _, plain = plan.interpret(
        200, {"choices": [{"text": "ab", "token_ids": [7, 8], "finish_reason": "stop"}]}, {}, **kw
    )
    assert plain is not None and plain.logprobs is None


@pytest.mark.parametrize(
    ("answer", "resend"),
    [
        ("aborted", True),
        ("finished", True),
        ("unknown", True),
        ("pending", False),
        ("unconfirmed", False),
        (None, False),
    ],
)
def test_a_sample_is_sent_again_only_once_the_gateway_confirmed_it_runs_nowhere(
    answer: str | None, resend: bool
) -> None:
    assert plan.stopped_for_sure(answer) is resend


def test_a_run_is_stuck_only_with_samples_waiting_a_fleet_to_take_them_and_none_in_flight() -> None:
    def since(previous: float | None, in_flight: int = 0, waiting: int = 3, can_send: bool = True) -> float | None:
        return plan.stuck_since(previous, in_flight=in_flight, waiting=waiting, can_send=can_send, now=50.0)

    assert since(None) == 50.0 and since(20.0) == 20.0  # stuck now, or still stuck since 20
    assert since(20.0, in_flight=1) is None
    assert since(20.0, waiting=0) is None  # done
    assert since(20.0, can_send=False) is None  # paused, or no gateway: waiting is right


def test_result_lines_round_trip() -> None:
    r = SampleResult(
        prompt=1,
        sample=2,
        request_id=f"{UID}-1-2",
        finish_reason="stop",
        text="é",
        token_ids=[1],
        weight_version="v1",
        weight_versions=["v1"],
        started_at=1.0,
        finished_at=3.25,
    )
    line = r.line()
    assert json.loads(line)["latency_s"] == 2.25 and "\n" not in line
    assert SampleResult.from_line(line) == r


def test_schedule_sends_in_order_bounded_and_puts_retries_first() -> None:
    sch = plan.Schedule(prompts=3, n=2, done=[(0, 1)])
    assert sch.take(2) == [(0, 0), (1, 0)]
    assert sch.take(2) == []  # two in flight already
    sch.finished((0, 0))
    sch.again((1, 0))
    assert sch.take(2) == [(1, 0), (1, 1)]
    for k in [(1, 0), (1, 1)]:
        sch.finished(k)
    assert sch.take(10) == [(2, 0), (2, 1)]
    assert not sch.idle
    sch.finished((2, 0))
    sch.finished((2, 1))
    assert sch.idle


def test_schedule_next_takes_one_within_the_bound() -> None:
    sch = plan.Schedule(prompts=2, n=2)
    assert sch.next(2) == (0, 0) and sch.next(2) == (0, 1)
    assert sch.next(2) is None  # two in flight: a sender whose sample ended takes one only after it is recorded
    sch.finished((0, 0))
    assert sch.next(2) == (1, 0)
    sch.again((0, 1))  # a retry goes first
    assert sch.next(2) == (0, 1)
    sch.finished((0, 1))
    assert sch.next(2) == (1, 1) and sch.next(9) is None  # none left


def test_maybe_sent_bounds_what_a_restart_must_stop() -> None:
    # 4 prompts x 2: samples 0..2 stored, parallelism 2: only unstored ones among the first 3 + 2 may run.
    assert plan.maybe_sent(4, 2, [(0, 0), (0, 1), (1, 0)], bound=5) == [(1, 1), (2, 0)]
    assert plan.maybe_sent(1, 2, [], bound=99) == [(0, 0), (0, 1)]


def test_abort_token_acts_once() -> None:
    assert plan.new_abort_token({ANNOTATION_ABORT: "t1"}, None, ANNOTATION_ABORT) == "t1"
    assert plan.new_abort_token({ANNOTATION_ABORT: "t1"}, "t1", ANNOTATION_ABORT) is None
    assert plan.new_abort_token({ANNOTATION_ABORT: ""}, None, ANNOTATION_ABORT) is None
    assert plan.new_abort_token(None, None, ANNOTATION_ABORT) is None


def test_deadline_ttl_and_rate_limit() -> None:
    assert plan.deadline_left(100.0, 30, now=120.0) == 10.0
    assert plan.deadline_left(None, 30, now=120.0) is None and plan.deadline_left(100.0, None, 1.0) is None
    assert plan.ttl_left(100.0, 0, now=100.0) == 0 and plan.ttl_left(100.0, None, 1.0) is None
    rl = plan.RateLimit(1.0)
    assert rl.due(10.0) and not rl.due(10.5) and rl.due(10.5, urgent=True) and not rl.due(11.2) and rl.due(11.6)


def test_staleness_counts_updates_after_the_samples_version() -> None:
    history = ["v1", "v2", "v3"]
    assert plan.staleness("v1", history) == 2 and plan.staleness("v3", history) == 0
    assert plan.staleness("unseen", history) == 0 and plan.staleness(None, history) == 0
    r = SampleResult(0, 0, "x", "stop", weight_version="v1", weight_versions=["v1"])
    assert plan.is_stale(r, history, 1) and not plan.is_stale(r, history, 2) and not plan.is_stale(r, history, None)


def test_sampling_seed_differs_per_sample_and_models_check_bounds() -> None:
    s = spec(sampling={"seed": 7})
    assert s.sampling.body(0)["seed"] == 7 and s.sampling.body(3)["seed"] == 10
    assert "seed" not in spec().sampling.body(1)
    for bad in ({"temperature": -1}, {"topP": 1.5}, {"maxTokens": 0}):
        with pytest.raises(ValidationError):
            spec(sampling=bad)
    assert Prompt(text="abc").size() == 3 and Prompt(token_ids=[1, 2]).size() == 2
