"""The Triton kernel of ``delta_step`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import sigmoid, stored_as


@triton.jit
def _unit(x, eps):
    """x / sqrt(sum x^2 + eps): ``delta_rule.l2norm``."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))


@triton.jit
def delta_step(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
               HK, HV, q_stride, k_stride, v_stride, a_stride, b_stride, scale, eps,
               DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (sequence s, value head h, block of BLOCK_V value columns): one decode token of a
    Gated DeltaNet layer, on the state of slot slots[s] ((HV, DK, DV) float32, in place).

    q, k (key head h // (HV / HK), as convolved) are L2-normalised here; the decay
    g = -exp(A_log[h]) * softplus(a + dt_bias[h]) and the rate beta = sigmoid(b) come from the
    gates' pre-activations. Then, on the program's columns of the state S:
        S *= exp(g);  S += k (x) beta (v - S^T k);  out = (q * scale)^T S
    in float32, out rounded once to its type. Every column of S depends only on itself, so the
    programs of one head split the columns and never read each other's."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    kh = h // (HV // HK)
    q = tl.load(q_ptr + s * q_stride + kh * DK + rows, mask=rows < DK, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + s * k_stride + kh * DK + rows, mask=rows < DK, other=0.0).to(tl.float32)
    q, k = _unit(q, eps) * scale, _unit(k, eps)
    x = tl.load(a_ptr + s * a_stride + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))     # torch's threshold
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus)
    beta = sigmoid(tl.load(b_ptr + s * b_stride + h).to(tl.float32))
    tile = (rows < DK)[:, None] & (cols < DV)[None, :]
    at = state_ptr + (tl.load(slots_ptr + s).to(tl.int64) * HV + h) * (DK * DV) + rows[:, None] * DV + cols[None, :]
    state = tl.load(at, mask=tile, other=0.0) * decay
    v = tl.load(v_ptr + s * v_stride + h * DV + cols, mask=cols < DV, other=0.0).to(tl.float32)
    predicted = tl.sum(state * k[:, None], axis=0)                   # S^T k: what the state recalls for k
    state += k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(at, state, mask=tile)
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + (s * HV + h) * DV + cols, stored_as(o, out_ptr), mask=cols < DV)


INTERPRETED = not isinstance(delta_step, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
