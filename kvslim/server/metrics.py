"""/metrics (Prometheus, llama-server's metric names under ``kvslim:``, through prometheus-client) and /slots."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .scheduler import engine_status


class _Collector:
    """Reads the scheduler's counters and the engine's slots at scrape time."""

    def __init__(self, engine, scheduler):
        self.engine, self.scheduler = engine, scheduler

    def collect(self):
        e, s, load = self.engine, self.scheduler.stats, self.scheduler.snapshot()
        view = engine_status(e)
        cached = sum(slot["n_cached"] for slot in view["slots"])
        counters = [("prompt_tokens", "Prompt tokens processed (prefix-cache hits excluded).", s.prompt_tokens),
                    ("prompt_seconds", "Prompt processing time.", s.prompt_seconds),
                    ("tokens_predicted", "Generated tokens.", s.predicted_tokens),
                    ("tokens_predicted_seconds", "Generation time.", s.predicted_seconds),
                    ("requests", "Requests admitted.", s.requests),
                    ("requests_failed", "Requests whose generation failed (others unaffected).", s.failed),
                    ("prefix_cache_hits", "Requests that reused a cached prefix.", s.prefix_hits),
                    ("prefix_cached_tokens", "Prompt tokens served from the cache.", s.cached_tokens)]
        gauges = [("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                   _rate(s.prompt_tokens, s.prompt_seconds)),
                  ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                   _rate(s.predicted_tokens, s.predicted_seconds)),
                  ("kv_cache_usage_ratio", "Tokens held in the KV cache / (ctx x slots).",
                   cached / (e.ctx * e.n_parallel)),
                  ("kv_cache_tokens", "Tokens held in the KV cache, all slots.", cached),
                  ("kv_cache_bytes", "Bytes allocated by the KV cache.", e.kv_bytes),
                  ("recurrent_state_bytes", "Bytes of DeltaNet state, all slots.", e.state_bytes),
                  ("checkpoint_bytes", "Bytes of recurrent-state checkpoints kept for prefix reuse.",
                   view["checkpoint_bytes"]),
                  ("requests_processing", "Requests decoding now.", load["running"]),
                  ("requests_deferred", "Requests waiting for a slot.", load["waiting"]),
                  ("slots_free", "Slots free for a new request.", len(view["free_slots"]))]
        for name, help_, value in counters:
            yield CounterMetricFamily(f"kvslim:{name}", help_, value=value)
        for name, help_, value in gauges:
            yield GaugeMetricFamily(f"kvslim:{name}", help_, value=value)


def metrics_text(engine, scheduler) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine, scheduler))
    return generate_latest(registry)


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 3) if seconds else 0.0


def slots_view(engine, scheduler) -> list[dict]:
    busy = {job.seq.slot for job in list(scheduler.active) if job.seq is not None}
    view = engine_status(engine)
    return [{"id": i, "n_ctx": engine.ctx, "is_processing": i in busy, "n_cached_tokens": slot["n_cached"],
             "checkpoints": slot["checkpoints"], "kv_bytes": slot["kv_bytes"]}
            for i, slot in enumerate(view["slots"])]
