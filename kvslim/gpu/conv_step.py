"""The DeltaNet layer's short causal conv for a decode step, in one Triton launch.

``causal_conv_step`` (kvslim/models/delta_rule.py, the reference) gathers each sequence's conv
state by slot, concatenates the new input, multiplies, sums, applies silu and scatters the
shifted state back: about 6 launches a layer, 180 a 35B-A3B decode step. ``conv_step`` reads
each slot's state where the cache keeps it and updates it in place, as the attention kernels
read pages by their table (a CUDA graph replays it for any slots). tests/test_gpu_conv_step.py
holds it to the torch form under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, kernels, pdl, pow2, serves

BLOCK_C = 128           # channels a program


def _kernel():
    return kernels("_conv_step_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_conv_step_kernel", x.device)


def conv_step(x: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (B, C) the new inputs (rows may be strided); state (S, C, K - 1) every slot's last K - 1
    inputs, updated in place for the B distinct ``slots``; weight (C, K) -> silu(conv) (B, C) of
    ``dtype`` (float32 sums, rounded once), as ``causal_conv_step`` gives it."""
    n_slots, channels, held = state.shape
    if x.dim() != 2 or x.shape[1] != channels or x.stride(1) != 1 or weight.shape != (channels, held + 1) \
            or slots.shape != (x.shape[0],) or not state.is_contiguous() or held < 1:
        raise ValueError(f"x (B, C) with contiguous rows, state (S, C, K-1), one slot per row and weight (C, K) "
                         f"expected, got x {tuple(x.shape)}, state {tuple(state.shape)}, slots {tuple(slots.shape)}, "
                         f"weight {tuple(weight.shape)}")
    out = torch.empty(x.shape[0], channels, device=x.device, dtype=dtype)
    if x.shape[0]:
        _kernel().conv_step[(x.shape[0], -(-channels // BLOCK_C))](
            x, state, slots.contiguous(), weight.contiguous(), out, channels, x.stride(0), channels * held,
            K=held + 1, BLOCK_C=BLOCK_C, BLOCK_K=pow2(held + 1), num_warps=4, **FP_FUSION, **pdl(x.device))
    return out
