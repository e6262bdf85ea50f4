"""An attention layer's q/k norm and rotary embedding, one Triton launch for both.

The torch forms (``layers.RMSNorm`` on q and k, then ``layers.apply_rope``: slicing, a negation,
two concatenations, two products and a sum) launch about seven kernels for each of q and k in
a decode step. ``norm_rope`` reads each head where it lies (a slice of the fused projection's
output), normalises it (no norm, weight w, or 1 + w) and rotates its first rot_dim dims in one
launch, float32 inside, rounded once; ``norm_rope_qk`` does q's and k's heads in one launch.
tests/test_gpu_rope.py holds them to the torch forms under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, kernels, pdl, pow2, serves


def _kernel():
    return kernels("_rope_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_rope_kernel", x.device)


def norm_rope(x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) any float type, each head's D values contiguous; ``norm`` an RMSNorm over D
    (``layers.RMSNorm``) or None; cos, sin (N, rot_dim) -> (N, H, D) of x's type: the head
    normalised, then its first rot_dim dims rotated (half-split, as ``apply_rope``)."""
    return _launch([(x, norm)], cos, sin)[0]


def tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (N, 2 F) of ``dtype`` for positions (N,) and inv_freq (F,) float32 on their
    device, in one launch (``layers.Rope.tables``' torch form, the reference, launches seven):
    the angle position * inv_freq in float32, its cos and sin rounded once, each twice."""
    if positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 \
            or inv_freq.device != positions.device:
        raise ValueError(f"positions (N,) and inv_freq (F,) float32 on one device expected, got "
                         f"{tuple(positions.shape)} and {tuple(inv_freq.shape)} {inv_freq.dtype}")
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(n, 2 * half, device=positions.device, dtype=dtype)
    sin = torch.empty_like(cos)
    if n:
        block_n = max(1, min(16, 2048 // pow2(half)))
        _kernel().rope_tables[(-(-n // block_n),)](positions.contiguous(), inv_freq.contiguous(), cos, sin, n,
                                                   HALF=half, BLOCK_N=block_n, BLOCK_F=pow2(half), num_warps=1,
                                                   **FP_FUSION, **pdl(cos.device))
    return cos, sin


def pairs(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm) -> bool:
    """Whether ``norm_rope_qk`` takes q and k in one launch: one type and head size, norms of
    one kind (both none, or both plain or zero-centred, with one eps and weight type)."""
    if q.dtype != k.dtype or q.shape[-1] != k.shape[-1] or (q_norm is None) != (k_norm is None):
        return False
    return q_norm is None or (q_norm.zero_centered == k_norm.zero_centered and q_norm.eps == k_norm.eps
                              and q_norm.weight.dtype == k_norm.weight.dtype)


def norm_rope_qk(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_rope`` of q and of k, each with its own norm, in one launch (``pairs`` says when)."""
    if not pairs(q, k, q_norm, k_norm):
        raise ValueError(f"q and k of one type and head size with norms of one kind expected, got q "
                         f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}")
    return _launch([(q, q_norm), (k, k_norm)], cos, sin)


def _launch(tensors: list, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """One ``norm_rope`` launch over the heads of one or two (x, norm) pairs (a second: k's,
    as the kernel's k_ arguments)."""
    outs = []
    for x, _ in tensors:
        n, heads, dim = x.shape
        rot = cos.shape[-1]
        if x.stride(-1) != 1 or cos.shape != (n, rot) or sin.shape != cos.shape or rot > dim or rot % 2 \
                or cos.stride() != sin.stride() or cos.stride(-1) != 1:
            raise ValueError(f"x (N, H, D) with contiguous heads and cos, sin (N, rot <= D, even) expected, got "
                             f"x {tuple(x.shape)} {x.stride()}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
        outs.append(torch.empty(n, heads, dim, device=x.device, dtype=x.dtype))
    (x, norm), (k, k_norm) = tensors[0], tensors[-1]
    kind = 0 if norm is None else 2 if norm.zero_centered else 1
    weights = [x if m is None else m.weight for m in (norm, k_norm)]     # a stand-in pointer without a norm
    n, heads, dim = x.shape
    k_heads = k.shape[1] if len(tensors) > 1 else 0
    if n:
        _kernel().norm_rope[(n, heads + k_heads)](
            x, weights[0], cos, sin, outs[0], heads, x.stride(0), x.stride(1), cos.stride(0),
            norm.eps if norm is not None else 0.0, k, weights[1], outs[-1], k_heads, k.stride(0), k.stride(1),
            D=dim, ROT=cos.shape[-1], NORM=kind, BLOCK_D=pow2(dim), num_warps=1 if dim <= 128 else 2, **FP_FUSION,
            **pdl(x.device))
    return outs
