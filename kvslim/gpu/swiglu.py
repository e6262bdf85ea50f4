"""SwiGLU's activation, silu(gate) * up, and gated attention's output gate, x * sigmoid(gate),
in one Triton launch each.

A decode step on a GPU applies it 80 times in a 35B-A3B model (the shared expert's MLP and the
routed experts of each layer); the torch form launches silu, the product and, for the experts'
float32 products, a cast back to the activations' type: 2-3 launches each. ``silu_mul`` reads
gate and up where they lie (two halves of one fused projection's output) and writes the
product rounded once to the type asked for. A gated attention layer's output (Qwen3.5/3.6, 10
a 35B-A3B step) was cast, its gate's strided columns copied, the sigmoid and the product
launched: ``sigmoid_mul`` is one launch, the same kernel with the other activation. The torch
forms stay the reference (and the path everywhere else); tests/test_gpu_swiglu.py holds the
two together under Triton's interpreter.
"""
from __future__ import annotations

import torch

from .. import gpu                      # gpu.TRITON read at each call: benchmarks flip it in-process
from . import FP_FUSION, kernels, pdl, serves

BLOCK = 1024            # columns a program


def _kernel():
    return kernels("_swiglu_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_swiglu_kernel", x.device)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up for gate, up (R, I) of any float type whose rows may be strided (the
    halves of a (R, 2I) tensor), computed in float32 -> (R, I) of ``dtype``, rounded once."""
    return _act_mul(gate, up, dtype, "silu")


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * sigmoid(gate), gated attention's output gate, for gate, x (R, H, D) of any float type
    whose rows and heads may be strided (the gate's columns of the query projection), computed
    in float32 -> (R, H, D) of ``dtype``, rounded once: the torch form casts x, then launches
    the sigmoid and the product (and copies the strided gate), rounding three times."""
    return _act_mul(gate, x, dtype, "sigmoid")


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention's output: x (R, H, D) float32 times sigmoid(gate), in the gate's type (the
    layer's): ``sigmoid_mul``'s one launch where the kernels run here, else the torch form (x
    cast to that type first, the sigmoid and the product in it)."""
    if gpu.TRITON and runs_on(x) and gate.dim() == x.dim() == 3:
        return sigmoid_mul(gate, x, gate.dtype)
    return x.to(gate.dtype) * torch.sigmoid(gate)


def _act_mul(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype, act: str) -> torch.Tensor:
    if gate.shape != up.shape or gate.dim() not in (2, 3) or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"gate and up (R, I) or (R, H, D) with contiguous rows expected, got {tuple(gate.shape)} "
                         f"{gate.stride()} and {tuple(up.shape)} {up.stride()}")
    shape = gate.shape
    if gate.dim() == 2:                                   # (R, I): one head
        gate, up = gate[:, None], up[:, None]
    rows, heads, width = gate.shape
    out = torch.empty(rows, heads, width, device=gate.device, dtype=dtype)
    if out.numel():
        _kernel().act_mul[(rows, heads, -(-width // BLOCK))](
            gate, up, out, heads, width, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), ACT=act,
            BLOCK=BLOCK, num_warps=4, **FP_FUSION, **pdl(gate.device))
    return out.view(shape)
