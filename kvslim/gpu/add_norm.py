"""The residual add and the RMSNorm after it in one Triton launch (vLLM's fused_add_rms_norm).

Each decoder layer adds its mixer's output to the residual stream and normalises the sum for
its MLP: on a GPU, torch launches the add and then its fused norm, 80 launches a decode step in
a 35B-A3B model. ``add_rms_norm`` reads both inputs once and writes the sum (the stream the MLP's
output is added to) and its norm. The torch forms stay the reference (and the path everywhere
else); tests/test_gpu_add_norm.py holds the two together under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, kernels, pdl, pow2, serves


def _kernel():
    return kernels("_add_norm_kernel")                # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_add_norm_kernel", x.device)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta (R, H) with contiguous rows, weight (H,) of any float type (read as float32, as
    ``fused_rms_norm`` takes it, so no cast launches per call) -> (the norm of x + delta times
    weight, x + delta), both in x's type: the sum rounded as torch's add rounds it, the norm
    computed in float32 from that rounded sum and rounded once (as ``F.rms_norm`` does)."""
    if x.dim() != 2 or delta.shape != x.shape or weight.shape != x.shape[1:] \
            or x.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError(f"x and delta (R, H) with contiguous rows and weight (H,) expected, got {tuple(x.shape)} "
                         f"{x.stride()}, {tuple(delta.shape)} {delta.stride()} and {tuple(weight.shape)}")
    rows, hidden = x.shape
    summed, normed = (torch.empty(rows, hidden, device=x.device, dtype=x.dtype) for _ in range(2))
    if rows and hidden:
        block = pow2(hidden)
        _kernel().add_rms_norm[(rows,)](x, delta, weight.contiguous(), summed, normed, hidden, eps, x.stride(0),
                                        delta.stride(0), BLOCK=block, num_warps=min(16, max(1, block // 256)),
                                        **FP_FUSION, **pdl(x.device))
    return normed, summed
