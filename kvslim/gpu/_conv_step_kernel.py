"""The Triton kernel of ``conv_step`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, sigmoid, stored_as


@triton.jit
def conv_step(x_ptr, state_ptr, slots_ptr, w_ptr, out_ptr, C, x_stride, slot_stride,
              K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (sequence b, block of BLOCK_C channels): the depthwise causal conv's step for one
    new input x[b] (any float type, rows x_stride apart) over the K - 1 inputs before it, kept
    in ``state`` (S, C, K - 1) at slot slots[b], oldest first; out[b] = silu(sum_j window_j w_j)
    in float32 rounded once to out's type; the slot's state then shifts by one and takes x[b],
    in place. Each program reads its own channels of its own slot before writing them."""
    after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * slot_stride
    window, weight, shifted = conv_operands(x_ptr + b * x_stride, row, w_ptr, c, c < C, K, BLOCK_K)
    tl.store(out_ptr + b * C + c, stored_as(silu_conv(window, weight), out_ptr), mask=c < C)
    store_shifted(row, c, c < C, shifted, K, BLOCK_K)


@triton.jit
def conv_operands(x_ptr, state_ptr, w_ptr, c, live, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channels c's conv operands, float32 (channels, BLOCK_K): the window (the K - 1 inputs held
    at state_ptr + c (K - 1) + j, oldest first, then the new x[c], any float type), its weights
    (C, K), and the held inputs shifted by one with x[c] newest (``shifted_inputs``: the state
    after this step). Every load goes out before any is used, each straight into the 2D layout
    that uses it (x read into its column of each: a 1D load widened after would be a trip
    through shared memory, and one more wait on memory before the next loads): ``conv_step``
    and the DeltaNet step that convolves in its launch (``_delta_step_kernel``) both take it, so
    either gives the same bits."""
    j = tl.arange(0, BLOCK_K)[None, :]
    ok = live[:, None]
    held = tl.load(state_ptr + c[:, None] * (K - 1) + j, mask=ok & (j < K - 1), other=0.0).to(tl.float32)
    new = tl.load(x_ptr + c[:, None] + j * 0, mask=ok & (j == K - 1), other=0.0).to(tl.float32)
    weight = tl.load(w_ptr + c[:, None] * K + j, mask=ok & (j < K), other=0.0).to(tl.float32)
    return tl.where(j == K - 1, new, held), weight, shifted_inputs(x_ptr, state_ptr, c, live, K, BLOCK_K)


@triton.jit
def shifted_inputs(x_ptr, state_ptr, c, live, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channels c's held inputs shifted by one with x[c] newest, float32 (channels, BLOCK_K): the
    state after this step (``store_shifted``), loaded straight into that layout."""
    j = tl.arange(0, BLOCK_K)[None, :]
    ok = live[:, None]
    ahead = tl.load(state_ptr + c[:, None] * (K - 1) + j + 1, mask=ok & (j < K - 2), other=0.0).to(tl.float32)
    new = tl.load(x_ptr + c[:, None] + j * 0, mask=ok & (j == K - 2), other=0.0).to(tl.float32)
    return tl.where(j == K - 2, new, ahead)


@triton.jit
def silu_conv(window, weight):
    """silu of the conv's sum over each channel's window, float32 (channels,)."""
    acc = tl.sum(window * weight, axis=1)
    return acc * sigmoid(acc)


@triton.jit
def store_shifted(state_ptr, c, live, shifted, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channels c's held inputs replaced by ``conv_operands``' shifted ones, in place (after every
    reader of these channels has read them)."""
    j = tl.arange(0, BLOCK_K)[None, :]
    tl.store(state_ptr + c[:, None] * (K - 1) + j, stored_as(shifted, state_ptr), mask=live[:, None] & (j < K - 1))


INTERPRETED = not isinstance(conv_step, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
