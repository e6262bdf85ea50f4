"""A prompt's tokens through the gated delta rule in C (``delta_rule.c``), beside the torch forms.

Same contract as ``kvslim.models.delta_rule.chunk_gated_delta_rule`` (its reference, held to it
by tests/test_native_delta_rule.py): the token-by-token recurrence with one thread per value
head, which on the CPU costs a fraction of the chunked form's ~40 small torch ops per chunk.
Inference only: it keeps no autograd graph, so ``kvslim.models.delta_rule.chunk_rule`` leaves
inputs that need gradients to torch.
"""
from __future__ import annotations

import ctypes

import torch

from . import build

SOURCE = "delta_rule.c"
MAX_DIM = 512                       # delta_rule.c's per-head scratch


def _library(variant: str | None = None):
    lib = build.library(SOURCE, variant)
    if lib is not None and lib.kvslim_gated_delta_prefill.argtypes is None:
        fn = lib.kvslim_gated_delta_prefill
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    return lib


@build.traced_as_constant      # traced (chunk_rule in a compiled decode step): decided once
def available() -> bool:
    return _library() is not None


def serves(device: torch.device) -> bool:
    """Whether the C recurrence runs this device's DeltaNet prefill (the CPU, with a compiler)."""
    return device.type == "cpu" and available()


def chunk(q, k, v, g, beta, state, variant: str | None = None):
    """q, k (B, T, H, dk) L2-normalised, repeated to the value heads; v (B, T, H, dv); g, beta
    (B, T, H); state (B, H, dk, dv). Returns o (B, T, H, dv) and the final state, float32 (the
    input state is not modified). ``variant``: a build of ``build.VARIANTS`` (tests)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    if max(dk, dv) > MAX_DIM:
        raise ValueError(f"gated delta rule: head dims {dk}/{dv} exceed the C kernel's {MAX_DIM}")
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    final = state.float().clone().contiguous()
    out = torch.empty(b, t, h, dv, dtype=torch.float32, device=v.device)
    lib = _library(variant)
    for i in range(b):
        lib.kvslim_gated_delta_prefill(q[i].data_ptr(), k[i].data_ptr(), v[i].data_ptr(), g[i].data_ptr(),
                                       beta[i].data_ptr(), final[i].data_ptr(), out[i].data_ptr(), t, h, dk, dv,
                                       torch.get_num_threads())
    return out, final
