"""The Triton kernel of ``rope`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, stored_as

PLAIN = tl.constexpr(1)            # NORM: RMSNorm with weight w
ZERO_CENTRED = tl.constexpr(2)     # NORM: RMSNorm with weight 1 + w


@triton.jit
def _normed(x, w, rstd, NORM: tl.constexpr):
    """A head's values x (float32) times rstd and the norm's weight w (as loaded) where NORM."""
    if NORM == PLAIN:
        x = x * rstd * w.to(tl.float32)
    elif NORM == ZERO_CENTRED:
        x = x * rstd * (1.0 + w.to(tl.float32))
    return x


@triton.jit
def norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, row_stride, head_stride, table_stride, eps,
              k_ptr, k_w_ptr, k_out_ptr, HK, k_row_stride, k_head_stride,
              D: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token n, head h): the head's D values (rows row_stride, heads head_stride apart,
    any float type), RMS-normalised over D with the norm's weight where NORM (0: none), then
    rotated in their first ROT dims by cos/sin (N, ROT) rows table_stride apart, half-split
    (value d < ROT/2 pairs with d + ROT/2): float32 inside, rounded once into out (N, H, D).
    Heads H to H + HK - 1 are a second tensor's (k beside q: one launch for both), with its
    own k_ pointers and strides and the same D, ROT, NORM and types."""
    after_previous(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_k = h >= H
    j = tl.where(is_k, h - H, h)
    head = tl.where(is_k, k_ptr + n * k_row_stride + j * k_head_stride, x_ptr + n * row_stride + j * head_stride)
    w_ptr = tl.where(is_k, k_w_ptr, w_ptr)
    out_ptr = tl.where(is_k, k_out_ptr + (n * HK + j) * D, out_ptr + (n * H + j) * D)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    half: tl.constexpr = ROT // 2
    turned = d < ROT
    across = tl.where(d < half, d + half, d - half)
    # every load before the norm's sum (its barrier held back the weights', the partners' and the
    # tables' loads: a second wait on memory, sm_90)
    x = tl.load(head + d, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(head + across, mask=turned, other=0.0).to(tl.float32)
    w, w_partner = x, partner                                           # (unread without a norm)
    if NORM != 0:
        w = tl.load(w_ptr + d, mask=ok, other=0.0)
        w_partner = tl.load(w_ptr + across, mask=turned, other=0.0)
    cos = tl.load(cos_ptr + n * table_stride + d, mask=turned, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + n * table_stride + d, mask=turned, other=0.0).to(tl.float32)
    rstd = 1.0
    if NORM != 0:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    x, partner = _normed(x, w, rstd, NORM), _normed(partner, w_partner, rstd, NORM)
    out = x * cos + tl.where(d < half, -partner, partner) * sin
    tl.store(out_ptr + d, stored_as(out, out_ptr), mask=ok)


@triton.jit
def rope_tables(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, N, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_F: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of BLOCK_N tokens): cos and sin (N, 2 HALF) of position * inv_freq (HALF,
    float32), each frequency's value twice (columns f and HALF + f), rounded once to the
    tables' type: ``layers.Rope.tables``' float32 product, cat, cos, sin and casts in one launch."""
    after_previous(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    f = tl.arange(0, BLOCK_F)
    live = (n < N)[:, None] & (f < HALF)[None, :]
    position = tl.load(positions_ptr + n, mask=n < N, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(inv_freq_ptr + f, mask=f < HALF, other=0.0)[None, :]
    at = n.to(tl.int64)[:, None] * (2 * HALF) + f[None, :]
    cos = stored_as(tl.cos(angle), cos_ptr)
    sin = stored_as(tl.sin(angle), sin_ptr)
    tl.store(cos_ptr + at, cos, mask=live)
    tl.store(cos_ptr + at + HALF, cos, mask=live)
    tl.store(sin_ptr + at, sin, mask=live)
    tl.store(sin_ptr + at + HALF, sin, mask=live)


INTERPRETED = not isinstance(norm_rope, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
