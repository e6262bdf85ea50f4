"""The Triton kernel of ``conv_step`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import sigmoid, stored_as


@triton.jit
def conv_step(x_ptr, state_ptr, slots_ptr, w_ptr, out_ptr, C, x_stride, slot_stride,
              K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (sequence b, block of BLOCK_C channels): the depthwise causal conv's step for one
    new input x[b] (any float type, rows x_stride apart) over the K - 1 inputs before it, kept
    in ``state`` (S, C, K - 1) at slot slots[b], oldest first; out[b] = silu(sum_j window_j w_j)
    in float32 rounded once to out's type; the slot's state then shifts by one and takes x[b],
    in place. Each program reads its own channels of its own slot before writing them."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * slot_stride
    y = conv_silu(x_ptr + b * x_stride, row, w_ptr, c, c < C, K, BLOCK_K)
    tl.store(out_ptr + b * C + c, stored_as(y, out_ptr), mask=c < C)
    shift(x_ptr + b * x_stride, row, c, c < C, K, BLOCK_K)


@triton.jit
def conv_silu(x_ptr, state_ptr, w_ptr, c, live, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channels c's silu(conv) in float32: their new input x[c] (any float type) after the K - 1
    held at state_ptr + c (K - 1) + j (oldest first), times their weights (C, K). ``conv_step``
    and the DeltaNet step that convolves in its launch (``_delta_step_kernel``) both take it: the
    same bits from either."""
    j = tl.arange(0, BLOCK_K)[None, :]
    ok = live[:, None]
    new = tl.load(x_ptr + c, mask=live, other=0.0).to(tl.float32)[:, None]
    held = tl.load(state_ptr + c[:, None] * (K - 1) + j, mask=ok & (j < K - 1), other=0.0).to(tl.float32)
    window = tl.where(j == K - 1, new, held)
    weight = tl.load(w_ptr + c[:, None] * K + j, mask=ok & (j < K), other=0.0).to(tl.float32)
    acc = tl.sum(window * weight, axis=1)
    return acc * sigmoid(acc)


@triton.jit
def shift(x_ptr, state_ptr, c, live, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channels c's held inputs shifted by one, x[c] taking the newest place, in place (after
    every reader of these channels has read them: ``conv_silu``)."""
    j = tl.arange(0, BLOCK_K)[None, :]
    ok = live[:, None]
    row = state_ptr + c[:, None] * (K - 1)
    new = tl.load(x_ptr + c, mask=live, other=0.0).to(tl.float32)[:, None]
    shifted = tl.where(j == K - 2, new, tl.load(row + j + 1, mask=ok & (j < K - 2), other=0.0).to(tl.float32))
    tl.store(row + j, stored_as(shifted, state_ptr), mask=ok & (j < K - 1))


INTERPRETED = not isinstance(conv_step, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
