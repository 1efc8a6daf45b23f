"""The target's prefix-cache metrics count prompt tokens, as vLLM's do: queries, hits and their ratio."""

from __future__ import annotations

from prometheus_client import generate_latest

from specserve.serving.metrics import TargetMetrics


def test_hits_and_queries_give_the_hit_rate() -> None:
    metrics = TargetMetrics.create()
    metrics.observe_prefill(600, 0)
    metrics.observe_prefill(600, 512)
    sample = metrics.registry.get_sample_value
    assert sample("specserve:prefix_cache_queries_total") == 1200
    assert sample("specserve:prefix_cache_hits_total") == 512
    assert sample("specserve:prefix_cache_hit_rate") == 512 / 1200
    assert b"specserve:prefix_cache_bytes" in generate_latest(metrics.registry)
