"""The Triton kernel of ``add_norm`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import stored_as


@triton.jit
def add_rms_norm(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, eps, x_stride, d_stride, BLOCK: tl.constexpr):
    """Program (row r): s = x[r] + d[r], stored in sum's type (the residual stream, rounded as
    torch's add rounds it); out[r] = s * rsqrt(mean(s^2) + eps) * w, in float32 from the stored
    s, rounded once to out's type. x and d: rows of any float type at their own strides; w (H,);
    sum and out (R, H) contiguous; BLOCK >= H."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < H
    x = tl.load(x_ptr + r * x_stride + c, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + r * d_stride + c, mask=ok, other=0.0).to(tl.float32)
    s = stored_as(x + d, sum_ptr)
    tl.store(sum_ptr + r * H + c, s, mask=ok)
    s = s.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + c, stored_as(s * scale * w, out_ptr), mask=ok)


INTERPRETED = not isinstance(add_rms_norm, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
