"""SwiGLU's activation, silu(gate) * up, in one Triton launch.

A decode step on a GPU applies it 80 times in a 35B-A3B model (the shared expert's MLP and the
routed experts of each layer); the torch form launches silu, the product and, for the experts'
float32 products, a cast back to the activations' type: 2-3 launches each. ``silu_mul`` reads
gate and up where they lie (two halves of one fused projection's output) and writes the
product rounded once to the type asked for. The torch form stays the reference (and the path
everywhere else); tests/test_gpu_swiglu.py holds the two together under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, kernels, serves

BLOCK = 1024            # columns a program


def _kernel():
    return kernels("_swiglu_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_swiglu_kernel", x.device)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up for gate, up (R, I) of any float type whose rows may be strided (the
    halves of a (R, 2I) tensor), computed in float32 -> (R, I) of ``dtype``, rounded once."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"gate and up (R, I) with contiguous rows expected, got {tuple(gate.shape)} "
                         f"{gate.stride()} and {tuple(up.shape)} {up.stride()}")
    rows, width = gate.shape
    out = torch.empty(rows, width, device=gate.device, dtype=dtype)
    if rows and width:
        _kernel().silu_mul[(rows, -(-width // BLOCK))](gate, up, out, width, gate.stride(0), up.stride(0),
                                                       BLOCK=BLOCK, num_warps=4, **FP_FUSION)
    return out
