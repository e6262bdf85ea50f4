"""The Triton kernel of ``rope`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import stored_as

PLAIN = tl.constexpr(1)            # NORM: RMSNorm with weight w
ZERO_CENTRED = tl.constexpr(2)     # NORM: RMSNorm with weight 1 + w


@triton.jit
def _normed(x_ptr, w_ptr, d, ok, rstd, NORM: tl.constexpr):
    """Values d of a head (float32), times rstd and the norm's weight where NORM."""
    x = tl.load(x_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if NORM == PLAIN:
        x = x * rstd * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    elif NORM == ZERO_CENTRED:
        x = x * rstd * (1.0 + tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32))
    return x


@triton.jit
def norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, row_stride, head_stride, table_stride, eps,
              D: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token n, head h): the head's D values (rows row_stride, heads head_stride apart,
    any float type), RMS-normalised over D with the norm's weight where NORM (0: none), then
    rotated in their first ROT dims by cos/sin (N, ROT) rows table_stride apart, half-split
    (value d < ROT/2 pairs with d + ROT/2): float32 inside, rounded once into out (N, H, D)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    head = x_ptr + n * row_stride + h * head_stride
    rstd = 1.0
    if NORM != 0:
        x = tl.load(head + d, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    x = _normed(head, w_ptr, d, ok, rstd, NORM)
    half: tl.constexpr = ROT // 2
    turned = d < ROT
    partner = _normed(head, w_ptr, tl.where(d < half, d + half, d - half), turned, rstd, NORM)
    cos = tl.load(cos_ptr + n * table_stride + d, mask=turned, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + n * table_stride + d, mask=turned, other=0.0).to(tl.float32)
    out = x * cos + tl.where(d < half, -partner, partner) * sin
    tl.store(out_ptr + (n * H + h) * D + d, stored_as(out, out_ptr), mask=ok)


INTERPRETED = not isinstance(norm_rope, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
