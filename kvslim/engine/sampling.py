"""Token sampling with llama.cpp's chain and defaults:
penalties -> top-k -> top-p -> min-p -> temperature -> draw.

``Sampler.distribution`` returns the final truncated distribution, so the
quality tools can compare what two caches would sample from, not only argmax.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.8          # <= 0: greedy
    top_k: int = 40                   # <= 0: off
    top_p: float = 0.95               # 1.0: off
    min_p: float = 0.05               # 0.0: off
    repeat_penalty: float = 1.0       # 1.0: off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        checks = [(self.temperature >= 0, "temperature must be >= 0"),
                  (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
                  (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
                  (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
                  (self.repeat_last_n >= 0, "repeat_last_n must be >= 0")]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message} (got {asdict(self)})")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Sampler:
    """One sequence's sampler: its parameters and its own random stream."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        seed = self.params.seed if self.params.seed is not None else random.randrange(2 ** 63)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: list[int] = ()) -> int:
        if self.params.greedy:
            return int(penalized(logits, history, self.params).argmax())
        probs = self.distribution(logits, history)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def distribution(self, logits: torch.Tensor, history: list[int] = ()) -> torch.Tensor:
        """Probabilities (V,) after penalties, truncation and temperature (one-hot when greedy)."""
        p = self.params
        x = penalized(logits.float().cpu(), history, p)
        if p.greedy:
            return torch.nn.functional.one_hot(x.argmax(), x.numel()).float()
        keep = truncation_mask(x, p)
        x = (x / p.temperature).masked_fill(~keep, float("-inf"))
        return torch.softmax(x, -1)


def penalized(logits: torch.Tensor, history, p: SamplingParams) -> torch.Tensor:
    """llama.cpp's repetition penalty (divide positive, multiply negative logits) and
    OpenAI's presence/frequency penalties over the last ``repeat_last_n`` tokens."""
    window = list(history)[-p.repeat_last_n:] if p.repeat_last_n else []
    if not window or (p.repeat_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty):
        return logits
    x = logits.clone()
    ids, counts = torch.unique(torch.tensor(window, dtype=torch.long), return_counts=True)
    picked = x[ids]
    picked = torch.where(picked > 0, picked / p.repeat_penalty, picked * p.repeat_penalty)
    x[ids] = picked - counts * p.frequency_penalty - p.presence_penalty
    return x


def truncation_mask(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tokens that survive top-k, top-p and min-p (always at least the best one)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if p.top_k > 0 and p.top_k < logits.numel():
        keep &= logits >= torch.topk(logits, p.top_k).values[-1]
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p                 # mass strictly above each token
        keep_sorted = before < p.top_p
        keep &= torch.zeros_like(keep).scatter(0, order, keep_sorted)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    keep[logits.argmax()] = True
    return keep
