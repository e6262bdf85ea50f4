"""llama.cpp's block Walsh-Hadamard rotation in C (``kv_encode.c``'s butterfly), for the CPU.

Rotated ggml and nl formats pass every prompt's K and V rows, queries and attention outputs
through ``kvslim.formats.rotation.hadamard_blocks``; its torch butterfly (the reference) makes
3 ops and a new tensor per round, ~1 ms a call on a 512-token chunk, 15% of a q8_0 prompt
chunk at depth 0 on the bundled model. The C loop does the same float32 sums and differences
in the same order, so the bits agree (tests/test_formats_rotated.py).
"""
from __future__ import annotations

import ctypes

import torch

from . import build

SOURCE = "kv_encode.c"


def _library(variant: str | None = None):
    lib = build.library(SOURCE, variant)
    if lib is not None and lib.kvslim_hadamard_rows.argtypes is None:
        fn = lib.kvslim_hadamard_rows
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


@torch._dynamo.assume_constant_result
def available() -> bool:
    return _library() is not None


def serves(x: torch.Tensor) -> bool:
    """CPU tensors outside a traced graph and outside autograd: the torch butterfly serves the rest."""
    return (x.device.type == "cpu" and not torch.compiler.is_compiling()
            and not (x.requires_grad and torch.is_grad_enabled()) and available())


def hadamard_rows(x: torch.Tensor, n: int, variant: str | None = None) -> torch.Tensor:
    """H / sqrt(n) on every run of ``n`` values along the last dimension -> float32, x's shape."""
    y = x.float().contiguous()
    out = torch.empty_like(y)
    _library(variant).kvslim_hadamard_rows(n, y.data_ptr(), out.data_ptr(), y.numel() // n, torch.get_num_threads())
    return out
