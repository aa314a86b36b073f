"""``GET /metrics``: the engine's counters in Prometheus' text format.

A collector reads the values when scraped (no bookkeeping on the step path), from the
engine loop's counters and the engine's host-side mirrors, which the engine thread
updates once per step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .engine_loop import EngineLoop

__all__ = ["metrics_registry"]


class _EngineCollector(Collector):
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self):
        engine = self.loop.engine
        config = engine.config
        gauges = (
            (
                "kv_free_blocks",
                "Decoder-pool KV blocks free (step_paddle's free_list_len)",
                engine.free_decoder_blocks,
            ),
            ("kv_total_blocks", "Decoder-pool KV blocks in all", config.num_decoder_blocks),
            (
                "kv_encoder_free_blocks",
                "Prompt (encoder) KV blocks free",
                engine.encoder_blocks.num_free,
            ),
            (
                "kv_encoder_total_blocks",
                "Prompt (encoder) KV blocks in all",
                config.num_encoder_blocks,
            ),
            ("requests_running", "Requests holding a slot and not preempted", engine.num_running),
            (
                "requests_waiting",
                "Requests queued or preempted",
                engine.num_waiting + engine.num_preempted,
            ),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"paddle_step_{name}", documentation, value=value)
        yield CounterMetricFamily(
            "paddle_step_preemptions",
            "Sequences preempted by step_paddle",
            value=self.loop.preemptions,
        )
        yield CounterMetricFamily(
            "paddle_step_generated_tokens", "Tokens generated", value=self.loop.generated_tokens
        )


def metrics_registry(loop: EngineLoop) -> CollectorRegistry:
    """A registry of its own per server, so several can live in one process (tests)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(loop))
    return registry
