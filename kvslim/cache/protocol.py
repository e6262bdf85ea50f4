"""The cache protocol every layer cache implements.

A model's ``make_cache()`` returns a ``ModelCache`` holding one object per
layer; these methods are what it uses on each, so attention layers (``KVCache``)
and linear-attention layers (``RecurrentStateCache``) are interchangeable from
its point of view. Which kind a layer is, is its type, never a string.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LayerCache(Protocol):
    """Per-layer storage for several sequences (slots)."""

    n_slots: int

    def offset(self, slot: int) -> int:
        """Tokens this slot has absorbed so far."""

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated now, all slots."""

    def slot_nbytes(self, slot: int) -> int:
        """Bytes allocated now for one slot."""

    def trim(self, slot: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` of ``slot`` (refused where the layer cannot rewind)."""

    def clear(self, slot: int) -> None:
        """Forget ``slot`` and release its memory."""

    def state(self, slot: int) -> dict[str, torch.Tensor]:
        """Exact contents of one slot as named tensors (for saving)."""

    def check_state(self, slot: int, tensors: dict[str, torch.Tensor], n_tokens: int) -> None:
        """Raise ValueError unless ``load_state`` would accept these tensors; changes nothing."""

    def load_state(self, slot: int, tensors: dict[str, torch.Tensor], n_tokens: int) -> None:
        """Replace one slot's contents with what ``state`` returned."""

    def describe(self) -> dict:
        """Formats and shapes, for checking a saved file against this cache."""
