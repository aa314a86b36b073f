"""``GET /metrics``: the engine's counters in Prometheus' text format.

A collector reads the values when scraped: the counters the engine process sent with
its latest step, and the pool sizes it reported at start.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...engine.core_client import EngineLoop

__all__ = ["metrics_registry"]


class _EngineCollector(Collector):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self):
        stats, info = self.loop.stats, self.loop.info
        gauges = (
            ("kv_free_blocks", "Decoder-pool KV blocks free (step_paddle's free_list_len)",
             stats["kv_free_blocks"]),
            ("kv_total_blocks", "Decoder-pool KV blocks in all", info["kv_total_blocks"]),
            ("kv_encoder_free_blocks", "Prompt (encoder) KV blocks free",
             stats["kv_encoder_free_blocks"]),
            ("kv_encoder_total_blocks", "Prompt (encoder) KV blocks in all",
             info["kv_encoder_total_blocks"]),
            ("requests_running", "Requests holding a slot and not preempted",
             stats["requests_running"]),
            ("requests_waiting", "Requests queued or preempted", stats["requests_waiting"]),
        )  # fmt: skip
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"paddle_step_{name}", documentation, value=value)
        yield CounterMetricFamily(
            "paddle_step_preemptions", "Sequences preempted by step_paddle",
            value=stats["preemptions"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "paddle_step_generated_tokens", "Tokens generated", value=stats["generated_tokens"]
        )
        yield CounterMetricFamily(
            "paddle_step_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
            value=stats["prefix_cache_queries"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "paddle_step_prefix_cache_hits", "Prompt tokens the prefix cache supplied",
            value=stats["prefix_cache_hits"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "paddle_step_engine_step_seconds", "Time spent in engine steps",
            value=stats["step_seconds"],
        )  # fmt: skip


def metrics_registry(loop: EngineLoop) -> CollectorRegistry:
    """A registry of its own per server, so several can live in one process (tests)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(loop))
    return registry
