"""K/V rows into a format's packed bytes in C (``kv_encode.c``), beside the formats' torch encoders.

A format reaches C through its declared ``kernel_encoder`` (kvslim/formats), translated here to
``kv_encode.c``'s ``enc_t``: C never guesses a layout. Two users: the C decode step
(``kvslim/engine/native_step.py`` puts each layer's encoders in its description) and the
cache's prompt path on the CPU (``RowEncoder``: a prompt chunk's K/V rows in one call, where
the torch encoder of iq4_nl runs its 16 candidate scales as (rows, 16, 32) tensors: a prompt with an
iq4_nl cache ran at a sixth of q8_0's speed on the bundled model). The torch
encoders stay the reference: tests/test_native_step.py compares bytes and overflow flags.
A calibrated format (klt3) declares no encoder: its enc_t carries the bound calibration's per-KV-head
tables (``_klt_encoder``; tests/test_native_klt.py holds it to the torch encoder).

The same file's Walsh-Hadamard butterfly serves ``kvslim.formats.rotation.hadamard_blocks`` on
the CPU (``hadamard_rows``): rotated ggml and nl formats pass every prompt's K and V rows,
queries and attention outputs through it, and the torch butterfly (the reference) makes 3 ops
and a new tensor per round, ~1 ms a call on a 512-token chunk, 15% of a q8_0 prompt chunk at
depth 0 on the bundled model. The C loop does the same float32 sums and differences in the
same order, so the bits agree (tests/test_formats_rotated.py).
"""
from __future__ import annotations

import ctypes

import torch

from . import build

SOURCE = "kv_encode.c"
ENC_MAX_DIM = 512                        # kv_encode.c's row buffer
(ENC_FLOAT, ENC_Q8_0, ENC_Q4_0, ENC_TURBO, ENC_GRID, ENC_GRID_SUB, ENC_IQ4_NL, ENC_Q4_1, ENC_Q5_0, ENC_Q5_1,
 ENC_KLT) = range(11)
ENC_KINDS = {"float": ENC_FLOAT, "q8_0": ENC_Q8_0, "q4_0": ENC_Q4_0, "turbo": ENC_TURBO, "grid": ENC_GRID,
             "grid_sub": ENC_GRID_SUB, "iq4_nl": ENC_IQ4_NL, "q4_1": ENC_Q4_1, "q5_0": ENC_Q5_0, "q5_1": ENC_Q5_1}
# ENC_KLT is not a declared kernel_encoder kind: a calibrated format's tables come from its calibration
# (``_klt_encoder``), per KV head.
ENC_SUB_VALUES = 16                      # kv_encode.c's GRID_SUB: values per rung of the nls rows
ENC_MAX_TRIES = 32                       # kv_encode.c's GRID_MAX_TRIES: a grid's candidate scales
ENC_KLT_MIDS = 255                       # kv_encode.c's KLT_MIDS: grid midpoints per klt direction
FLOAT_KINDS = {"f32": 0, "f16": 1, "bf16": 2}
P, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class Unsupported(Exception):
    """What the C code does not implement (the message says what)."""


class Enc(ctypes.Structure):
    _fields_ = [("kind", I32), ("float_type", I32), ("rot", I32), ("bits", I32), ("hadamard", I32),
                ("rot_m", P), ("boundaries", P), ("centroids", P), ("limit", ctypes.c_float),
                ("block", I32), ("n_tries", I32), ("tries", P), ("ladder", P),
                ("klt_heads", I32), ("klt_basis", P), ("klt_synthesis", P),
                ("klt_mean", P), ("klt_spread", P), ("klt_mids", P), ("klt_bits", P)]


class Keep:
    """Tensors and structs the C side points at: alive as long as their holder."""

    def __init__(self):
        self.items = []

    def __call__(self, obj):
        self.items.append(obj)
        return obj

    def ptr(self, t: torch.Tensor | None) -> int | None:
        """A float32 copy's address (norms, biases, tables: small), or the tensor's own if it is one."""
        if t is None:
            return None
        return self(t.detach().float().contiguous()).data_ptr()


def _library(variant: str | None = None):
    lib = build.library(SOURCE, variant)
    if lib is not None and lib.kvslim_encode_rows.argtypes is None:
        lib.kvslim_encode_rows.restype = ctypes.c_int
        lib.kvslim_encode_rows.argtypes = [ctypes.POINTER(Enc), P, I64, ctypes.c_int, I64, P, P, ctypes.c_int]
        lib.kvslim_hadamard_rows.restype = ctypes.c_int
        lib.kvslim_hadamard_rows.argtypes = [ctypes.c_int, P, P, I64, ctypes.c_int]
        lib.kvslim_bucketize.restype = ctypes.c_int
        lib.kvslim_bucketize.argtypes = [P, I64, P, ctypes.c_int, P, ctypes.c_int]
        lib.kvslim_code_domain_rows.restype = ctypes.c_int
        lib.kvslim_code_domain_rows.argtypes = [ctypes.POINTER(Enc), P, I64, ctypes.c_int, ctypes.c_int, P]
    return lib


@build.traced_as_constant      # traced: decided once, not a graph break on ctypes
def available() -> bool:
    return _library() is not None


def serves_hadamard(x: torch.Tensor) -> bool:
    """Whether ``hadamard_rows`` takes x: CPU tensors outside a traced graph and outside autograd
    (the torch butterfly serves the rest)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() \
        and not (x.requires_grad and torch.is_grad_enabled()) and available()


def serves_bucketize(v: torch.Tensor, bounds: torch.Tensor) -> bool:
    """Whether ``bucketize`` takes these: as ``serves_hadamard``, float32 values and 1-d bounds."""
    return v.dtype == bounds.dtype == torch.float32 and bounds.dim() == 1 and bounds.device.type == "cpu" \
        and serves_hadamard(v)


def bucketize(v: torch.Tensor, bounds: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """torch.bucketize(v, bounds) for ascending float32 bounds: int64 codes of v's shape."""
    v, bounds = v.contiguous(), bounds.contiguous()
    out = torch.empty(v.shape, dtype=torch.int64)
    _library(variant).kvslim_bucketize(v.data_ptr(), v.numel(), bounds.data_ptr(), bounds.numel(), out.data_ptr(),
                                       torch.get_num_threads())
    return out


def hadamard_rows(x: torch.Tensor, n: int, variant: str | None = None) -> torch.Tensor:
    """H / sqrt(n) on every run of ``n`` values along the last dimension -> float32, x's shape."""
    y = x.float().contiguous()
    out = torch.empty_like(y)
    _library(variant).kvslim_hadamard_rows(n, y.data_ptr(), out.data_ptr(), y.numel() // n, torch.get_num_threads())
    return out


def encoder(fmt, head_dim: int, keep: Keep, spec=None) -> Enc:
    """The C encoder of a K/V format: its declared ``kernel_encoder`` (``spec``, when the caller
    has read it already), as kv_encode.c's enc_t; raises Unsupported where there is none."""
    if head_dim > ENC_MAX_DIM:
        raise Unsupported(f"head_dim {head_dim} (the C encoders' limit is {ENC_MAX_DIM})")
    if getattr(fmt, "calibrated", False):
        return _klt_encoder(fmt, head_dim, keep)
    spec = spec or fmt.kernel_encoder(head_dim)
    if spec is None or spec.kind not in ENC_KINDS or spec.sub_values not in (0, ENC_SUB_VALUES):
        raise Unsupported(f"K/V format {fmt.name} (no C encoder)")
    tries = spec.tries
    if tries is not None and len(tries) > ENC_MAX_TRIES:
        raise Unsupported(f"K/V format {fmt.name} ({len(tries)} scale candidates; the C search takes {ENC_MAX_TRIES})")
    return Enc(ENC_KINDS[spec.kind], FLOAT_KINDS.get(spec.float_type, 0), spec.rot, spec.bits, int(spec.hadamard),
               keep.ptr(spec.rot_matrix), keep.ptr(spec.boundaries), keep.ptr(spec.centroids), spec.limit,
               spec.block, 0 if tries is None else len(tries), keep.ptr(tries), keep.ptr(spec.ladder))


def _klt_encoder(fmt, head_dim: int, keep: Keep) -> Enc:
    """A bound klt format's enc_t: the per-head tables its torch encoder reads (``KLTFormat._tables``;
    the +inf midpoints past a direction's levels stay: the C search never reads them)."""
    if fmt.cal is None:
        raise Unsupported(f"K/V format {fmt.name} before it is bound to a calibration")
    fmt.check_head_dim(head_dim)
    t = fmt._tables("cpu")
    if t.mids.shape[-1] != ENC_KLT_MIDS:
        raise Unsupported(f"K/V format {fmt.name} with {t.mids.shape[-1] + 1} levels a direction (C takes 256)")
    bits = keep(fmt.cal.tables[fmt.name][0].to(torch.uint8).contiguous())
    return Enc(kind=ENC_KLT, klt_heads=fmt.cal.n_heads, klt_basis=keep.ptr(t.basis),
               klt_synthesis=keep.ptr(t.synthesis), klt_mean=keep.ptr(t.mean), klt_spread=keep.ptr(t.spread),
               klt_mids=keep.ptr(t.mids), klt_bits=bits.data_ptr())


# The kinds whose C encoder is faster than torch's on a prompt chunk (512 tokens x 2 heads x 128,
# 2 threads, torch -> C: q8_0 0.81 -> 0.40 ms, q4_0 0.73 -> 0.29, q4_1/q5_x 0.7-1.6 -> 0.2,
# iq4_nl 55 -> 1.6; nl4s 78 -> 3.2). The ggml kinds and floats write the torch encoders' bytes;
# the nl grids' C search sums in another order, so a near-tie between two scale candidates can
# go the other way (0.000-0.014% of bytes measured; tests/test_native_step.py allows 1% and
# holds the error equal), as the native decode step's appended rows already did. Turbo stays
# on torch: its matmul rotation and the C bucketize (formats.base.bucketize) take 0.64 ms
# where the C encoder's per-row rotation takes 2.6.
PROMPT_KINDS = ("float", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "grid", "grid_sub")
# A bound klt3 too (not a declared kind: ``_klt_encoder``): 512 tokens x 2 heads x 128, 2 threads,
# torch 2.2 ms -> C 0.8 ms; its projection sums in another order than torch's matmul, so a near-tie
# (a code on a midpoint, the row scale on an fp16 rounding edge) can go the other way
# (tests/test_native_klt.py).


class RowEncoder:
    """``fmt``'s C encoder for rows of ``head_dim``: (T, ..., head_dim) -> (codes (T, ..., row
    bytes), per-token flags (T,)), as ``fmt.encode_flagged`` returns them. A klt format codes each
    KV head in its own basis: rows (T, ..., H, head_dim). ``variant``: a build of kv_encode.c
    (build.VARIANTS; the tests hold each to the torch encoder)."""

    def __init__(self, fmt, head_dim: int, spec=None, variant: str | None = None):
        self.keep = Keep()
        self.enc = self.keep(encoder(fmt, head_dim, self.keep, spec))
        self.head_dim, self.row_bytes = head_dim, fmt.row_bytes(head_dim)
        self.heads = self.enc.klt_heads if self.enc.kind == ENC_KLT else None    # None: any layout
        self.lib = _library(variant)

    @classmethod
    def for_prompts(cls, fmt, head_dim: int) -> "RowEncoder | None":
        """The encoder the cache's CPU prompt path takes for ``fmt``, or None (no compiler, not one
        of PROMPT_KINDS, or a calibrated format not bound to a calibration for ``head_dim``)."""
        if _library() is None or head_dim > ENC_MAX_DIM:
            return None
        if getattr(fmt, "calibrated", False):
            return cls(fmt, head_dim) if fmt.cal is not None and fmt.cal.head_dim == head_dim else None
        spec = fmt.kernel_encoder(head_dim)
        if spec is None or spec.kind not in PROMPT_KINDS:
            return None
        return cls(fmt, head_dim, spec)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as float32 rows (n, head_dim); klt's row r is then of KV head r % H (kv_encode.c's row_head)."""
        if self.heads is not None and (x.dim() < 2 or x.shape[-2] != self.heads):
            raise ValueError(f"klt rows are (..., {self.heads} heads, {self.head_dim}); got {tuple(x.shape)}")
        return x.float().reshape(-1, self.head_dim).contiguous()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows(x)
        out = torch.empty(rows.shape[0], self.row_bytes, dtype=torch.uint8)
        flags = torch.empty(rows.shape[0], dtype=torch.uint8)
        self.lib.kvslim_encode_rows(ctypes.byref(self.enc), rows.data_ptr(), rows.shape[0], self.head_dim,
                                    self.row_bytes, out.data_ptr(), flags.data_ptr(), torch.get_num_threads())
        return out.reshape(*x.shape[:-1], self.row_bytes), flags.reshape(x.shape[0], -1).bool().any(dim=1)

    def code_domain(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """kv_encode.c's to_code_domain_head (inverse: from_code_domain_head) on rows x (..., head_dim),
        as the decode step runs them -> float32 of x's shape: for the parity tests."""
        rows = self._rows(x)
        out = torch.empty_like(rows)
        self.lib.kvslim_code_domain_rows(ctypes.byref(self.enc), rows.data_ptr(), rows.shape[0], self.head_dim,
                                         int(inverse), out.data_ptr())
        return out.reshape(x.shape)


def encode_rows(fmt, x: torch.Tensor, variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The C encoder on rows x (n, head_dim) (klt: (n, H, head_dim)) -> (codes (n, ..., row_bytes),
    flags (n,) bool)."""
    return RowEncoder(fmt, x.shape[-1], variant=variant)(x)
