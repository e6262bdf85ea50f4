"""Quantize-on-append in Triton: new K or V rows straight into a paged pool, on the GPU.

``append(fmt, x, pool, table, slots, positions, flags)`` does what ``KVCache._scatter`` does for
one of K or V with the block table's lookup, ``fmt.encode_flagged``, a reshape, an indexed write
and the flags' scatter, in one kernel: each (token, KV head) row of x is encoded as the format's
torch encoder does and written at the pool row the table gives its (slot, position), and the
token's overflow (NaN/inf, or values past what the fp16 fields hold) raises its slot's flag on
the device, nobody waiting for it. What to compute comes from the format's ``kernel_encoder``
(kvslim/formats/base.py), the declaration ``kvslim/native/kv_encode.c`` reads too.

Formats: f32/f16/bf16, q8_0, q4_0 and iq4_nl (rotated or not), turbo2/3/4, nl3/nl4; not the
nls rows (their rung search), q4_1/q5_x or the QJL variants. The references are the formats'
own ``encode``; tests/test_triton_append.py holds the two together under Triton's interpreter.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import formats
from . import available, kernels, pdl, pow2, serves

KINDS = {"float": 0, "q8_0": 1, "q4_0": 2, "turbo": 3, "grid": 4, "iq4_nl": 5, "q4_1": 6, "q5_0": 7,
         "q5_1": 8, "grid_sub": 9}                                                    # _kv_append_kernel's
SUB_VALUES = 16               # the kernel's rung width (grid_sub): the nls rows' 16 values a rung
FLOAT_TYPES = {"f32": 0, "f16": 1, "bf16": 2}
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEADS = 16                # a token's KV heads a program, at most (more: programs side by side)
DOT_ROWS = 16                 # tl.dot's smallest M, for turbo's rotation: rows x blocks, padded to it
MAX_DIM = 512
FLT_MAX = torch.finfo(torch.float32).max
TABLES = ("rot_matrix", "boundaries", "centroids", "tries", "ladder")   # a declaration's, in the kernel's order


def _kernel():
    return kernels("_kv_append_kernel")                 # imports triton: only when a kernel runs


@lru_cache(maxsize=None)
def _declared(name: str, role: str, head_dim: int):
    """The format's ``kernel_encoder``, built once: ``append`` runs per layer per step, and the
    declaration builds its tables (codebooks, grid midpoints, scale tries) each time it is asked."""
    return formats.get(name, role=role).kernel_encoder(head_dim)


def _encoder(fmt, head_dim: int):
    """The format's declared encoder when this kernel implements it, else None."""
    try:
        fmt.check_head_dim(head_dim)
    except ValueError:
        return None
    enc = _declared(*_key(fmt, head_dim))
    known = enc is not None and enc.kind in KINDS and enc.sub_values in (0, SUB_VALUES)
    return enc if known and head_dim <= MAX_DIM else None


def supports(fmt, x: torch.Tensor) -> bool:
    """Whether this kernel encodes rows x (N, Hkv, D) into ``fmt``: triton is importable, x is
    float32/f16/bf16 on a CUDA device (or on the CPU under TRITON_INTERPRET=1), and the format
    declares an encoder this kernel implements."""
    return (x.dim() == 3 and x.dtype in INPUT_DTYPES and available() and _encoder(fmt, x.shape[-1]) is not None
            and serves("_kv_append_kernel", x.device))


@lru_cache(maxsize=None)
def _tables(name: str, role: str, head_dim: int, device: str) -> tuple[torch.Tensor, ...]:
    """The declaration's tables on the kernel's device (a one-float placeholder where it has none)."""
    enc = _declared(name, role, head_dim)
    none = torch.zeros(1)
    return tuple((none if t is None else t).float().contiguous().to(device)
                 for t in (getattr(enc, table) for table in TABLES))


@lru_cache(maxsize=None)
def _launch(name: str, role: str, head_dim: int) -> tuple[dict, float, float]:
    """(constexprs and warps, overflow limit, rotation scale) of one format and head_dim, once."""
    enc = _declared(name, role, head_dim)
    limit = enc.limit if enc.limit > 0 else FLT_MAX                   # 0 declares no limit: only NaN/inf
    # as torch's y * n ** -0.5 rounds it; on the CPU whatever the default device (a CUDA scalar's
    # float() would sync, and break a CUDA graph's capture were this the first call)
    rot_scale = float(torch.tensor(enc.rot ** -0.5 if enc.rot else 1.0, dtype=torch.float32, device="cpu"))
    return _launch_config(enc, head_dim, formats.get(name, role=role).row_bytes(head_dim)), limit, rot_scale


def _launch_config(enc, head_dim: int, row_bytes: int) -> dict:
    """The kernel's constexprs for one format and head_dim. Turbo groups may be any multiple of 8
    (head_dim 96: one group of 96), so its blocks pad to a power of two; the Hadamard formats'
    blocks are 32, 64 or 128 and tile the row padded to BLOCK_D."""
    block_d = pow2(head_dim)
    group = enc.block if enc.kind != "float" else head_dim
    block = pow2(group)
    n_blocks = head_dim // group
    return dict(HEAD_DIM=head_dim, BLOCK_D=block_d, KIND=KINDS[enc.kind],
                FLOAT_TYPE=FLOAT_TYPES.get(enc.float_type, 0), ROT=enc.rot if enc.hadamard else 0,
                LOG2_ROT=enc.rot.bit_length() - 1 if enc.hadamard else 0, GROUP=group, N_BLOCKS=n_blocks,
                NB=pow2(n_blocks) if enc.kind == "turbo" else block_d // block, BLOCK=block, BITS=enc.bits,
                BLOCK_BYTES=row_bytes // n_blocks, N_TRIES=0 if enc.tries is None else len(enc.tries),
                num_warps=8 if enc.kind == "turbo" and block >= 128 else 4)


def kernel_config(config: dict, n_kv: int, page_size: int) -> dict:
    """A launch's constexprs: ``_launch_config``'s for the format, the pool's PAGE_SIZE, and BLOCK_M,
    the rows of one token a program encodes: its KV heads (a power of two, at most MAX_HEADS), for
    turbo at least DOT_ROWS with the blocks (dead rows masked). ROT_STEP: turbo's rotation takes
    the whole matrix in one tl.dot step at DOT_ROWS rows (the matrix loaded with the token's rows,
    before the norms: sm_90, 2 heads, 6-8 waits on memory, not 21-22, the ones past the first
    the codebook's, from L1), 16 of its rows a step past them (one step spilled)."""
    rows = min(pow2(n_kv), MAX_HEADS)
    if config["KIND"] == KINDS["turbo"]:
        rows = max(rows, DOT_ROWS // config["NB"])
    one_step = rows * config["NB"] <= DOT_ROWS
    return {**config, "PAGE_SIZE": page_size, "BLOCK_M": rows, "ROT_STEP": config["BLOCK"] if one_step else 16}


def append(fmt, x: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, flags: torch.Tensor) -> None:
    """Encode x (N, Hkv, D) float32/f16/bf16 into ``fmt`` and write token n's head h into
    ``pool`` (Hkv, pages, page_size, row_bytes) uint8, in place, at the row the block ``table``
    (S, P) int32 gives (slots[n], positions[n]); ``flags`` (S,) uint8, the cache's per-slot
    overflow flags, set to 1 for the slot of every token ``fmt.encode_flagged`` flags (NaN/inf,
    or past the fp16 fields; a flagged token's bytes are not meant to be read), others left as
    they were. One launch: the rows are found and the flags raised in the kernel, nobody waiting
    for them."""
    _append([(fmt, x, pool)], table, slots, positions, flags)


def append_kv(fmt_k, k: torch.Tensor, k_pool: torch.Tensor, fmt_v, v: torch.Tensor, v_pool: torch.Tensor,
              table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, flags: torch.Tensor) -> None:
    """``append`` of K and of V (a cache's new rows, one block table): one launch for both where
    they encode alike (one kernel configuration and the same tables: f16/f16, turbo3/turbo3 and
    the like) and come alike (shape, type, pool shape), else one each (q8_0 K and V: llama.cpp
    rotates K by head_dim's largest power of two and V by 64s)."""
    sides = [(fmt_k, k, k_pool), (fmt_v, v, v_pool)]
    dim = k.shape[-1]
    if k.shape == v.shape and k.dtype == v.dtype and k_pool.shape == v_pool.shape \
            and _alike(_key(fmt_k, dim), _key(fmt_v, dim)):
        _append(sides, table, slots, positions, flags)
        return
    for side in sides:
        _append([side], table, slots, positions, flags)


@lru_cache(maxsize=None)
def _alike(key_k: tuple, key_v: tuple) -> bool:
    """Whether two declarations encode alike: the same constexprs, limits and tables (compared on
    the CPU, once per pair: never a device read in a step)."""
    if _launch(*key_k) != _launch(*key_v):
        return False
    enc_k, enc_v = _declared(*key_k), _declared(*key_v)
    return all(_same(getattr(enc_k, table), getattr(enc_v, table)) for table in TABLES)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))


def _key(fmt, head_dim: int) -> tuple[str, str, int]:
    """(name, role, head_dim): what the declaration's caches are keyed by (a format without a role: "k")."""
    return fmt.name, getattr(fmt, "role", "k"), head_dim


def _append(sides: list, table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
            flags: torch.Tensor) -> None:
    """One launch over the rows of one side (fmt, x, pool), or of two that encode alike
    (``append_kv``): grid (tokens, blocks of a token's heads, sides), the first side's tables."""
    fmt, x, pool = sides[0]
    n_tokens, n_kv, dim = x.shape
    assert table.dim() == 2 and table.stride(1) == 1 and slots.shape == positions.shape == (n_tokens,)
    assert flags.dtype == torch.uint8 and flags.shape == (table.shape[0],) and flags.is_contiguous()
    config, limit, rot_scale = _launch(*_key(fmt, dim))
    rows = []
    for _, side_x, side_pool in sides:
        assert side_pool.is_contiguous() and side_pool.shape[0] == n_kv and side_pool.shape[3] == fmt.row_bytes(dim)
        if side_x.stride()[1:] != (dim, 1):               # each token's heads contiguous; tokens at any stride
            side_x = side_x.contiguous()
        rows.append((side_x, side_pool))
    (x, pool), (x2, pool2) = rows[0], rows[-1]
    if not n_tokens:
        return
    config = kernel_config(config, n_kv, pool.shape[2])
    _kernel().kv_append_rows[(n_tokens, -(-n_kv // config["BLOCK_M"]), len(sides))](
        x, pool, table, slots.contiguous(), positions.contiguous(), flags, *_tables(*_key(fmt, dim), str(x.device)),
        n_kv, pool.shape[1] * pool.shape[2], pool.shape[3], table.stride(0), x.stride(0), limit,
        rot_scale, x2, pool2, x2.stride(0), enable_fp_fusion=False, **config,   # x * id + 8.5 rounds twice, as torch
        **pdl(x.device))
