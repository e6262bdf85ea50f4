"""Token sampling with llama.cpp's chain and defaults:
constraint mask -> penalties -> top-k -> top-p -> min-p -> temperature -> draw.

A vocabulary is 150-250K tokens and a step may sample many sequences, so the chain runs in two
parts (as llama.cpp's, which cuts to the top-k candidates first): on the logits' device, for all
rows at once, the masks and penalties, then a shortlist per row (its top-k tokens, best first);
then one copy of the shortlists to the host, where top-p, min-p, temperature and the draw work on
a few dozen numbers with each sequence's own random stream. ``distribution_reference`` is the
chain written plainly over the whole vocabulary, which the fast path is tested against.

``Sampler.distribution`` returns the final truncated distribution, so the
quality tools can compare what two caches would sample from, not only argmax.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch

from ..devices import to_device

# below this temperature, logits / T overflows float32 to inf and softmax gives NaN:
# such a temperature means "greedy" (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-5
# repeat_penalty divides positive logits: outside this range it overflows or erases them
REPEAT_PENALTY_RANGE = (1e-3, 1e3)


@dataclass
class SamplingParams:
    temperature: float = 0.8          # <= 0: greedy
    top_k: int = 40                   # <= 0: off
    top_p: float = 0.95               # 1.0: off; 0: greedy
    min_p: float = 0.05               # 0.0: off
    repeat_penalty: float = 1.0       # 1.0: off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None           # None or -1: a random seed
    logprobs: int | None = None       # None: off; k >= 0: the chosen token's logprob and the k most likely
    ignore_eos: bool = False          # llama-server's: end-of-generation tokens are never sampled

    def __post_init__(self):
        if self.seed == -1:                  # llama.cpp's default seed: a random one (llama-server clients send it)
            self.seed = None
        lo, hi = REPEAT_PENALTY_RANGE
        numbers = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "repeat_penalty",
                                                          "presence_penalty", "frequency_penalty")}
        checks = [(all(math.isfinite(x) for x in numbers.values()), "sampling values must be finite numbers", numbers),
                  (self.temperature >= 0, "temperature must be >= 0", self.temperature),
                  (0.0 <= self.top_p <= 1.0, "top_p must be in [0, 1]", self.top_p),
                  (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p),
                  (lo <= self.repeat_penalty <= hi, f"repeat_penalty must be in [{lo:g}, {hi:g}]", self.repeat_penalty),
                  (abs(self.presence_penalty) <= hi and abs(self.frequency_penalty) <= hi,
                   f"presence_penalty and frequency_penalty must be within +-{hi:g}",
                   (self.presence_penalty, self.frequency_penalty)),
                  (self.repeat_last_n >= 0, "repeat_last_n must be >= 0", self.repeat_last_n),
                  (self.seed is None or -2 ** 63 <= self.seed < 2 ** 64,       # what torch's generator takes
                   "seed must be a 64-bit integer", self.seed),
                  (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in 0..20", self.logprobs)]
        for ok, message, got in checks:
            if not ok:
                raise ValueError(f"{message} (got {got!r})")

    @property
    def greedy(self) -> bool:
        # top_p 0 leaves only the most likely token (OpenAI's range includes 0; llama.cpp keeps one token)
        return self.temperature < MIN_TEMPERATURE or self.top_p == 0


class Constraint(Protocol):
    """Restricts the next token (a grammar, a forced tool call): a per-sequence logits mask."""

    def allowed(self, n_vocab: int) -> torch.Tensor:
        """Bool (V,): tokens the constraint accepts next."""

    def accept(self, token: int) -> None:
        """Advance past the sampled token."""


class Sampler:
    """One sequence's sampler: its parameters, its own random stream, an optional constraint and
    tokens it never draws (``banned``: llama-server's ``ignore_eos`` bans the end-of-generation ones).

    With ``params.logprobs`` set, ``logprobs`` collects ``(token, logprob, [(id, logprob), ...])`` for every
    sampled token, from the model's distribution before penalties and truncation (as OpenAI reports them).
    The engine samples all of a step's sequences at once (:func:`sample_rows`); calling a sampler
    samples one row the same way.
    """

    def __init__(self, params: SamplingParams | None = None, constraint: Constraint | None = None,
                 banned: Iterable[int] = ()):
        self.params = params or SamplingParams()
        self.constraint = constraint
        self.banned = sorted(set(banned))
        seed = self.params.seed if self.params.seed is not None else random.randrange(2 ** 63)
        self.generator = torch.Generator().manual_seed(seed)
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        token = sample_rows([self], logits[None], [history])[0]
        if isinstance(token, Exception):
            raise token
        return token

    def distribution(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """Probabilities (V,) after the constraint, penalties, truncation and temperature (one-hot when greedy)."""
        x, raw, (error,) = prepare_rows([self], logits[None], [history])
        if error is not None:
            raise error
        short = shortlists([self], x, raw)[0]
        kept, probs = short.truncated(self.params)
        return torch.zeros(logits.shape[-1]).index_put_((kept,), probs)

    def draw(self, short: "Shortlist") -> int:
        """The next token from this row's shortlist (advancing the constraint)."""
        kept, probs = short.truncated(self.params)
        pick = 0 if self.params.greedy else int(torch.multinomial(probs, 1, generator=self.generator))
        token = int(kept[pick])
        if self.params.logprobs is not None:
            self.logprobs.append((token, short.logprob(token), short.top_logprobs))
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The reference's mask: bans and the constraint's disallowed tokens to -inf."""
        x = logits.index_fill(-1, torch.tensor(self.banned, dtype=torch.long), float("-inf")) if self.banned else logits
        if self.constraint is None:
            return x
        keep = self.constraint.allowed(x.shape[-1]).to(x.device)
        return x.masked_fill(~keep, float("-inf"))


@dataclass
class Shortlist:
    """One row's candidates, best first: every token that can survive truncation, on the host.

    ``log_z`` normalises them as the row's top-k set does (the whole vocabulary when top-k is off),
    so top-p and min-p see the same probabilities as over the full row.
    """

    ids: torch.Tensor                   # (n,) long
    logits: torch.Tensor                # (n,) float32: masked and penalized
    log_z: float
    raw: torch.Tensor                   # (n,) the model's logits (bans applied), for logprobs
    raw_lse: float = 0.0
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)

    def truncated(self, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, probabilities) after top-p, min-p and temperature; the best alone when greedy."""
        top = int(self.logits.argmax())             # the first entry, unless nothing truncates
        best = self.logits[top]
        if not torch.isfinite(best):
            raise ValueError("no token can be sampled: the logits are NaN or infinite" if best.item() != float("-inf")
                             else "no token can be sampled: the constraint and the banned tokens exclude every token")
        if p.greedy:
            return self.ids[top:top + 1], torch.ones(1)
        probs = torch.exp(self.logits - self.log_z)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if p.top_p < 1.0:                                               # the shortlist is sorted then
            keep &= torch.cumsum(probs, 0) - probs < p.top_p            # mass strictly above each token
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs[top]                      # both keep the best token
        return self.ids[keep], torch.softmax(self.logits[keep] / p.temperature, -1)

    def logprob(self, token: int) -> float:
        where = int((self.ids == token).nonzero()[0])
        return float(self.raw[where]) - self.raw_lse


def sample_rows(samplers: Sequence[Sampler], logits: torch.Tensor,
                histories: Sequence[Sequence[int]]) -> list[int | Exception]:
    """Row i's next token by ``samplers[i]`` from ``logits[i]`` (R, V), or the error its sampling
    raised (one row's bad constraint or NaN logits ends that row alone)."""
    x, raw, results = prepare_rows(samplers, logits, histories)
    ok = [i for i, err in enumerate(results) if err is None]
    if len(ok) < len(results):
        x, raw = x[ok], raw[ok]
    for i, short in zip(ok, shortlists([samplers[i] for i in ok], x, raw)):
        try:
            results[i] = samplers[i].draw(short)
        except Exception as err:                                    # noqa: BLE001 - reported per row
            results[i] = err
    return results


def prepare_rows(samplers: Sequence[Sampler], logits: torch.Tensor, histories: Sequence[Sequence[int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[Exception | None]]:
    """(x, raw, errors): float32 copies of the rows on their device, ``raw`` with each sampler's bans,
    ``x`` also with its constraint's mask and penalties; a row whose constraint raised gets its error."""
    raw = logits.float()                            # the caller's tensor: copied before any change
    n_vocab, device = raw.shape[-1], raw.device
    bans = [(r, t) for r, s in enumerate(samplers) for t in s.banned]
    if bans:
        rows, cols = zip(*bans)
        raw = raw.index_put((to_device(rows, device), to_device(cols, device)),
                            torch.tensor(float("-inf"), device=device))
    errors: list[Exception | None] = [None] * len(samplers)
    masks = []
    for r, s in enumerate(samplers):
        if s.constraint is not None:
            try:
                masks.append((r, s.constraint.allowed(n_vocab)))
            except Exception as err:                                # noqa: BLE001 - reported per row
                errors[r] = err
    penalties = _penalty_entries(samplers, histories)
    x = raw.clone() if masks or penalties else raw
    if masks:
        rows = to_device([r for r, _ in masks], device)
        allowed = to_device(torch.stack([m for _, m in masks]), device, torch.bool)
        x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
    if penalties:
        rows, toks, counts, repeat, frequency, presence = (
            to_device(col, device, torch.long if i < 2 else torch.float32) for i, col in enumerate(zip(*penalties)))
        picked = x[rows, toks]
        picked = torch.where(picked > 0, picked / repeat, picked * repeat)
        x[rows, toks] = picked - counts * frequency - presence
    return x, raw, errors


def _penalty_entries(samplers: Sequence[Sampler], histories: Sequence[Sequence[int]]) -> list[tuple]:
    """(row, token, count, repeat, frequency, presence) for every token in a penalized row's window."""
    entries = []
    for r, (s, history) in enumerate(zip(samplers, histories)):
        p = s.params
        if not p.repeat_last_n or (p.repeat_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty):
            continue
        for token, count in Counter(history[-p.repeat_last_n:]).items():      # the window, not a copy of all
            entries.append((r, token, count, p.repeat_penalty, p.frequency_penalty, p.presence_penalty))
    return entries


def shortlists(samplers: Sequence[Sampler], x: torch.Tensor, raw: torch.Tensor) -> list[Shortlist]:
    """Each row's candidates on the host. Greedy rows: the argmax; top-k rows: one ``topk`` over
    all of them; rows with top-k off: the tokens min-p can keep (all, sorted, without min-p)."""
    n_vocab = x.shape[-1]
    greedy = [r for r, s in enumerate(samplers) if s.params.greedy]
    top_k = [r for r, s in enumerate(samplers) if not s.params.greedy and 0 < s.params.top_k < n_vocab]
    groups = []                                     # (rows, ids, logits, raw logits, log_z or None) on the device
    if greedy:
        xs, raws = _rows(x, raw, greedy)
        ids = xs.argmax(-1, keepdim=True)
        groups.append((greedy, ids, xs.gather(1, ids), raws.gather(1, ids), None))
    if top_k:
        xs, raws = _rows(x, raw, top_k)
        values, ids = xs.topk(max(samplers[r].params.top_k for r in top_k), -1)
        groups.append((top_k, ids, values, raws.gather(1, ids), None))
    for r in sorted(set(range(len(samplers))) - set(greedy) - set(top_k)):
        groups.append(([r], *_untruncated(x[r], raw[r], samplers[r].params)))
    shorts: dict[int, Shortlist] = {}
    for rows, *tensors in groups:                   # one copy to the host per group, not per row
        ids, values, raw_values, log_z = (t.cpu() if t is not None else None for t in tensors)
        for j, r in enumerate(rows):
            k = samplers[r].params.top_k if r in top_k else values.shape[1]
            v = values[j, :k]
            shorts[r] = Shortlist(ids[j, :k], v, float(log_z[j] if log_z is not None else torch.logsumexp(v, -1)),
                                  raw_values[j, :k])
    _add_logprobs(samplers, [shorts[r] for r in range(len(samplers))], raw)
    return [shorts[r] for r in range(len(samplers))]


def _rows(x: torch.Tensor, raw: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(rows) == x.shape[0]:                     # all of them: no gathered copy
        return x, raw
    index = to_device(rows, x.device)
    return x[index], raw[index]


def _untruncated(x: torch.Tensor, raw: torch.Tensor, p: SamplingParams) -> tuple:
    """A row without top-k, best first: the tokens that min-p can keep (with a little slack; the
    exact test runs on the host), else the fewest best tokens holding more than top-p's mass, else
    every token unsorted (nothing truncates). Also the row's log-normaliser: the shortlist is then
    not the whole set that top-p and the probabilities normalise over."""
    log_z = torch.logsumexp(x, -1)
    if p.min_p > 0:
        ids = (~(x < x.max() + math.log(p.min_p) - 1e-4)).nonzero().squeeze(1)
        values, order = x[ids].sort(descending=True)
        ids = ids[order]
    elif p.top_p < 1.0:
        k = min(1024, x.numel())
        while True:                                 # a host read per round; this path is rare
            values, ids = x.topk(k)
            if k == x.numel() or float(torch.exp(values - log_z).sum()) > p.top_p + 1e-6:
                break
            k = min(8 * k, x.numel())
    else:
        ids, values = torch.arange(x.numel(), device=x.device), x
    return ids[None], values[None], raw[ids][None], log_z[None]


def _add_logprobs(samplers: Sequence[Sampler], shorts: list[Shortlist], raw: torch.Tensor) -> None:
    """The model's log-normaliser and top log-probabilities for the rows that report them."""
    want = [r for r, s in enumerate(samplers) if s.params.logprobs is not None]
    if not want:
        return
    rows = to_device(want, raw.device)
    lse = torch.logsumexp(raw[rows], -1)
    n_top = max(samplers[r].params.logprobs for r in want)
    top = raw[rows].topk(n_top, -1) if n_top else None
    lse = lse.cpu()
    values, ids = (top.values.cpu() - lse[:, None], top.indices.cpu()) if top is not None else (None, None)
    for i, r in enumerate(want):
        shorts[r].raw_lse = float(lse[i])
        n = samplers[r].params.logprobs
        shorts[r].top_logprobs = list(zip(ids[i, :n].tolist(), values[i, :n].tolist())) if n else []


def distribution_reference(sampler: Sampler, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
    """The chain over the whole vocabulary, written plainly: what ``Sampler.distribution`` must equal."""
    p = sampler.params
    x = penalized(sampler._masked(logits.float().cpu()), history, p)
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
    if p.top_k > 0 and p.top_k < logits.numel():                   # exactly k, as llama.cpp
        keep = torch.zeros_like(keep).index_fill(0, torch.topk(logits, p.top_k).indices, True)
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
