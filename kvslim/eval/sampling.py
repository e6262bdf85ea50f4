"""Drift under sampling: how far a compressed cache moves what the sampler draws from.

Greedy agreement and KL divergence describe the full next-token distribution;
a sampler only ever sees what survives penalties, top-k, top-p, min-p and
temperature. At every scored position of the text (teacher-forced, so both
caches see the same history) this compares the two *truncated* distributions
of :class:`kvslim.engine.sampling.Sampler`:

- total variation ``TV = 1/2 sum |p - q|`` (1 when the supports are disjoint);
- whether the drawn token differs when both samplers use the same random
  stream: each position reseeds both generators with the same seed, then
  draws exactly as the engine does (``torch.multinomial``). With greedy
  settings both reduce to argmax disagreement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.llm import LLM
from ..engine.sampling import Sampler, SamplingParams
from .perplexity import Progress, iter_logits, mean_and_uncertainty, scored_rows


@dataclass
class Drift:
    tv: np.ndarray             # (N,) total variation per position
    differs: np.ndarray        # (N,) bool: sampled tokens differ under the same random stream
    argmax_differs: np.ndarray  # (N,) bool
    support: np.ndarray        # (N,) tokens the reference sampler can draw
    type_k: str
    type_v: str
    params: SamplingParams

    def summary(self) -> dict:
        tv, tv_unc = mean_and_uncertainty(self.tv)
        rate = float(self.differs.mean())
        n = len(self.tv)
        rate_unc = math.sqrt(rate * (1 - rate) / (n - 1)) if n > 1 else 0.0
        return {"type_k": self.type_k, "type_v": self.type_v, "positions": n,
                "tv_mean": tv, "tv_unc": tv_unc, "tv_p50": float(np.median(self.tv)),
                "tv_p99": float(np.quantile(self.tv, 0.99)), "tv_max": float(self.tv.max()),
                "sampled_differs": rate, "sampled_differs_unc": rate_unc,
                "argmax_differs": float(self.argmax_differs.mean()), "support_mean": float(self.support.mean()),
                "temperature": self.params.temperature, "top_k": self.params.top_k, "top_p": self.params.top_p,
                "min_p": self.params.min_p, "repeat_penalty": self.params.repeat_penalty}


def position_seed(seed: int, chunk: int, row: int) -> int:
    return (seed * 1_000_003 + chunk * 65_537 + row) % (2 ** 63)


def drift(ref: LLM, llm: LLM, chunks: list[list[int]], params: SamplingParams, first: int | None = None,
          seed: int = 0, progress: Progress | None = None) -> Drift:
    """Compare the truncated sampling distributions of ``llm`` against ``ref`` on every scored row.

    Both models prefill each chunk in lockstep (one ubatch of logits each in memory).
    """
    first = len(chunks[0]) // 2 if first is None else first
    s_ref, s_q = Sampler(params), Sampler(params)
    window = params.repeat_last_n
    tv, differs, arg_differs, support = [], [], [], []
    for c, ids in enumerate(chunks):
        gen_r, gen_q = iter_logits(ref, ids, first, progress), iter_logits(llm, ids, first)
        try:
            for (start, logits_r), (_, logits_q) in zip(gen_r, gen_q):
                rows_r, _ = scored_rows(ids, first, start, logits_r)
                rows_q = logits_q[:rows_r.shape[0]]
                for i in range(rows_r.shape[0]):
                    row = start + i
                    history = ids[max(0, row + 1 - window):row + 1] if window else []
                    p = s_ref.distribution(rows_r[i], history)
                    q = s_q.distribution(rows_q[i], history)
                    tv.append(0.5 * float((p - q).abs().sum()))
                    s_ref.generator.manual_seed(position_seed(seed, c, row))
                    s_q.generator.manual_seed(position_seed(seed, c, row))
                    differs.append(int(torch.multinomial(p, 1, generator=s_ref.generator))
                                   != int(torch.multinomial(q, 1, generator=s_q.generator)))
                    arg_differs.append(int(rows_r[i].argmax()) != int(rows_q[i].argmax()))
                    support.append(int((p > 0).sum()))
        finally:                                  # give both slots back even if one side stops early
            gen_r.close()
            gen_q.close()
    return Drift(np.asarray(tv), np.asarray(differs), np.asarray(arg_differs), np.asarray(support),
                 llm.engine.type_k, llm.engine.type_v, params)


__all__ = ["Drift", "drift", "position_seed"]
