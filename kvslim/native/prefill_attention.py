"""Prefill attention with bfloat16 dot products in C (``prefill_attention.c``), beside the torch path.

``fold_pages`` reads one sequence's packed pages itself (the formats ``paged_attention``'s
codecs describe: q8_0, q4_0, iq4_nl, turbo, nl grids, f16 ...); ``fold`` takes a block of keys
and values that torch decoded (every other format). Both fold into the running online-softmax
state of a prompt chunk's query rows. Only the dot products' operands are rounded to bf16 (as
llama.cpp's CPU flash attention rounds them to f16); scores, softmax and sums stay float32. It needs AVX512_BF16; elsewhere ``available()``
is False and the float32 torch loop serves.
"""
from __future__ import annotations

import ctypes

import torch

from . import build
from . import paged_attention as codecs

SOURCE = "prefill_attention.c"
KEY_TILE = 64                          # keys per tile in the kernel (KT)


def _library(variant: str | None = None):
    lib = build.library(SOURCE, variant)
    if lib is not None and lib.kvslim_prefill_bf16.argtypes is None:
        fn = lib.kvslim_prefill_bf16
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] + [ctypes.c_int64] * 2 + \
            [ctypes.c_void_p] * 3 + [ctypes.c_int]
        lib.kvslim_prefill_bf16_available.restype = ctypes.c_int
        fn = lib.kvslim_prefill_bf16_pages
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(codecs.Codec)] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + \
            [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    return lib


def available(variant: str | None = None) -> bool:
    """Whether this machine's build has the AVX512_BF16 kernel."""
    lib = _library(variant)
    return lib is not None and bool(lib.kvslim_prefill_bf16_available())


def supports(q: torch.Tensor) -> bool:
    """q (Hkv, S, R, D): one sequence's float32 rows on the CPU, head_dim a multiple of 64."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[1] == 1 and q.shape[-1] % 64 == 0
            and q.shape[-1] <= 1024 and available())


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def fold(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
         k_scale: torch.Tensor | None, v: torch.Tensor, v_scale: torch.Tensor | None, q_pos: torch.Tensor,
         start: int, length: int) -> None:
    """Fold keys [start, start + T) into the state, in place.

    m, l (Hkv, 1, R, 1) and acc (Hkv, 1, R, D): contiguous float32 state; q (Hkv, 1, R, D) float32,
    scaled, in K's code domain; k, v (Hkv, 1, T, D) float32 in the code domains, times k_scale,
    v_scale (Hkv, 1, T) per row when given; q_pos (1, R) each row's position: a row sees key
    positions <= its own and < ``length``.
    """
    n_kv, _, n_rows, dim = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    k_scale = None if k_scale is None else k_scale.float().contiguous()
    v_scale = None if v_scale is None else v_scale.float().contiguous()
    pos = q_pos.reshape(-1).to(torch.int64).contiguous()
    status = _library().kvslim_prefill_bf16(
        q.data_ptr(), k.data_ptr(), _ptr(k_scale), v.data_ptr(), _ptr(v_scale), n_kv, n_rows, k.shape[2], dim,
        pos.data_ptr(), start, length, m.data_ptr(), l.data_ptr(), acc.data_ptr(), torch.get_num_threads())
    if status:
        raise ValueError(f"bf16 prefill attention refused head_dim {dim} (needs a multiple of 64) or ran out of memory")


def reads_pages(fmt_k, fmt_v, dim: int) -> bool:
    """Whether ``fold_pages`` decodes both formats (else torch decodes and ``fold`` folds)."""
    return codecs._codec(fmt_k, dim) is not None and codecs._codec(fmt_v, dim) is not None


def fold_pages(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, q: torch.Tensor, fmt_k, fmt_v,
               k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, length: int,
               q_pos: torch.Tensor) -> None:
    """Fold one sequence's packed keys [0, length) into the state, in place: pools (Hkv, pages,
    page_size, row bytes) uint8, table (1, P) its pages; the rest as ``fold``."""
    n_kv, _, n_rows, dim = q.shape
    ck, cv = codecs._codec(fmt_k, dim), codecs._codec(fmt_v, dim)
    q, table = q.contiguous(), table.to(torch.int32).contiguous()
    pos = q_pos.reshape(-1).to(torch.int64).contiguous()
    status = _library().kvslim_prefill_bf16_pages(
        ctypes.byref(ck), ctypes.byref(cv), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[1],
        k_pool.shape[2], k_pool.shape[3], v_pool.shape[3], table.data_ptr(), n_kv, n_rows, length, dim,
        pos.data_ptr(), m.data_ptr(), l.data_ptr(), acc.data_ptr(), torch.get_num_threads())
    if status:
        raise ValueError(f"bf16 prefill attention refused head_dim {dim} (needs a multiple of 64) or ran out of memory")


def reference_fold(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, q_pos: torch.Tensor, start: int, length: int) -> None:
    """The kernel's arithmetic in torch, for its parity tests: operands rounded to bf16, keys in
    tiles of KEY_TILE from ``start``, the online softmax per tile with the probabilities rounded
    to bf16 for P V and kept float32 in the denominator. Same arguments as ``fold`` (k, v already
    scaled), in place; slow."""
    bf = (lambda x: x.bfloat16().float())
    qb, kb, vb = bf(q[:, 0]), bf(k[:, 0]), bf(v[:, 0])                 # (Hkv, R, D), (Hkv, T, D)
    pos = q_pos.reshape(-1)
    for t0 in range(0, k.shape[2], KEY_TILE):
        keys = torch.arange(start + t0, start + min(t0 + KEY_TILE, k.shape[2]))
        seen = (keys[None, :] <= pos[:, None]) & (keys[None, :] < length)             # (R, n)
        s = (qb @ kb[:, t0:t0 + KEY_TILE].transpose(-1, -2)).masked_fill(~seen, float("-inf"))
        m_new = torch.maximum(m[:, 0], s.amax(-1, keepdim=True))
        live = torch.isfinite(m_new)
        shift = torch.where(live, m_new, torch.zeros_like(m_new))
        e = torch.exp(s - shift)
        corr = torch.where(live, torch.exp(m[:, 0] - shift), torch.ones_like(shift))
        l[:, 0] = l[:, 0] * corr + e.sum(-1, keepdim=True)
        acc[:, 0] = acc[:, 0] * corr + bf(e) @ vb[:, t0:t0 + KEY_TILE]
        m[:, 0] = torch.where(live, m_new, m[:, 0])
