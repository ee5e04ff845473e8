"""Route classes and the access decision (pure)."""

from __future__ import annotations

import pytest

from rollfleet_engine.access import AccessPolicy, RouteClass, bearer, classify, read_token, token_matches


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/health", RouteClass.OPEN),
        ("GET", "/metrics", RouteClass.OPEN),
        ("GET", "/v1/models", RouteClass.OPEN),
        ("GET", "/rollfleet/v1/state", RouteClass.OPEN),
        ("GET", "/rollfleet/v1/requests/abc", RouteClass.OPEN),
        ("POST", "/v1/completions", RouteClass.INFERENCE),
        ("POST", "/v1/chat/completions", RouteClass.INFERENCE),
        ("POST", "/inference/v1/generate", RouteClass.INFERENCE),
        ("POST", "/pause", RouteClass.CONTROL),
        ("POST", "/resume", RouteClass.CONTROL),
        ("POST", "/rollfleet/v1/abort", RouteClass.CONTROL),
        ("POST", "/inference/v1/abort_requests", RouteClass.CONTROL),
        ("POST", "/v1/load_lora_adapter", RouteClass.CONTROL),
        ("POST", "/update_weights", RouteClass.CONTROL),
        ("POST", "/weight_info", RouteClass.CONTROL),  # only GET is read-only
        ("POST", "/some_route_vllm_adds_later", RouteClass.CONTROL),
        ("POST", "/collective_rpc", RouteClass.UNSAFE),
        ("POST", "/collective_rpc/", RouteClass.UNSAFE),
    ],
)
def test_classify(method: str, path: str, expected: RouteClass) -> None:
    assert classify(method, path) is expected


def test_bearer_and_compare() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None
    assert bearer("abc") is None
    assert bearer(None) is None
    assert token_matches("abc", "abc")
    assert not token_matches("abd", "abc")
    assert not token_matches(None, "abc")


def test_policy_decisions() -> None:
    policy = AccessPolicy(control_token="ctl")
    assert policy.decide("POST", "/pause", None) == (401, "missing or wrong bearer token")
    assert policy.decide("POST", "/pause", "Bearer nope") is not None
    assert policy.decide("POST", "/pause", "Bearer ctl") is None
    assert policy.decide("POST", "/v1/completions", None) is None  # no inference token configured
    assert policy.decide("GET", "/health", None) is None
    status, _ = policy.decide("POST", "/collective_rpc", "Bearer ctl") or (0, "")
    assert status == 403
    assert AccessPolicy("ctl", allow_unsafe_routes=True).decide("POST", "/collective_rpc", "Bearer ctl") is None
    assert AccessPolicy("ctl", allow_unsafe_routes=True).decide("POST", "/collective_rpc", None) is not None


def test_inference_token() -> None:
    policy = AccessPolicy(control_token="ctl", inference_token="inf")
    assert policy.decide("POST", "/v1/completions", None) is not None
    assert policy.decide("POST", "/v1/completions", "Bearer inf") is None
    assert policy.decide("POST", "/v1/completions", "Bearer ctl") is None
    assert policy.decide("POST", "/pause", "Bearer inf") is not None  # inference token is not a control token


def test_read_token(tmp_path) -> None:
    (tmp_path / "t").write_text("  tok\n")
    assert read_token(tmp_path / "t") == "tok"
    (tmp_path / "e").write_text("\n")
    with pytest.raises(ValueError):
        read_token(tmp_path / "e")
