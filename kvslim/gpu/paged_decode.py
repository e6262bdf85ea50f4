"""Decode attention on packed pages in Triton: ``paged_attention.c``'s contract on a GPU.

``decode_state`` returns the online-softmax state (running max, denominator, unnormalised sum
in V's code domain) of one query position per sequence over its packed pages, exactly as
``kvslim.native.paged_attention.decode_state`` does, so ``attention._scan_decode`` could take
either. The row layouts come from ``codec_fields`` (the C kernel's description of each format);
this module restates none. Flash-decoding: each (KV head, sequence) is cut into splits of
SPLIT_KEYS keys that run as separate programs; their states are merged here in torch.

Its reference is the torch block loop ``attention._scan_pages``; tests/test_triton_attention.py
checks the two agree under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..native.paged_attention import CodecFields, codec_fields

SPLIT_KEYS = 512          # keys per program: fixed, so a sequence's bits do not depend on its batch (as the C SPAN)
BLOCK_N = 32              # keys decoded and scored together, at head_dim <= 64 (16 above: see _launch_config)
MAX_ROWS = 64             # query rows per KV head one program holds
MIN_DOT = 16              # tl.dot's smallest M, N and K: fewer query rows are padded with zeros


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether triton imports (it is not a dependency of kvslim)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=None)
def _kernel():
    from . import _paged_decode_kernel                  # imports triton: only when a kernel runs
    return _paged_decode_kernel


def _fields(fmt, head_dim: int) -> CodecFields | None:
    """The format's layout when this kernel decodes it: no sub-block rungs (the nl*s rows) yet."""
    fields = codec_fields(fmt.name, getattr(fmt, "role", "k"), head_dim)
    if fields is None or fields.sub_values:
        return None
    return fields


def _device_ok(device: torch.device) -> bool:
    """The compiled kernel runs on CUDA tensors, the interpreted one on CPU tensors. Triton fixes
    which one this process has at import (TRITON_INTERPRET): triton's own, then the kernel module's."""
    kernel = _kernel()
    return kernel.RUNNABLE and device.type == ("cpu" if kernel.INTERPRETED else "cuda")


def supports(fmt_k, fmt_v, q: torch.Tensor) -> bool:
    """Whether this kernel serves these formats for q (Hkv, S, R, D) float32: triton is
    importable, q is on a CUDA device (or on the CPU under TRITON_INTERPRET=1), and both
    formats have a layout it decodes."""
    dim, rows = q.shape[-1], q.shape[-2]
    return (q.dtype == torch.float32 and rows <= MAX_ROWS and available() and _device_ok(q.device)
            and _fields(fmt_k, dim) is not None and _fields(fmt_v, dim) is not None)


@lru_cache(maxsize=None)
def _lut(name: str, role: str, head_dim: int, device: str) -> torch.Tensor:
    """The format's 16 code values on the kernel's device (zeros for formats without codes)."""
    fields = codec_fields(name, role, head_dim)
    return (torch.zeros(16) if fields.lut is None else fields.lut).to(device)


def _codec_args(fmt, head_dim: int, prefix: str) -> dict:
    f = _fields(fmt, head_dim)
    return {f"{prefix}_KIND": f.kind, f"{prefix}_BITS": f.bits, f"{prefix}_VALUES": f.block_values,
            f"{prefix}_BYTES": f.block_bytes, f"{prefix}_HEADER": f.header_bytes}


def _launch_config(fmt_k, fmt_v, n_rows: int, head_dim: int, split_keys: int = SPLIT_KEYS) -> dict:
    """The kernel's constexprs and warps for one call. Tiles of (keys x head_dim) decoded values
    live in registers: ptxas for sm_90 spills kilobytes at head_dim 256 with 32 keys and 4 warps,
    and little with 16 keys (and 8 warps at 256). A guess from spill counts, not timings."""
    assert split_keys % BLOCK_N == 0, f"split_keys must be a multiple of {BLOCK_N}"
    return dict(HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), BLOCK_G=max(MIN_DOT, _pow2(n_rows)),
                BLOCK_N=BLOCK_N if head_dim <= 64 else MIN_DOT, SPLIT_KEYS=split_keys,
                **_codec_args(fmt_k, head_dim, "K"), **_codec_args(fmt_v, head_dim, "V"),
                num_warps=8 if head_dim >= 256 else 4)


def decode_state(fmt_k, fmt_v, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 table: torch.Tensor, n_keys: torch.Tensor, split_keys: int = SPLIT_KEYS
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (Hkv, S, R, D) float32, scaled, in K's code domain; pools (Hkv, pages, page_size, row bytes)
    uint8; table (S, P) int32 pages; n_keys (S,) keys each sequence sees (its first n_keys).
    -> m, l (Hkv, S, R, 1) and acc (Hkv, S, R, D), acc in V's code domain, not normalised; a
    sequence without keys gets m = -inf, l = 0, acc = 0. ``split_keys``: keys per program (a
    multiple of BLOCK_N). The number of splits comes from the table's width: no host sync."""
    n_kv, n_seq, n_rows, dim = q.shape
    config = _launch_config(fmt_k, fmt_v, n_rows, dim, split_keys)
    page_size = k_pool.shape[2]
    n_splits = max(1, -(-table.shape[1] * page_size // split_keys))
    q, table = q.contiguous(), table.to(torch.int32).contiguous()
    n_keys = n_keys.to(device=q.device, dtype=torch.int32).contiguous()
    m = torch.empty(n_kv, n_seq, n_splits, n_rows, device=q.device)
    l, acc = torch.empty_like(m), torch.empty(n_kv, n_seq, n_splits, n_rows, dim, device=q.device)
    luts = [_lut(f.name, getattr(f, "role", "k"), dim, str(q.device)) for f in (fmt_k, fmt_v)]
    _kernel().paged_decode_split[(n_kv, n_seq, n_splits)](
        q, k_pool.contiguous(), v_pool.contiguous(), table, n_keys, *luts, m, l, acc,
        n_seq, n_rows, k_pool.shape[1], page_size, k_pool.shape[3], v_pool.shape[3], table.shape[1], n_splits,
        **config)
    return merge_splits(m, l, acc)


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits' states m, l (Hkv, S, n, R) and acc (Hkv, S, n, R, D) -> one state per row,
    m, l (Hkv, S, R, 1) and acc (Hkv, S, R, D): each split rescaled to the common max.
    A split without keys has m = -inf and weighs 0; a row without any keys keeps -inf, 0, 0."""
    top = m.amax(2, keepdim=True)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(m - safe)                                        # (Hkv, S, n, R)
    l_all = (l * weight).sum(2)
    acc_all = (acc * weight.unsqueeze(-1)).sum(2)
    return top.squeeze(2).unsqueeze(-1), l_all.unsqueeze(-1), acc_all


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
