"""/metrics (Prometheus text, llama-server's metric names under ``kvslim:``) and /slots."""
from __future__ import annotations


def _metric(lines: list[str], name: str, kind: str, help_: str, value) -> None:
    lines += [f"# HELP kvslim:{name} {help_}", f"# TYPE kvslim:{name} {kind}", f"kvslim:{name} {value}"]


def prometheus_text(engine, scheduler) -> str:
    s, load = scheduler.stats, scheduler.snapshot()
    cached = engine.cached_tokens()
    lines: list[str] = []
    _metric(lines, "prompt_tokens_total", "counter", "Prompt tokens processed (prefix-cache hits excluded).",
            s.prompt_tokens)
    _metric(lines, "prompt_seconds_total", "counter", "Prompt processing time.", round(s.prompt_seconds, 6))
    _metric(lines, "tokens_predicted_total", "counter", "Generated tokens.", s.predicted_tokens)
    _metric(lines, "tokens_predicted_seconds_total", "counter", "Generation time.", round(s.predicted_seconds, 6))
    _metric(lines, "prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
            _rate(s.prompt_tokens, s.prompt_seconds))
    _metric(lines, "predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
            _rate(s.predicted_tokens, s.predicted_seconds))
    _metric(lines, "kv_cache_usage_ratio", "gauge", "Tokens held in the KV cache / (ctx x slots).",
            round(cached / (engine.ctx * engine.n_parallel), 6))
    _metric(lines, "kv_cache_tokens", "gauge", "Tokens held in the KV cache, all slots.", cached)
    _metric(lines, "kv_cache_bytes", "gauge", "Bytes allocated by the KV cache.", engine.kv_bytes)
    _metric(lines, "recurrent_state_bytes", "gauge", "Bytes of DeltaNet state, all slots.", engine.state_bytes)
    _metric(lines, "checkpoint_bytes", "gauge", "Bytes of recurrent-state checkpoints kept for prefix reuse.",
            engine.checkpoint_bytes)
    _metric(lines, "requests_processing", "gauge", "Requests decoding now.", load["running"])
    _metric(lines, "requests_deferred", "gauge", "Requests waiting for a slot.", load["waiting"])
    _metric(lines, "requests_total", "counter", "Requests admitted.", s.requests)
    _metric(lines, "prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", s.prefix_hits)
    _metric(lines, "prefix_cached_tokens_total", "counter", "Prompt tokens served from the cache.", s.cached_tokens)
    return "\n".join(lines) + "\n"


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds, 3) if seconds else 0.0


def slots_view(engine, scheduler) -> list[dict]:
    busy = {job.seq.slot: job for job in list(scheduler.active) if job.seq is not None}
    out = []
    for slot in range(engine.n_parallel):
        info = engine.slot_info(slot)
        out.append({"id": slot, "n_ctx": engine.ctx, "is_processing": slot in busy,
                    "n_cached_tokens": info["n_cached_tokens"], "checkpoints": info["checkpoints"],
                    "kv_bytes": info["kv_bytes"]})
    return out
