"""The Triton kernel of ``add_norm`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, stored_as


@triton.jit
def add_rms_norm(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, eps, x_stride, d_stride, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program (row r): ``added_norm`` of x[r] and d[r]. x and d: rows of any float type at
    their own strides; w (H,); sum and out (R, H) contiguous; BLOCK >= H."""
    after_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    added_norm(x_ptr + r * x_stride, d_ptr + r * d_stride, w_ptr, sum_ptr + r * H, out_ptr + r * H, H, eps, BLOCK,
               "")


@triton.jit
def added_norm(x_row, d_row, w_ptr, sum_row, out_row, H, eps, BLOCK: tl.constexpr, CACHE: tl.constexpr):
    """One row: s = x + d, stored in sum's type (the residual stream, rounded as torch's add
    rounds it); out = s * rsqrt(mean(s^2) + eps) * w, in float32 from the stored s, rounded
    once to out's type. ``add_rms_norm`` and the GEMV that adds and norms its own output
    (``_quant_matmul_kernel._last_row_add_norms``, which reads d from L2: CACHE ".cg") both
    take it: the same bits from either."""
    c = tl.arange(0, BLOCK)
    ok = c < H
    x = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_row + c, mask=ok, other=0.0, cache_modifier=CACHE).to(tl.float32)
    # w before sum's store, which it may alias for all the compiler knows: loaded after it, w was
    # one more wait on memory (sm_90, 2,048 bf16 values: 3 waits, now 2; in the GEMV's tail, 4 and 2)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    s = stored_as(x + d, sum_row)
    tl.store(sum_row + c, s, mask=ok)
    s = s.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    tl.store(out_row + c, stored_as(s * scale * w, out_row), mask=ok)


INTERPRETED = not isinstance(add_rms_norm, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
