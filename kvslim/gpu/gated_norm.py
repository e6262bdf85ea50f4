"""The DeltaNet layers' gated output norm, rms_norm(x) * weight * silu(z), in one Triton launch.

Each Gated DeltaNet layer normalises every value head of its output and gates it by z, a slice
of the fused input projection's output: 30 times a 35B-A3B decode step. fla-core's fused kernel
(which served it before) takes contiguous rows, so at ``-np`` > 1, and for every prompt, z's
strided rows were copied first (30 copies a step at -np 4); the torch form launches about 6.
``gated_rms_norm`` reads x and z at their own strides and writes the product rounded once. The
torch form (``models.layers.RMSNormGated``) stays the reference and the path everywhere else;
tests/test_gpu_gated_norm.py holds the two together under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, kernels, pdl, pow2, serves

TILE = 2048            # elements a program: whole heads, BLOCK_H of them (16 of 128 columns)


def _kernel():
    return kernels("_gated_norm_kernel")              # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_gated_norm_kernel", x.device)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z (R, H, D) of any float type with contiguous heads (rows and heads at any stride),
    weight (D,) of any float type -> (R, H, D) in z's type: each head of x normalised over its D
    columns, times weight and silu(z), in float32 and rounded once (the torch form rounds the
    norm, then the product)."""
    if x.dim() != 3 or z.shape != x.shape or weight.shape != x.shape[2:] or x.stride(-1) != 1 or z.stride(-1) != 1:
        raise ValueError(f"x and z (R, H, D) with contiguous heads and weight (D,) expected, got {tuple(x.shape)} "
                         f"{x.stride()}, {tuple(z.shape)} {z.stride()} and {tuple(weight.shape)}")
    rows, heads, width = x.shape
    out = torch.empty(rows, heads, width, device=z.device, dtype=z.dtype)
    if out.numel():
        block_d = pow2(width)
        block_h = min(pow2(heads), max(1, TILE // block_d))
        _kernel().gated_rms_norm[(rows, -(-heads // block_h))](
            x, z, weight.contiguous(), out, heads, width, eps, x.stride(0), x.stride(1), z.stride(0), z.stride(1),
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4, **FP_FUSION, **pdl(x.device))
    return out
