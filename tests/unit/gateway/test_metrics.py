"""The per-request counts the proxy keeps in plain numbers read as Prometheus would scrape them."""

from __future__ import annotations

from prometheus_client import generate_latest

from rollfleet.gateway.metrics import Metrics


def test_requests_durations_and_attempts_scrape_as_prometheus_counters_and_a_histogram() -> None:
    m = Metrics()
    m.request_done("/v1/completions", "length", 0.003)
    m.request_done("/v1/completions", "abort", 0.2)
    m.request_done("/v1/chat/completions", "length", 700.0)
    m.attempt_done("engine-0", "finished")
    text = generate_latest(m.registry).decode()
    assert 'rollfleet_gateway_requests_total{outcome="length",route="/v1/completions"} 1.0' in text
    assert 'rollfleet_gateway_requests_total{outcome="abort",route="/v1/completions"} 1.0' in text
    lines = [ln for ln in text.splitlines() if ln.startswith("rollfleet_gateway_request_seconds")]
    assert 'rollfleet_gateway_request_seconds_bucket{le="0.005",route="/v1/completions"} 1.0' in lines
    assert 'rollfleet_gateway_request_seconds_bucket{le="0.1",route="/v1/completions"} 1.0' in lines
    assert 'rollfleet_gateway_request_seconds_bucket{le="0.25",route="/v1/completions"} 2.0' in lines
    assert 'rollfleet_gateway_request_seconds_bucket{le="+Inf",route="/v1/completions"} 2.0' in lines
    assert 'rollfleet_gateway_request_seconds_count{route="/v1/completions"} 2.0' in lines
    assert 'rollfleet_gateway_request_seconds_sum{route="/v1/completions"} 0.203' in lines
    assert 'rollfleet_gateway_request_seconds_bucket{le="600.0",route="/v1/chat/completions"} 0.0' in lines
    assert 'rollfleet_gateway_request_seconds_bucket{le="+Inf",route="/v1/chat/completions"} 1.0' in lines
    assert 'rollfleet_gateway_upstream_attempts_total{engine="engine-0",result="finished"} 1.0' in text


def test_tokens_by_engine_and_lag_and_abort_latency_scrape() -> None:
    m = Metrics()
    m.tokens_served("engine-0", "0", 120)
    m.tokens_served("engine-0", "0", 8)
    m.tokens_served("engine-1", "3+", 5)
    m.abort_seconds.observe(0.04)
    text = generate_latest(m.registry).decode()
    assert 'rollfleet_gateway_tokens_total{engine="engine-0",lag="0"} 128.0' in text
    assert 'rollfleet_gateway_tokens_total{engine="engine-1",lag="3+"} 5.0' in text
    assert 'rollfleet_gateway_abort_seconds_bucket{le="0.05"} 1.0' in text
