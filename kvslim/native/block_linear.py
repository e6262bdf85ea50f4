"""The fused block GEMV of ``block_linear.c``: y = x @ W.T for W kept as ggml blocks.

Decode multiplies one (or a few) activation rows by every weight matrix; dequantizing
W's blocks in torch writes each block out as float32 and reads it back, which is most of
a quantized decode step (``kvslim/weights/matmul.py``). The C kernel reads each block
once and unpacks it in registers.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

from . import build

SOURCE = "block_linear.c"
TYPE_CODES = {"q4_0": 4, "q8_0": 8, "f16": 16, "bf16": 17, "q4_1": 41, "iq4_nl": 44, "q5_0": 50, "q5_1": 51,
              "q2_k": 102, "q3_k": 103, "q4_k": 104, "q5_k": 105, "q6_k": 106,
              "iq4_xs": 144, "iq1_s": 181, "iq1_m": 182, "iq2_xxs": 121, "iq2_xs": 122, "iq2_s": 123, "iq3_xxs": 131,
              "iq3_s": 133, "mxfp4": 204, "nvfp4": 240}     # the types block_linear.c implements
QK = 32                                      # its rows are whole blocks of 32 values
MAX_ROWS = 8                                 # more activation rows: torch's matmul over decoded steps wins


def _library(variant: str | None = None):
    lib = build.library(SOURCE, variant)
    if lib is not None and lib.kvslim_block_linear.argtypes is None:
        lib.kvslim_block_linear.restype = ctypes.c_int
        lib.kvslim_block_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        lib.kvslim_q8_activations.restype = ctypes.c_int
        lib.kvslim_q8_activations.argtypes = [ctypes.c_int]
        lib.kvslim_dequantize_rows.restype = ctypes.c_int
        lib.kvslim_dequantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                               ctypes.c_int64, ctypes.c_int]
    return lib


@build.traced_as_constant      # traced: decided once, not a graph break on ctypes
def available() -> bool:
    return _library() is not None


def q8_activations(wtype_name: str, variant: str | None = None) -> bool:
    """Whether decode's GEMV over ``wtype_name`` rounds the activations to 8 bits (a scale per 32
    values) and multiplies in integers, as llama.cpp's CPU backend does: the K-quants, Q4_0,
    IQ4_NL and IQ4_XS, where the build has AVX2 (``block_linear_q8.c``). 1.2-1.9x faster for one row, the outputs
    within ~1% of the float ones (``weights/activations.py`` is its reference).
    ``KVSLIM_Q8_ACTIVATIONS=0`` keeps float activations everywhere."""
    return _q8_activations(wtype_name, variant or build.default_variant(), os.environ.get("KVSLIM_Q8_ACTIVATIONS", "1"))


@lru_cache(maxsize=None)
def _q8_activations(wtype_name: str, variant: str, switch: str) -> bool:
    lib = _library(variant)
    return switch != "0" and lib is not None and bool(lib.kvslim_q8_activations(TYPE_CODES[wtype_name]))


def supports(wtype_name: str, x: torch.Tensor) -> bool:
    """Whether ``block_linear`` serves this weight type and activation (float32 CPU, few rows)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (wtype_name in TYPE_CODES and x.device.type == "cpu" and x.dtype == torch.float32
            and 0 < rows <= MAX_ROWS and x.shape[-1] % QK == 0 and available())


# f16/bf16: torch's cast is faster. The others: 4-12x torch's decoders on 128 rows of 2048 (the K-quants,
# IQ4_XS, the grid i-quants, MXFP4)
DEQUANTIZED = {"q4_0", "q8_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs",
               "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "mxfp4", "nvfp4"}


def dequantizes(wtype_name: str, blocks: torch.Tensor) -> bool:
    """Whether ``dequantize_rows`` serves these blocks (CPU, a block type it beats torch on)."""
    return wtype_name in DEQUANTIZED and blocks.device.type == "cpu" and available()


# ``block_linear`` as one opaque op, so that a compiled decode step calls the kernel instead
# of breaking its graph at the ctypes call. Registered with torch.library.Library rather than
# the custom_op decorator: a decode step makes ~60 of these calls, and the decorator's
# wrapper cost 19 us a call against 12 us here (the kernel itself: 3 us on a small matrix).
_OPS = torch.library.Library("kvslim", "FRAGMENT")
_OPS.define("block_linear(Tensor x, Tensor blocks, str wtype_name) -> Tensor")
_OPS.impl("block_linear", lambda x, blocks, wtype_name: block_linear(x, blocks, wtype_name), "CPU")


@torch.library.register_fake("kvslim::block_linear")
def _(x, blocks, wtype_name):
    return x.new_empty(x.shape[0], blocks.shape[0])


def block_linear(x: torch.Tensor, blocks: torch.Tensor, wtype_name: str, variant: str | None = None,
                 q8: bool | None = None) -> torch.Tensor:
    """x (m, k) float32 @ W.T for W (n, row_bytes) uint8 blocks of ``wtype_name`` -> (m, n).
    ``variant``: a build of ``build.VARIANTS`` (tests: "avx2" runs the 8-wide loops on a CPU with
    AVX-512, "portable" the plain C). ``q8``: round x to 8 bits first where the build can
    (default: ``q8_activations``)."""
    if q8 is None:
        q8 = q8_activations(wtype_name, variant)
    x = x.contiguous()
    blocks = blocks.contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    status = _library(variant).kvslim_block_linear(TYPE_CODES[wtype_name], x.data_ptr(), blocks.data_ptr(), y.data_ptr(),
                                            m, n, k, torch.get_num_threads(), int(q8))
    if status:
        raise ValueError(f"native block_linear refused {wtype_name} with {k} input features")
    return y


def dequantize_rows(blocks: torch.Tensor, wtype_name: str, cols: int, out: torch.Tensor | None = None,
                    variant: str | None = None) -> torch.Tensor:
    """W's rows as float32: blocks (n, row_bytes) uint8 of ``wtype_name`` -> (n, cols), the values
    ``gguf.quants.dequantize`` gives, into ``out`` (float32, contiguous) when given. The prompt's
    GEMM decodes a step of rows at a time through it (``weights/matmul.py``)."""
    blocks = blocks.contiguous()
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(n, cols, dtype=torch.float32)
    if out.shape != (n, cols) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out: float32 ({n}, {cols}) contiguous expected, got {out.dtype} {tuple(out.shape)}")
    status = _library(variant).kvslim_dequantize_rows(TYPE_CODES[wtype_name], blocks.data_ptr(), out.data_ptr(),
                                                      n, cols, torch.get_num_threads())
    if status:
        raise ValueError(f"native dequantize_rows refused {wtype_name} with {cols} columns")
    return out
