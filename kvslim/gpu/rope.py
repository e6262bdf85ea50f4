"""An attention layer's q/k norm and rotary embedding, one Triton launch per tensor.

The torch forms (``layers.RMSNorm`` on q and k, then ``layers.apply_rope``: slicing, a negation,
two concatenations, two products and a sum) launch about seven kernels for each of q and k in
a decode step. ``norm_rope`` reads each head where it lies (a slice of the fused projection's
output), normalises it (no norm, weight w, or 1 + w) and rotates its first rot_dim dims in one
launch, float32 inside, rounded once. tests/test_gpu_rope.py holds it to the torch forms under
Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, kernels, pow2, serves


def _kernel():
    return kernels("_rope_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_rope_kernel", x.device)


def norm_rope(x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) any float type, each head's D values contiguous; ``norm`` an RMSNorm over D
    (``layers.RMSNorm``) or None; cos, sin (N, rot_dim) -> (N, H, D) of x's type: the head
    normalised, then its first rot_dim dims rotated (half-split, as ``apply_rope``)."""
    n, heads, dim = x.shape
    rot = cos.shape[-1]
    if x.stride(-1) != 1 or cos.shape != (n, rot) or sin.shape != cos.shape or rot > dim or rot % 2 \
            or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"x (N, H, D) with contiguous heads and cos, sin (N, rot <= D, even) expected, got "
                         f"x {tuple(x.shape)} {x.stride()}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    out = torch.empty(n, heads, dim, device=x.device, dtype=x.dtype)
    kind = 0 if norm is None else 2 if norm.zero_centered else 1
    weight = x if norm is None else norm.weight                     # a stand-in pointer without a norm
    if n:
        _kernel().norm_rope[(n, heads)](x, weight, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                                        norm.eps if norm is not None else 0.0, D=dim, ROT=rot, NORM=kind,
                                        BLOCK_D=pow2(dim), num_warps=1 if dim <= 128 else 2, **FP_FUSION)
    return out
