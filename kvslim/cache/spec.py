"""Per-layer byte accounting: what one layer's cache costs, from the formats table.

The allocator (``KVCache``, ``RecurrentStateCache``) sizes its buffers from
these specs and the planner sums them, so there is one formula, here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import formats
from ..formats.base import ceil_div

STATE_DTYPE_BYTES = 4  # DeltaNet conv and recurrent state are kept in fp32


@dataclass(frozen=True)
class KVLayerSpec:
    """An attention layer's KV cache: K and V formats chosen independently."""

    n_kv_heads: int
    head_dim: int
    type_k: str = "f16"
    type_v: str = "f16"

    def __post_init__(self):
        if self.n_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"n_kv_heads and head_dim must be positive, got {self.n_kv_heads}, {self.head_dim}")
        formats.get(self.type_k).check_head_dim(self.head_dim)
        formats.get(self.type_v).check_head_dim(self.head_dim)

    @property
    def k_row_bytes(self) -> int:
        return formats.get(self.type_k).row_bytes(self.head_dim)

    @property
    def v_row_bytes(self) -> int:
        return formats.get(self.type_v).row_bytes(self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K plus V bytes for one token of one sequence, all KV heads."""
        return self.n_kv_heads * (self.k_row_bytes + self.v_row_bytes)

    def bytes_for(self, n_tokens: int, page_size: int = 1, f16_window: int = 0) -> int:
        """Allocated bytes for ``n_tokens`` of one sequence stored in pages of ``page_size``,
        plus its f16 window's (``window_bytes``): the pages are sized for the whole context."""
        return ceil_div(n_tokens, page_size) * page_size * self.bytes_per_token + self.window_bytes(f16_window)

    def window_bytes(self, f16_window: int) -> int:
        """One sequence's f16 window: ``f16_window`` tokens of K and V, 2 bytes a value."""
        return 2 * f16_window * self.n_kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class StateLayerSpec:
    """A linear-attention (Gated DeltaNet) layer's fixed-size state per sequence.

    conv state: the last ``conv_kernel - 1`` inputs of the depthwise conv, (conv_dim, kernel - 1);
    recurrent state: one (k_head_dim, v_head_dim) matrix per value head.
    """

    conv_dim: int
    conv_kernel: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.n_v_heads, self.k_head_dim, self.v_head_dim)

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1)
        rec = self.n_v_heads * self.k_head_dim * self.v_head_dim
        return (conv + rec) * STATE_DTYPE_BYTES


def layout_bytes(layout, ctx_per_slot: int, n_slots: int, page_size: int = 1, f16_window: int = 0) -> tuple[int, int]:
    """(KV bytes, state bytes) of a model's cache ``layout`` for ``n_slots`` sequences of
    ``ctx_per_slot`` tokens in pages of ``page_size`` (and f16 windows of ``f16_window`` tokens):
    what the caches preallocate (checked against free memory before allocating) and what the
    planner plans, from one formula."""
    kv = sum(s.bytes_for(ctx_per_slot, page_size, f16_window) for s in layout if isinstance(s, KVLayerSpec))
    state = sum(s.bytes_per_slot for s in layout if isinstance(s, StateLayerSpec))
    return n_slots * kv, n_slots * state
