"""llama-bench's measurements on kvslim: pp (prefill) and tg (decode) at a depth.

For each K/V pair the cache is filled once per depth with real prefill of
random tokens (depths ascending, each fill extends the previous one), a
snapshot is taken, and every repetition starts from that snapshot: attention
KV is trimmed back and the DeltaNet state restored, so repetitions and tests
at the same depth never refill. One warm-up run precedes the timed ones.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..cache import CacheConfig
from ..devices import synchronize
from ..engine.decode_step import DecodeStep
from ..models import Batch
from ..models.base import CausalLM
from .memory import peak_meter


@dataclass(frozen=True)
class Test:
    kind: str          # "pp", "tg" or "pg" (llama-bench's -pg: a prompt, then n_gen decoded tokens, timed together)
    n_tokens: int      # prompt tokens for pp and pg, generated tokens for tg
    n_depth: int
    n_gen: int = 0     # pg only

    @property
    def label(self) -> str:
        name = f"pp{self.n_tokens}+tg{self.n_gen}" if self.kind == "pg" else f"{self.kind}{self.n_tokens}"
        return f"{name} @ d{self.n_depth}" if self.n_depth else name

    @property
    def n_prompt(self) -> int:
        return self.n_tokens if self.kind in ("pp", "pg") else 0

    @property
    def n_generated(self) -> int:
        return {"tg": self.n_tokens, "pg": self.n_gen}.get(self.kind, 0)


class FilledCache:
    """A cache for ``n_parallel`` slots, grown to a depth and restorable to it."""

    def __init__(self, model: CausalLM, ctx: int, n_parallel: int, type_k: str, type_v: str, n_ubatch: int,
                 seed: int = 0, cache_config: CacheConfig | None = None, compile: bool = False,
                 native: bool = True, cuda_graphs: bool | None = None):
        self.model, self.n_parallel, self.n_ubatch = model, n_parallel, n_ubatch
        config = cache_config or CacheConfig(ctx, n_parallel, type_k, type_v,
                                             device=model.model.embed_tokens.weight.device)
        self.caches = model.make_cache(config)
        self.decode = DecodeStep(model, self.caches, compile=compile, native=native,   # the engine's decode path
                                 cuda_graphs=cuda_graphs)
        self.device = config.device
        self.depth, self.checkpoints = 0, None
        self.gen = torch.Generator().manual_seed(seed)

    def random_tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.model.config.vocab_size, (n,), generator=self.gen).tolist()

    def batch(self, parts) -> Batch:
        return Batch.build(parts, device=self.device)

    def grow_to(self, depth: int, progress=None) -> None:
        """Prefill every slot from the current depth to ``depth`` (untimed)."""
        self.restore()
        for slot in range(self.n_parallel):
            tokens = self.random_tokens(depth - self.depth)
            for start in range(0, len(tokens), self.n_ubatch):
                chunk = tokens[start:start + self.n_ubatch]
                self.model(self.batch([(slot, chunk, self.depth + start)]), self.caches)
                if progress is not None:
                    progress.update(len(chunk))
        self.depth = depth
        self.checkpoints = [self.caches.checkpoint(s) for s in range(self.n_parallel)]

    def restore(self) -> None:
        """Back to exactly ``depth`` tokens per slot (the engine's own rewind)."""
        for slot in range(self.n_parallel):
            self.caches.rewind(slot, self.depth, self.checkpoints[slot] if self.checkpoints else None)

    @property
    def kv_bytes(self) -> int:
        return self.caches.kv_bytes

    @property
    def state_bytes(self) -> int:
        return self.caches.state_bytes


def time_pp(fc: FilledCache, n: int) -> float:
    """Seconds to prefill ``n`` tokens into slot 0 (chunks of n_ubatch)."""
    tokens = fc.random_tokens(n)
    synchronize(fc.device)
    t0 = time.perf_counter()
    _prefill(fc, tokens)
    synchronize(fc.device)
    return time.perf_counter() - t0


def _prefill(fc: FilledCache, tokens: list[int]) -> None:
    for start in range(0, len(tokens), fc.n_ubatch):
        fc.model(fc.batch([(0, tokens[start:start + fc.n_ubatch], fc.depth + start)]), fc.caches)


def time_pg(fc: FilledCache, n_prompt: int, n_gen: int) -> float:
    """Seconds to prefill ``n_prompt`` tokens into slot 0, then decode ``n_gen`` after them
    (llama-bench's -pg: one request's prompt and reply, timed together)."""
    prompt, reply = fc.random_tokens(n_prompt), fc.random_tokens(n_gen)
    synchronize(fc.device)
    t0 = time.perf_counter()
    _prefill(fc, prompt)
    for step, token in enumerate(reply):
        fc.decode([0], [token], [fc.depth + n_prompt + step])
    synchronize(fc.device)
    return time.perf_counter() - t0


def time_tg(fc: FilledCache, n: int) -> float:
    """Seconds to decode ``n`` tokens in every slot, all slots in one forward per step."""
    tokens = [fc.random_tokens(n) for _ in range(fc.n_parallel)]
    synchronize(fc.device)
    t0 = time.perf_counter()
    slots = list(range(fc.n_parallel))
    for step in range(n):
        fc.decode(slots, [tokens[s][step] for s in slots], [fc.depth + step] * fc.n_parallel)
    synchronize(fc.device)
    return time.perf_counter() - t0


def measure(fc: FilledCache, test: Test, repetitions: int) -> dict:
    """One warm-up, then ``repetitions`` timed runs from the same snapshot; tokens/s per run."""
    runs = {"pp": lambda: time_pp(fc, test.n_tokens), "tg": lambda: time_tg(fc, test.n_tokens),
            "pg": lambda: time_pg(fc, test.n_tokens, test.n_gen)}
    run = runs[test.kind]
    # llama-bench's t/s for pg counts the prompt's tokens and the reply's over the whole time
    tokens = test.n_tokens * fc.n_parallel if test.kind == "tg" else test.n_prompt + test.n_generated
    samples = []
    peak = peak_meter(fc.device)                                      # RSS, or the GPU allocator's peak
    on_gpu = fc.device.type == "cuda"
    for rep in range(repetitions + 1):
        fc.restore()
        with peak:
            seconds = run()
        if rep:                                                       # rep 0 is the warm-up
            samples.append(tokens / seconds)
    kv_bytes, state_bytes = fc.kv_bytes, fc.state_bytes                # at depth + the test's tokens
    fc.restore()
    return {"samples_ts": samples, "avg_ts": statistics.mean(samples),
            "stddev_ts": statistics.stdev(samples) if len(samples) > 1 else 0.0,
            "peak_rss_bytes": -1 if on_gpu else peak.peak_bytes, **({"peak_gpu_bytes": peak.peak_bytes} if on_gpu else {}),
            "kv_bytes": kv_bytes, "state_bytes": state_bytes}
