"""Decode attention on packed pages in Triton: ``paged_attention.c``'s contract on a GPU.

``decode_state`` returns the online-softmax state (running max, denominator, unnormalised sum
in V's code domain) of one query position per sequence over its packed pages, exactly as
``kvslim.native.paged_attention.decode_state`` does, so ``attention._scan_decode`` can take
either. It is the prefill kernel (``paged_prefill``) with every row of sequence s at position
n_keys[s] - 1: one kernel to tune and to trust, not two that share most of their lines. (The
exception, opt-in and untimed: decode by warps, ``_decode_warps_kernel``, tune KERNEL "warps" or
DECODE_BY_WARPS, whose step shares nothing between warps; docs/gpu.md, session 44. A decode
step's launch comes from ``step_launch``: that switch, a lease's tuned file, or the default.) With
a handful of rows per sequence the launcher cuts each sequence's keys into splits of
SPLIT_KEYS (flash-decoding), fixed, so a sequence gets the same bits whatever its batch (as
the C kernel's SPAN), and merges them.

Its reference is the torch block loop ``attention._scan_pages``; tests/test_triton_attention.py
checks the two agree under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).
"""
from __future__ import annotations

import os

import torch

from . import paged_prefill, rotation, tuned
from .paged_prefill import SPLIT_KEYS

MAX_ROWS = paged_prefill.SPLIT_ROWS   # query rows per KV head: up to here the keys are split

# Decode steps by warps (``_decode_warps_kernel``: each warp its own keys, CUDA-core products)
# where it reads the formats, over a tuned file's launch and the backend's (``step_launch``): off
# until a lease times it against the tile kernel (benchmarks/gpu_decode.py); KVSLIM_DECODE_WARPS=1,
# or benchmarks/gpu_model.py --decode-warps.
DECODE_BY_WARPS = os.environ.get("KVSLIM_DECODE_WARPS", "0") == "1"


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


def serves_step(fmt_k, fmt_v, q: torch.Tensor, n_kv_heads: int) -> bool:
    """Whether ``step_output`` serves a decode step's q (B, H, D) of any float type over
    ``n_kv_heads`` KV heads: at most MAX_ROWS query heads share one, and the kernel runs here
    and decodes both formats."""
    return (q.is_floating_point() and q.shape[1] // n_kv_heads <= MAX_ROWS
            and paged_prefill.decodes(fmt_k, fmt_v, q.shape[-1], q.device))


def step_launch(fmt_k, fmt_v, head_dim: int, n_rows: int, backend: str,
                device: torch.device) -> tuple[dict | None, int]:
    """(tune, keys a split) of a decode step's launch for ``n_rows`` query rows a KV head and an
    attention backend ("f32" or "bf16"): decode by warps under DECODE_BY_WARPS where it reads the
    formats (float32 products, whatever the backend's), else ``tuned.decode_launch``'s (this
    device's tuned file, else the backend's default)."""
    if DECODE_BY_WARPS and paged_prefill.reads_by_warps(fmt_k, fmt_v, head_dim, n_rows):
        return {"KERNEL": "warps"}, SPLIT_KEYS
    return tuned.decode_launch(fmt_k, fmt_v, head_dim, n_rows, backend, device)


def step_output(fmt_k, fmt_v, q: torch.Tensor, scale: float, k_pool: torch.Tensor, v_pool: torch.Tensor,
                table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, split_keys: int = SPLIT_KEYS,
                tune: dict | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention output from its operands as they lie: q (B, H, D) of any float
    type in the model domain (heads contiguous, rows at any stride), scaled by ``scale`` as the
    kernel reads it; table (n_slots, P) the cache's block table's first P columns, read at rows
    ``slots`` (B,); positions (B,): sequence b sees its keys 0..positions[b]. -> float32 (B, H, D)
    in the model domain, normalised. Query heads h*G..h*G+G-1 read KV head h (GQA).

    The torch form (``attention.paged_decode``'s) casts, scales and regroups q, gathers the
    table's rows, adds 1 to the positions, divides the sum by the denominator and puts the heads
    back: 7 launches an attention layer around the kernel, which reads and writes those
    layouts itself here. A rotated K format still rotates q once, and a rotated V the output
    back (the formats' rotations: one launch each with the kernels on, ``gpu.rotation``).
    ``gate`` (B, H, D), gated attention's (any float type, contiguous rows, rows and heads at any
    strides): the output times sigmoid(gate) in the gate's type, in the launch that stores the
    output (the attention kernel's, its merge's, or V's rotation back), where
    ``swiglu.sigmoid_mul`` was one more."""
    n_seq, n_heads, dim = q.shape
    n_kv = k_pool.shape[0]
    if fmt_k.transformed:
        q = rotation.to_code_domain(fmt_k, q)        # row by row, any layout (klt3's per-head bases never get here)
    grouped = lambda t: t.unflatten(1, (n_kv, n_heads // n_kv)).transpose(0, 1)   # noqa: E731  (Hkv, B, G, D) views
    gate_here = gate if not fmt_v.transformed else None              # else it joins V's rotation back
    out = torch.empty(n_seq, n_heads, dim, device=q.device, dtype=torch.float32 if gate_here is None else gate.dtype)
    paged_prefill.attend(fmt_k, fmt_v, grouped(q), None, k_pool, v_pool, table, positions, scale=scale, slots=slots,
                         length_offset=1, out=grouped(out), split_keys=split_keys, tune=tune,
                         gate=None if gate_here is None else grouped(gate_here))
    return rotation.from_code_domain(fmt_v, out, gate) if fmt_v.transformed else out
