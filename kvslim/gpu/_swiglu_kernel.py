"""The Triton kernel of ``swiglu`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, sigmoid, stored_as


@triton.jit
def act_mul(gate_ptr, up_ptr, out_ptr, H, D, gate_rows, gate_heads, up_rows, up_heads,
            ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row r, head h, block b of BLOCK columns): out[r, h, c] = act(gate[r, h, c]) *
    up[r, h, c] in float32, rounded once to out's type; act is silu (ACT "silu": SwiGLU) or the
    sigmoid (ACT "sigmoid": gated attention's output gate). gate and up: any float type, each
    at its own row and head strides (halves of one fused projection's output, the gate columns
    of the query projection, or plain tensors); out (R, H, D) contiguous."""
    after_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    g = tl.load(gate_ptr + r * gate_rows + h * gate_heads + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * up_rows + h * up_heads + c, mask=ok, other=0.0).to(tl.float32)
    act = sigmoid(g)
    if ACT == "silu":
        act = g * act
    tl.store(out_ptr + (r * H + h) * D + c, stored_as(act * u, out_ptr), mask=ok)


INTERPRETED = not isinstance(act_mul, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
