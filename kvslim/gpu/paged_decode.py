"""Decode attention on packed pages in Triton: ``paged_attention.c``'s contract on a GPU.

``decode_state`` returns the online-softmax state (running max, denominator, unnormalised sum
in V's code domain) of one query position per sequence over its packed pages, exactly as
``kvslim.native.paged_attention.decode_state`` does, so ``attention._scan_decode`` can take
either. It is the prefill kernel (``paged_prefill``) with every row of sequence s at position
n_keys[s] - 1: one kernel to tune and to trust, not two that share most of their lines. With
a handful of rows per sequence the launcher cuts each sequence's keys into splits of
SPLIT_KEYS (flash-decoding), fixed, so a sequence gets the same bits whatever its batch (as
the C kernel's SPAN), and merges them.

Its reference is the torch block loop ``attention._scan_pages``; tests/test_triton_attention.py
checks the two agree under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).
"""
from __future__ import annotations

import torch

from . import paged_prefill
from .paged_prefill import SPLIT_KEYS

MAX_ROWS = paged_prefill.SPLIT_ROWS   # query rows per KV head: up to here the keys are split


def supports(fmt_k, fmt_v, q: torch.Tensor) -> bool:
    """Whether the kernel serves these formats for q (Hkv, S, R, D) float32, R <= MAX_ROWS:
    triton is importable, q is on a CUDA device (or on the CPU under TRITON_INTERPRET=1), and
    both formats have a layout it decodes."""
    return q.shape[-2] <= MAX_ROWS and paged_prefill.supports(fmt_k, fmt_v, q)


def decode_state(fmt_k, fmt_v, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 table: torch.Tensor, n_keys: torch.Tensor, split_keys: int = SPLIT_KEYS,
                 tune: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (Hkv, S, R, D) float32, scaled, in K's code domain; pools (Hkv, pages, page_size, row bytes)
    uint8; table (S, P) int32 pages; n_keys (S,) keys each sequence sees (its first n_keys).
    -> m, l (Hkv, S, R, 1) and acc (Hkv, S, R, D), acc in V's code domain, not normalised; a
    sequence without keys gets m = -inf, l = 0, acc = 0. ``split_keys``: keys per program;
    ``tune``: launch overrides (``paged_prefill.TUNABLE``).
    The number of splits comes from the table's width: no host sync."""
    # every row at its sequence's last key (q_pos None): read in the kernel, no launch before it
    return paged_prefill.prefill_state(fmt_k, fmt_v, q, None, k_pool, v_pool, table, n_keys, split_keys, tune)
