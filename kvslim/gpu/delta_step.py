"""A Gated DeltaNet layer's decode step in one Triton launch, on the slots' states in place.

``gated_delta_decode`` (kvslim/models/delta_rule.py, the reference) normalises q and k, repeats
them to the value heads, computes the gates and steps a (B, Hv, dk, dv) state. fla-core's fused
recurrent kernel (gpu/delta_rule.decode) does that in one launch, but takes the states as one
tensor per batch: the layer gathered its slots' states from the cache, fla-core wrote the final
state to a new tensor, which was copied back and scattered into the cache (about 5 launches
and 5 extra reads and writes of every state, 2 MB a sequence per layer for Qwen3.6-35B-A3B).
``delta_step`` reads each sequence's state where the cache keeps it, by its slot id, as the conv
step and the attention kernels do (a CUDA graph replays it for any slots). tests/test_gpu_delta_step.py
holds it to the torch form under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, counters, kernels, pdl, pow2, serves

# Whether the step's launch also applies the layer's gated output norm (``norm``; the last
# program of each head): 30 launches fewer a 35B-A3B decode step. Untimed (benchmarks/gpu_model.py
# --no-sums-in-gemv turns it off with the GEMVs' last-program sums).
NORM_IN_STEP = True
# Whether the step's launch also takes the layer's short causal conv (``conv``): each program
# convolves the channels it reads, the conv state updated by their owners (q's and k's by the
# key head's last program): 30 launches fewer a 35B-A3B decode step. Untimed
# (benchmarks/gpu_model.py --no-sums-in-gemv turns it off with the other last-program folds).
CONV_IN_STEP = True
BLOCK_V = 8             # value columns a program: fla-core's choice for its recurrent step (a
                        # (dk, 8) float32 tile in one warp), so a batch of one fills the SMs


def _kernel():
    return kernels("_delta_step_kernel")                 # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_delta_step_kernel", x.device)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (B, heads, dim) or (B, heads), each row's values contiguous (rows at any stride), as the
    kernel reads it: t itself when it is so, else a contiguous copy."""
    inner = (t.shape[2], 1) if t.dim() == 3 else (1,)
    return t if t.stride()[1:] == inner else t.contiguous()


def delta_step(q, k, v, a, b, A_log, dt_bias, state, slots, out=None, norm=None, conv=None) -> torch.Tensor:
    """``gated_delta_decode``'s step for B sequences: q, k (B, Hk, dk) as convolved; v (B, Hv, dv);
    a, b (B, Hv) the gates' pre-activations; A_log, dt_bias (Hv,); state (S, Hv, dk, dv) float32,
    every slot's, updated in place for the B distinct ``slots``. Rows may be strided (the columns
    of a fused projection's output). Returns o (B, Hv, dv): ``out`` when given (its type), else
    in v's type; float32 sums rounded once. ``norm`` (z (B, Hv, dv), weight (dv,), eps): the
    layer's gated output norm of o instead (``gated_norm.gated_rms_norm``'s math on the float32
    o, by each head's last program: no launch of its own). ``conv`` (conv state (S, C, K - 1),
    weight (C, K)): q, k and v are the layer's raw inputs, consecutive columns of one [Q | K | V]
    row, and the step takes ``conv_step``'s conv and silu of them in its launch (its bits), the
    conv state updated in place for the slots."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != n or a.shape != (n, hv) or b.shape != (n, hv) \
            or state.shape[1:] != (hv, dk, dv) or slots.shape != (n,) or hv % hk or A_log.shape != (hv,) \
            or dt_bias.shape != (hv,) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"q, k (B, Hk, dk), v (B, Hv, dv), a, b (B, Hv), A_log and dt_bias (Hv,), a contiguous "
                         f"float32 state (S, Hv, dk, dv) and one slot per row expected, with Hv a multiple of Hk; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, state {tuple(state.shape)} {state.dtype}, slots {tuple(slots.shape)}")
    if out is None:
        out = torch.empty(n, hv, dv, device=v.device, dtype=v.dtype)
    elif out.shape != (n, hv, dv) or not out.is_contiguous():
        raise ValueError(f"out: a contiguous (B, Hv, dv) = {(n, hv, dv)} expected, got {tuple(out.shape)}")
    if n:
        q, k, v, a, b = (_rows(t) for t in (q, k, v, a, b))
        block_v = min(BLOCK_V, pow2(dv))
        z, weight, eps, parts, count = _norm_args(norm, n, hv, dv, out)
        conv_state, conv_weight, taps = _conv_args(conv, q, k, v, out)
        _kernel().delta_step[(n, hv, -(-dv // block_v))](
            q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), state, slots.contiguous(), out, hk, hv,
            q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), dk ** -0.5, 1e-6,
            z, z.stride(0), weight, eps, parts, count,
            conv_state, conv_weight, conv_state.shape[1] * conv_state.shape[2] if taps else 0,
            counters(n * (hv + hk), out.device)[n * hv:] if taps else out,
            DK=dk, DV=dv, BLOCK_K=pow2(dk), BLOCK_V=block_v, NORM=norm is not None, BLOCK_DV=pow2(dv),
            CONV=taps, BLOCK_CK=pow2(max(taps, 1)), num_warps=1, **FP_FUSION, **pdl(v.device))
    return out


def _conv_args(conv, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> tuple:
    """The kernel's conv state, weight and taps K for ``conv`` (placeholders and 0 without): q, k
    and v must be consecutive columns of one row (the kernel reads them from q's), as the
    layer's split of its [Q | K | V] projection leaves them."""
    if conv is None:
        return out, out, 0
    state, weight = conv
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    channels, base = 2 * hk * dk + hv * dv, q.storage_offset()     # offsets, not data_ptr: fake tensors count launches
    # one row's stride is no layout (views give a lone row any): rows must agree only from two on
    consecutive = (k.storage_offset() == base + hk * dk and v.storage_offset() == base + 2 * hk * dk
                   and (q.shape[0] == 1 or q.stride(0) == k.stride(0) == v.stride(0)) and q.stride()[1:] == (dk, 1)
                   and k.stride()[1:] == (dk, 1) and v.stride()[1:] == (dv, 1) and k.dtype == v.dtype == q.dtype)
    if (not consecutive or state.dim() != 3 or state.shape[1] != channels or state.shape[2] < 1
            or weight.shape != (channels, state.shape[2] + 1) or not state.is_contiguous()):
        raise ValueError(f"conv: q, k, v consecutive columns of one row, a contiguous state (S, C, K - 1) and weight "
                         f"(C, K) for C = {channels} expected, got q, k, v at offsets {q.storage_offset()}, "
                         f"{k.storage_offset()}, {v.storage_offset()} strides {q.stride()}, {k.stride()}, "
                         f"{v.stride()}, state {tuple(state.shape)} {state.stride()} and weight {tuple(weight.shape)}")
    return state, weight.contiguous(), state.shape[2] + 1


def _norm_args(norm, n: int, hv: int, dv: int, out: torch.Tensor) -> tuple:
    """The kernel's z, norm weight, eps, float32 scratch and counters for ``norm`` (placeholders
    the kernel never reads without it). z's heads must be rows of dv contiguous values, dv apart."""
    if norm is None:
        return out, out, 0.0, out, out
    z, weight, eps = norm
    if z.shape != (n, hv, dv) or weight.shape != (dv,):
        raise ValueError(f"norm: z (B, Hv, dv) = {(n, hv, dv)} and a weight of {dv} expected, got z "
                         f"{tuple(z.shape)} and weight {tuple(weight.shape)}")
    if z.stride()[1:] != (dv, 1):
        z = z.contiguous()
    parts = torch.empty(n, hv, dv, device=out.device, dtype=torch.float32)
    return z, weight.contiguous(), float(eps), parts, counters(n * hv, out.device)
