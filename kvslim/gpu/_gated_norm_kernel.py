"""The Triton kernel of ``gated_norm`` (imported only when one runs: importing kvslim needs no triton)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, sigmoid, stored_as


@triton.jit
def gated_rms_norm(x_ptr, z_ptr, w_ptr, out_ptr, n_heads, width, eps, x_rows, x_heads, z_rows, z_heads,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row r, block of BLOCK_H heads): out[r, h] = x[r, h] * rsqrt(mean(x[r, h]^2) + eps)
    * w * silu(z[r, h]), each head normalised over its own ``width`` columns, in float32, rounded
    once to out's type. x and z: any float type, each at its own row and head strides (z is a
    slice of the fused input projection's output); w (width,); out (R, H, width) contiguous."""
    after_previous(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_D)
    ok = (h < n_heads)[:, None] & (c < width)[None, :]
    x = tl.load(x_ptr + r * x_rows + h[:, None] * x_heads + c[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + r * z_rows + h[:, None] * z_heads + c[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32)
    y = gated_normed(x, z, w, width, eps)
    tl.store(out_ptr + (r * n_heads + h[:, None]) * width + c[None, :], stored_as(y, out_ptr), mask=ok)


@triton.jit
def gated_normed(x, z, w, width, eps):
    """x (H, D) float32 heads, each normalised over its ``width`` columns (zeros past them), times
    w (D,) and silu(z): ``gated_rms_norm``'s math, which the DeltaNet decode step's last program
    per head takes too (``_delta_step_kernel``), so the two give the same bits on the same x."""
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)         # (H,)
    return x * scale[:, None] * w[None, :] * (z * sigmoid(z))


INTERPRETED = not isinstance(gated_rms_norm, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
