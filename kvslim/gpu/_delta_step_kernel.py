"""The Triton kernel of ``delta_step`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, last_to_arrive, rearm, sigmoid, stored_as
from ._conv_step_kernel import conv_operands, shifted_inputs, silu_conv, store_shifted
from ._gated_norm_kernel import gated_normed


@triton.jit
def _unit(x, eps):
    """x / sqrt(sum x^2 + eps): ``delta_rule.l2norm``."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps))


@triton.jit
def delta_step(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, out_ptr,
               HK, HV, q_stride, k_stride, v_stride, a_stride, b_stride, scale, eps,
               z_ptr, z_stride, norm_ptr, norm_eps, parts_ptr, count_ptr,
               conv_ptr, conv_w_ptr, conv_slot_stride, conv_count_ptr,
               DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
               NORM: tl.constexpr = False, BLOCK_DV: tl.constexpr = 1, CONV: tl.constexpr = 0,
               BLOCK_CK: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (sequence s, value head h, block of BLOCK_V value columns): one decode token of a
    Gated DeltaNet layer, on the state of slot slots[s] ((HV, DK, DV) float32, in place).

    q, k (key head h // (HV / HK), as convolved) are L2-normalised here; the decay
    g = -exp(A_log[h]) * softplus(a + dt_bias[h]) and the rate beta = sigmoid(b) come from the
    gates' pre-activations. Then, on the program's columns of the state S:
        S *= exp(g);  S += k (x) beta (v - S^T k);  out = (q * scale)^T S
    in float32, out rounded once to its type. Every column of S depends only on itself, so the
    programs of one head split the columns and never read each other's.
    NORM: out is the layer's gated output norm of o (``_last_head_norms``), not o: z (B, HV, DV)
    at row stride z_stride, the norm's weight (DV,) and eps; parts (B, HV, DV) float32 scratch.
    CONV = K > 0: q, k and v are the layer's raw [Q | K | V] row (q_ptr, q_stride; k_ptr and
    v_ptr unread) and the step first takes the short causal conv of its channels itself
    (``_convolved``): the conv state (S, C, K - 1) at conv_ptr, conv_slot_stride a slot, its
    weights (C, K); no launch of its own."""
    after_previous(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    kh = h // (HV // HK)
    # every load first, the state's (behind the slot's) among them: a program waits on memory
    # twice (the slot, then everything else) before its counters, where a load after each use
    # waited four times with the conv (and after the conv's counter, twice more)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    tile = (rows < DK)[:, None] & (cols < DV)[None, :]
    at = state_ptr + (slot * HV + h) * (DK * DV) + rows[:, None] * DV + cols[None, :]
    state = tl.load(at, mask=tile, other=0.0)
    x = tl.load(a_ptr + s * a_stride + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    b = tl.load(b_ptr + s * b_stride + h).to(tl.float32)
    if CONV == 0:
        q = tl.load(q_ptr + s * q_stride + kh * DK + rows, mask=rows < DK, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + s * k_stride + kh * DK + rows, mask=rows < DK, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + s * v_stride + h * DV + cols, mask=cols < DV, other=0.0).to(tl.float32)
    else:
        tl.debug_barrier()      # those loads go out here, not held back until the conv's counter needs them
        q, k, v = _convolved(q_ptr + s * q_stride, conv_ptr + slot * conv_slot_stride, conv_w_ptr,
                             conv_count_ptr + s * HK + kh, rows, cols, kh, h, HK, HV, DK, DV, CONV, BLOCK_CK)
    q, k = _unit(q, eps) * scale, _unit(k, eps)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))     # torch's threshold
    state *= tl.exp(-tl.exp(a_log) * softplus)
    predicted = tl.sum(state * k[:, None], axis=0)                   # S^T k: what the state recalls for k
    state += k[:, None] * ((v - predicted) * sigmoid(b))[None, :]
    tl.store(at, state, mask=tile)
    o = tl.sum(state * q[:, None], axis=0)
    if NORM:
        _last_head_norms(parts_ptr, count_ptr, out_ptr, z_ptr, norm_ptr, o, s, h, cols, HV, z_stride, norm_eps,
                         DV, BLOCK_DV)
    else:
        tl.store(out_ptr + (s * HV + h) * DV + cols, stored_as(o, out_ptr), mask=cols < DV)


@triton.jit
def _convolved(x_ptr, conv_ptr, w_ptr, counter, rows, cols, kh, h, HK, HV, DK: tl.constexpr, DV: tl.constexpr,
               K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The program's q and k (key head kh's channels) and v (value head h's columns ``cols``),
    float32, from the raw [Q | K | V] row at x_ptr through the layer's conv and silu
    (``_conv_step_kernel.conv_operands``, ``silu_conv``: ``conv_step``'s bits), its state at
    conv_ptr updated in place once every program has read it: v's columns by the program that
    owns them, q's and k's (which all the key head's programs read) by the last of them to count
    itself in the (sequence, key head) counter (``last_to_arrive``, ``rearm``), from their held
    inputs read again after it counts (kept in registers from before, they cost about 50 more
    registers a thread; read again, one more wait, in that program alone)."""
    q_at, k_at, v_at = kh * DK + rows, HK * DK + kh * DK + rows, 2 * HK * DK + h * DV + cols
    q_window, q_weight, _ = conv_operands(x_ptr, conv_ptr, w_ptr, q_at, rows < DK, K, BLOCK_K)
    k_window, k_weight, _ = conv_operands(x_ptr, conv_ptr, w_ptr, k_at, rows < DK, K, BLOCK_K)
    v_window, v_weight, v_shifted = conv_operands(x_ptr, conv_ptr, w_ptr, v_at, cols < DV, K, BLOCK_K)
    q, k, v = silu_conv(q_window, q_weight), silu_conv(k_window, k_weight), silu_conv(v_window, v_weight)
    store_shifted(conv_ptr, v_at, cols < DV, v_shifted, K, BLOCK_K)
    if last_to_arrive(counter, (HV // HK) * tl.num_programs(2)):
        q_shifted = shifted_inputs(x_ptr, conv_ptr, q_at, rows < DK, K, BLOCK_K)
        k_shifted = shifted_inputs(x_ptr, conv_ptr, k_at, rows < DK, K, BLOCK_K)
        store_shifted(conv_ptr, q_at, rows < DK, q_shifted, K, BLOCK_K)
        store_shifted(conv_ptr, k_at, rows < DK, k_shifted, K, BLOCK_K)
        rearm(counter)
    return q, k, v


@triton.jit
def _last_head_norms(parts_ptr, count_ptr, out_ptr, z_ptr, norm_ptr, o, s, h, cols, HV, z_stride, eps,
                     DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The DeltaNet output norm in the step's launch, not one of its own (``gated_norm``: 30 a
    35B-A3B decode step): each program stores its columns of o in float32 and counts itself in
    its (sequence, head) counter; the one that counts last reads the head's whole o back (from
    L2), stores ``gated_normed`` of it rounded once, and sets the counter back to 0
    (``last_to_arrive``, ``rearm``). The norm reads o in float32, where the separate launch
    read it rounded to out's type."""
    row = (s * HV + h) * DV
    tl.store(parts_ptr + row + cols, o, mask=cols < DV)
    counter = count_ptr + s * HV + h
    if last_to_arrive(counter, tl.num_programs(2)):
        c = tl.arange(0, BLOCK_DV)
        ok = c < DV
        z = tl.load(z_ptr + s * z_stride + h * DV + c, mask=ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(norm_ptr + c, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(parts_ptr + row + c, mask=ok, other=0.0, cache_modifier=".cg")[None, :]
        y = gated_normed(x, z, w, DV, eps)
        tl.store(out_ptr + row + c[None, :], stored_as(y, out_ptr), mask=ok[None, :])
        rearm(counter)


INTERPRETED = not isinstance(delta_step, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
