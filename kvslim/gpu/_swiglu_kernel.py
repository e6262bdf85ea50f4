"""The Triton kernel of ``swiglu`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import stored_as


@triton.jit
def silu_mul(gate_ptr, up_ptr, out_ptr, I, gate_stride, up_stride, BLOCK: tl.constexpr):
    """Program (row r, block b of BLOCK columns): out[r, c] = silu(gate[r, c]) * up[r, c] in
    float32, rounded once to out's type. gate and up: rows of any float type at their own row
    strides (two halves of one fused projection's output, or two tensors); out (R, I) contiguous."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(gate_ptr + r * gate_stride + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * up_stride + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * I + c, stored_as(g / (1.0 + tl.exp(-g)) * u, out_ptr), mask=ok)


INTERPRETED = not isinstance(silu_mul, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
