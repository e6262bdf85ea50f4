"""Decode attention on packed pages in C (``paged_attention.c``), beside the torch path.

``decode_state`` returns the online-softmax state (running max, denominator, unnormalised
sum) of one query position per sequence over its packed pages, so the caller can fold in
more keys (the f16 window) and normalise as the torch path does. Formats are described to
the kernel by a codec: their rows are float, or blocks of [f16 scale][codes] whose values
are scale * table[code] (+ an f16 offset, with a 5th code bit: ggml's q4_1/q5_x), or klt3's
transform-coded rows (per KV head: each direction's code position in the row and its levels, from
the layer's calibration); a format without such a description (the QJL turbo variants) keeps the
torch path.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import build

SOURCE = "paged_attention.c"
F32, F16, BF16, Q8, NIBBLE, PACKED, KLT = range(7)  # the kernel's codec kinds
TILE = 32                                          # keys per tile in the kernel
MAX_DIM, MAX_ROWS = 512, 64
SPAN = 512                                         # keys per work item (paged_attention.c's SPAN): fixed, so that
                                                   # a sequence's result does not depend on its batch or the threads


class Codec(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("bits", ctypes.c_int32), ("block_values", ctypes.c_int32),
                ("block_bytes", ctypes.c_int32), ("lut", ctypes.c_void_p), ("header_bytes", ctypes.c_int32),
                ("sub_values", ctypes.c_int32), ("sub_bits", ctypes.c_int32), ("ladder", ctypes.c_void_p),
                ("offset_at", ctypes.c_int32), ("klt_plan", ctypes.c_void_p), ("klt_levels", ctypes.c_void_p),
                ("klt_stride", ctypes.c_int32)]


@dataclass(frozen=True)
class CodecFields:
    """A row layout the kernel decodes: float rows, or blocks of [f16 scale][(rungs)][codes]."""
    kind: int
    bits: int
    block_values: int
    block_bytes: int
    lut: torch.Tensor | None = None          # 32 floats, the code values zero-padded
    header_bytes: int = 2                    # the f16 scale, then sub-block rungs when sub_values
    sub_values: int = 0                      # values per sub-block with its own rung (0: none)
    sub_bits: int = 0
    ladder: torch.Tensor | None = None       # the rungs' factors, zero-padded to 32
    offset_at: int = 0                       # byte of an f16 added to each value (q4_1, q5_1; 0: none)
    klt_plan: torch.Tensor | None = None     # KLT: (heads, dim) int32, each code's place (paged_attention.c)
    klt_levels: torch.Tensor | None = None   # KLT: (heads, klt_stride) float32, 2^bits levels per direction
    klt_stride: int = 0

    def codec(self) -> Codec:
        pointer = (lambda t: None if t is None else t.data_ptr())
        return Codec(self.kind, self.bits, self.block_values, self.block_bytes, pointer(self.lut),
                     self.header_bytes, self.sub_values, self.sub_bits, pointer(self.ladder), self.offset_at,
                     pointer(self.klt_plan), pointer(self.klt_levels), self.klt_stride)


def _library(variant: str | None = None):
    lib = build.library(SOURCE, variant)
    if lib is not None and lib.kvslim_paged_decode.argtypes is None:
        fn = lib.kvslim_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(Codec), ctypes.POINTER(Codec)] + [ctypes.c_void_p] * 3 + \
            [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 5 + \
            [ctypes.c_void_p] * 3 + [ctypes.c_int]
    return lib


def _table32(values) -> torch.Tensor:
    """Code values or rung factors as the 32 floats the kernel may load whatever the width."""
    t = torch.as_tensor(values, dtype=torch.float32).flatten()
    return torch.nn.functional.pad(t, (0, 32 - len(t)))


KINDS = {"f32": F32, "f16": F16, "bf16": BF16, "int8": Q8, "nibble": NIBBLE, "packed": PACKED}


@lru_cache(maxsize=None)
def codec_fields(fmt, head_dim: int) -> CodecFields | None:
    """The row layout of a format (a ``kvslim.formats`` format object: formats are built once
    per name and role, so they key this cache) for the kernel, or None: the kernel has no
    decoder for it. Reads the format's declared ``kernel_row``, and refuses one whose row size
    is not what that declaration gives (a layout the declaration does not describe)."""
    if fmt.calibrated:
        return _klt_fields(fmt, head_dim)
    row = fmt.kernel_row(head_dim)
    if row is None:
        return None
    fields = CodecFields(KINDS[row.kind], row.bits, row.block_values, row.block_bytes,
                         _table32(row.table) if row.table else None, row.header_bytes, row.sub_values,
                         row.sub_bits, _table32(row.ladder) if row.ladder else None, row.offset_at)
    if fields.kind in (F32, F16, BF16):
        return fields
    n = fields.block_values
    whole = head_dim % n == 0 and fmt.row_bytes(head_dim) == head_dim // n * fields.block_bytes
    return fields if whole else None


def _klt_fields(fmt, head_dim: int) -> CodecFields | None:
    """A bound klt3 format's rows: the positions of every code in a row and the levels, per KV head,
    from the tables its torch decoder reads (``KLTFormat._tables``); None while unbound."""
    if fmt.cal is None or head_dim != fmt.cal.head_dim:
        return None
    t = fmt._tables("cpu")
    bits = fmt.cal.tables[fmt.name][0].long()                           # (H, D)
    count = 1 << bits                                                   # levels a direction uses
    first = torch.cumsum(count, -1) - count                             # where its levels start
    stride = int(count.sum(-1).max()) + 32                             # the C loads 32 levels from any start
    if stride >= 1 << 15 or fmt.row_bytes(head_dim) - 2 > 512:      # past the plan's 16-bit offset, 9-bit byte
        return None
    levels = torch.zeros(bits.shape[0], stride)
    for h in range(bits.shape[0]):
        levels[h] = torch.cat([t.levels[h, j, :n] for j, n in enumerate(count[h].tolist())] +
                              [torch.zeros(stride - int(count[h].sum()))])
    plan = t.lo_byte | t.shift.long() << 9 | bits << 12 | first << 16
    return CodecFields(KLT, 0, head_dim, fmt.row_bytes(head_dim), header_bytes=2,
                       klt_plan=plan.to(torch.int32).contiguous(), klt_levels=levels.contiguous(), klt_stride=stride)


@lru_cache(maxsize=None)
def _codec(fmt, head_dim: int) -> Codec | None:
    fields = codec_fields(fmt, head_dim)                     # keeps the tables the pointers point at
    return None if fields is None else fields.codec()


def supports(fmt_k, fmt_v, q: torch.Tensor) -> bool:
    """Whether the kernel serves these formats for q (Hkv, S, R, D) (float32, on the CPU)."""
    dim, rows = q.shape[-1], q.shape[-2]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and dim <= MAX_DIM and rows <= MAX_ROWS
            and _codec(fmt_k, dim) is not None and _codec(fmt_v, dim) is not None and _library() is not None)


def decode_state(fmt_k, fmt_v, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 table: torch.Tensor, n_keys: torch.Tensor, variant: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (Hkv, S, R, D) float32, scaled, in K's code domain; pools (Hkv, pages, page_size, row bytes)
    uint8; table (S, P) int32 pages; n_keys (S,) keys each sequence sees (its first n_keys).
    -> m, l (Hkv, S, R, 1) and acc (Hkv, S, R, D), acc in V's code domain, not normalised.
    ``variant``: which build of the kernel (``build.VARIANTS``; the tests run each)."""
    n_kv, n_seq, n_rows, dim = q.shape
    ck, cv = _codec(fmt_k, dim), _codec(fmt_v, dim)
    q, table = q.contiguous(), table.to(torch.int32).contiguous()
    n_keys = n_keys.to(torch.int64).contiguous()
    m = torch.empty(n_kv, n_seq, n_rows, 1)
    l, acc = torch.empty_like(m), torch.empty(n_kv, n_seq, n_rows, dim)
    threads = torch.get_num_threads()
    status = _library(variant).kvslim_paged_decode(
        ctypes.byref(ck), ctypes.byref(cv), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        k_pool.shape[1], k_pool.shape[2], k_pool.shape[3], v_pool.shape[3], table.data_ptr(), table.shape[1],
        n_keys.data_ptr(), n_kv, n_seq, n_rows, dim, SPAN, m.data_ptr(), l.data_ptr(), acc.data_ptr(), threads)
    if status:
        raise ValueError(f"native paged attention refused head_dim {dim} with {n_rows} query rows per head")
    return m, l, acc                                        # (the tables live in codec_fields' cache)
