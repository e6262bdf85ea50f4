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
    j = tl.arange(0, BLOCK_K)[None, :]
    ok = (c < C)[:, None]
    row = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * slot_stride + c[:, None] * (K - 1)
    new = tl.load(x_ptr + b * x_stride + c, mask=c < C, other=0.0).to(tl.float32)[:, None]
    window = tl.where(j == K - 1, new, tl.load(row + j, mask=ok & (j < K - 1), other=0.0).to(tl.float32))
    weight = tl.load(w_ptr + c[:, None] * K + j, mask=ok & (j < K), other=0.0).to(tl.float32)
    acc = tl.sum(window * weight, axis=1)
    tl.store(out_ptr + b * C + c, stored_as(acc * sigmoid(acc), out_ptr), mask=c < C)
    shifted = tl.where(j == K - 2, new, tl.load(row + j + 1, mask=ok & (j < K - 2), other=0.0).to(tl.float32))
    tl.store(row + j, stored_as(shifted, state_ptr), mask=ok & (j < K - 1))


INTERPRETED = not isinstance(conv_step, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
