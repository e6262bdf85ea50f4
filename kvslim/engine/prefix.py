"""Prefix reuse across requests, including for hybrid models.

Attention KV can be cut back to any length, so a new prompt that shares a
prefix with what a slot already holds only needs its new tokens. A DeltaNet
state cannot be rewound: it only exists for the exact length it has absorbed.
So the engine checkpoints the recurrent layers' state at prefill chunk
boundaries, at the end of each prompt and at the end of each generation
(message boundaries), and a later request resumes from the longest checkpoint
inside the shared prefix. Checkpoints are bounded per slot and in bytes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..cache import Checkpoint, ModelCache


@dataclass
class SlotHistory:
    tokens: list[int] = field(default_factory=list)     # what the slot's cache holds, in order
    checkpoints: list[Checkpoint] = field(default_factory=list)
    last_used: float = 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Per-slot token history and recurrent-state checkpoints over one ``ModelCache``."""

    def __init__(self, cache: ModelCache, max_checkpoints: int = 8, max_bytes: int = 256 << 20):
        self.cache = cache
        self.slots = [SlotHistory() for _ in range(cache.n_slots)]
        self.max_checkpoints, self.max_bytes = max_checkpoints, max_bytes

    @property
    def nbytes(self) -> int:
        return sum(cp.nbytes for h in self.slots for cp in h.checkpoints)

    def checkpoint_lengths(self, slot: int) -> list[int]:
        return [cp.n_tokens for cp in self.slots[slot].checkpoints]

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this slot can skip (at least one token is always left to read)."""
        h = self.slots[slot]
        limit = min(common_prefix(h.tokens, prompt), len(prompt) - 1)
        if not self.cache.recurrent or limit == len(h.tokens):
            return limit                                        # KV trims anywhere; live state fits exactly
        return max((cp.n_tokens for cp in h.checkpoints if cp.n_tokens <= limit), default=0)

    def pick(self, free: list[int], prompt: list[int]) -> tuple[int, int]:
        """The free slot that can skip the most tokens (least recently used on ties)."""
        best = max(free, key=lambda s: (self.reusable(s, prompt), -self.slots[s].last_used))
        return best, self.reusable(best, prompt)

    def restore(self, slot: int, prompt: list[int]) -> int:
        """Bring ``slot`` back to the longest reusable prefix of ``prompt``; returns its length."""
        n = self.reusable(slot, prompt)
        h = self.slots[slot]
        checkpoint = next((cp for cp in h.checkpoints if cp.n_tokens == n), None)
        self.cache.rewind(slot, n, checkpoint)
        h.tokens = h.tokens[:n]
        h.checkpoints = [cp for cp in h.checkpoints if cp.n_tokens <= n]
        h.last_used = time.monotonic()
        return n

    def record(self, slot: int, tokens: list[int], checkpoint: bool) -> None:
        """The slot now holds ``tokens``; optionally checkpoint its recurrent state here."""
        h = self.slots[slot]
        h.tokens, h.last_used = list(tokens), time.monotonic()
        if not checkpoint or not self.cache.recurrent or any(cp.n_tokens == len(tokens) for cp in h.checkpoints):
            return
        h.checkpoints.append(self.cache.checkpoint(slot))
        self._evict(slot)

    def forget(self, slot: int) -> None:
        self.slots[slot] = SlotHistory()

    def _evict(self, slot: int) -> None:
        """Oldest (shortest) checkpoints go first: later turns build on the longest prefixes."""
        h = self.slots[slot]
        h.checkpoints.sort(key=lambda cp: cp.n_tokens)
        while len(h.checkpoints) > self.max_checkpoints:
            h.checkpoints.pop(0)
        while self.nbytes > self.max_bytes and h.checkpoints:
            h.checkpoints.pop(0)
