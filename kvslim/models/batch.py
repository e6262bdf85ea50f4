"""What one forward pass processes: several sequences' new tokens, flattened.

Like vLLM's flattened batches: the tokens of all sequences are concatenated
into one (N,) tensor so every linear layer runs once over all of them; the
segments tell the token mixers (attention, DeltaNet) which rows belong to which
cache slot. A decode step is a batch of one-token segments; a prefill chunk is
one long segment; both can be mixed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..devices import to_device


@dataclass(frozen=True)
class Segment:
    slot: int        # cache slot (sequence) the rows belong to
    begin: int       # first row in the flattened batch
    end: int         # one past the last row
    start_pos: int   # absolute position of the first row in its sequence

    @property
    def length(self) -> int:
        return self.end - self.begin


@dataclass
class Batch:
    tokens: torch.Tensor       # (N,) token ids
    positions: torch.Tensor    # (N,) absolute positions
    segments: list[Segment]
    slot_ids: torch.Tensor     # (N,) the cache slot of each row
    # The layers do the caches' host work (checks, page allocation, lengths) themselves.
    prepared = False

    @classmethod
    def build(cls, parts: list[tuple[int, list[int] | torch.Tensor, int]], device="cpu") -> "Batch":
        """``parts``: (slot, token ids, start position) per sequence; slots must differ."""
        slots = [slot for slot, _, _ in parts]
        if len(set(slots)) != len(slots):
            raise ValueError(f"a batch may hold each slot once, got slots {slots}")
        tokens, positions, segments, row = [], [], [], 0
        for slot, ids, start in parts:
            ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
            if ids.numel() == 0:
                raise ValueError(f"slot {slot}: empty token list")
            segments.append(Segment(slot, row, row + ids.numel(), start))
            tokens.append(ids)
            positions.append(torch.arange(start, start + ids.numel()))
            row += ids.numel()
        slot_ids = torch.cat([torch.full((s.length,), s.slot, dtype=torch.long) for s in segments])
        return cls(to_device(torch.cat(tokens), device), to_device(torch.cat(positions), device), segments,
                   to_device(slot_ids, device))

    @property
    def last_rows(self) -> list[int]:
        """Row of each segment's last token (where the next token is predicted)."""
        return [seg.end - 1 for seg in self.segments]

    @property
    def is_decode(self) -> bool:
        return all(seg.length == 1 for seg in self.segments)

    def slot_index(self) -> slice | torch.Tensor:
        """A decode batch's slots as an index into per-slot state: a slice when they are
        consecutive (state is then updated in place through a view), else the (N,) tensor."""
        slots = [seg.slot for seg in self.segments]
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return self.slot_ids


@dataclass
class DecodeBatch:
    """One new token for each of B sequences, as tensors only: the batch of a compiled
    decode step. Its caches were prepared on the host beforehand (checks, pages reserved;
    ``ModelCache.prepare_decode``) and are committed afterwards, so the forward pass does
    no host work and can be traced as one graph."""

    tokens: torch.Tensor       # (B,) token ids
    positions: torch.Tensor    # (B,) the position each token is written at
    slots: torch.Tensor        # (B,) cache slots, distinct
    n_pages: int               # KV pages attention reads per sequence (covers the longest one)
    prepared = True
    is_decode = True

    def slot_index(self) -> torch.Tensor:
        return self.slots

    @property
    def slot_ids(self) -> torch.Tensor:
        """(B,) the cache slot of each row (one row a sequence), as ``Batch.slot_ids``."""
        return self.slots
