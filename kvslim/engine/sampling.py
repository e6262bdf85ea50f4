"""Token sampling with llama.cpp's chain and defaults:
constraint mask -> penalties -> top-k -> top-p -> min-p -> temperature -> draw.

``Sampler.distribution`` returns the final truncated distribution, so the
quality tools can compare what two caches would sample from, not only argmax.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

import torch

# below this temperature, logits / T overflows float32 to inf and softmax gives NaN:
# such a temperature means "greedy" (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-5
# repeat_penalty divides positive logits: outside this range it overflows or erases them
REPEAT_PENALTY_RANGE = (1e-3, 1e3)


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
    logprobs: int | None = None       # None: off; k >= 0: the chosen token's logprob and the k most likely
    ignore_eos: bool = False          # llama-server's: end-of-generation tokens are never sampled

    def __post_init__(self):
        lo, hi = REPEAT_PENALTY_RANGE
        numbers = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "repeat_penalty",
                                                          "presence_penalty", "frequency_penalty")}
        checks = [(all(math.isfinite(x) for x in numbers.values()), "sampling values must be finite numbers", numbers),
                  (self.temperature >= 0, "temperature must be >= 0", self.temperature),
                  (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p),
                  (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p),
                  (lo <= self.repeat_penalty <= hi, f"repeat_penalty must be in [{lo:g}, {hi:g}]", self.repeat_penalty),
                  (abs(self.presence_penalty) <= hi and abs(self.frequency_penalty) <= hi,
                   f"presence_penalty and frequency_penalty must be within +-{hi:g}",
                   (self.presence_penalty, self.frequency_penalty)),
                  (self.repeat_last_n >= 0, "repeat_last_n must be >= 0", self.repeat_last_n),
                  (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in 0..20", self.logprobs)]
        for ok, message, got in checks:
            if not ok:
                raise ValueError(f"{message} (got {got!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


class Constraint(Protocol):
    """Restricts the next token (a grammar, a forced tool call): a per-sequence logits mask."""

    def allowed(self, n_vocab: int) -> torch.Tensor:
        """Bool (V,): tokens the constraint accepts next."""

    def accept(self, token: int) -> None:
        """Advance past the sampled token."""


class Sampler:
    """One sequence's sampler: its parameters, its own random stream and an optional constraint.

    With ``params.logprobs`` set, ``logprobs`` collects ``(token, logprob, [(id, logprob), ...])`` for every
    sampled token, from the model's distribution before penalties and truncation (as OpenAI reports them).
    """

    def __init__(self, params: SamplingParams | None = None, constraint: Constraint | None = None):
        self.params = params or SamplingParams()
        self.constraint = constraint
        seed = self.params.seed if self.params.seed is not None else random.randrange(2 ** 63)
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []

    def __call__(self, logits: torch.Tensor, history: list[int] = ()) -> int:
        if self.params.greedy:
            token = int(penalized(self._masked(logits), history, self.params).argmax())
        else:
            probs = self.distribution(logits, history)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.params.logprobs is not None:
            self._record_logprobs(logits, token)
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        if self.constraint is None:
            return logits
        keep = self.constraint.allowed(logits.numel()).to(logits.device)
        return logits.masked_fill(~keep, float("-inf"))

    def _record_logprobs(self, logits: torch.Tensor, token: int) -> None:
        lp = torch.log_softmax(logits.float(), -1)
        top = torch.topk(lp, self.params.logprobs) if self.params.logprobs else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        self.logprobs.append((token, float(lp[token]), pairs))

    def distribution(self, logits: torch.Tensor, history: list[int] = ()) -> torch.Tensor:
        """Probabilities (V,) after the constraint, penalties, truncation and temperature (one-hot when greedy)."""
        p = self.params
        x = penalized(self._masked(logits.float().cpu()), history, p)
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
