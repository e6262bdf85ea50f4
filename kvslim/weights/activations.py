"""8-bit activations for decode's GEMV: the reference of ``native/block_linear_q8.c``.

llama.cpp's CPU backend multiplies K-quant weights by activations rounded to 8 bits, so that
the dot products are integer arithmetic; kvslim's C GEMV does the same for Q4_K, Q5_K and Q6_K
(``native.block_linear.q8_activations``), with a scale per 32 activations where llama.cpp has one
per 256 (ggml's Q8_K): measured on the bundled model's Q4_K_M decode, 3.7x lower KL divergence
from float activations. Here the same computation in torch, from the blocks' integer fields:
the activations' bytes equal the C ones, and the products differ from them only in the float
sums' order.

A super-block's values are ``d * scale[s] * q - dmin * minimum[s]`` per 16 values s, with
unsigned codes q; so with x = dx[g] * xq per group g of 32, group g's share of the output is
``dx[g] * (d * sum_s scale[s] * (q_s . xq_s) - dmin * sum_s minimum[s] * sum(xq_s))`` over its
two halves s.
"""
from __future__ import annotations

import torch

from ..formats.base import fp16_from_bytes
from . import kquants
from .types import WeightType

QK_K = kquants.QK_K
GROUP = 32                               # values per activation scale
TYPES = ("q4_k", "q5_k", "q6_k")         # block_linear_q8.c's


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k) float32, k whole groups of 32 -> (d (m, k / 32) float32, q (m, k / 32, 32) int8):
    x ~ d * q with q = round-half-even(x * 127 / max |x|) per group. A group with a NaN or an
    infinity gets d = NaN and q = 0; an all-zero group d = 0."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    finite = torch.isfinite(groups).all(-1)
    amax = torch.where(finite, groups.abs().amax(-1), torch.zeros((), dtype=torch.float32))
    live = amax > 0
    top = torch.full_like(amax, 127.0)        # tensor / tensor: torch divides a tensor by a scalar as
    iscale = torch.where(live, top / torch.where(live, amax, 1.0), 0.0)      # a product by its reciprocal
    q = torch.round(groups * iscale.unsqueeze(-1)).to(torch.int8)
    d = torch.where(finite, amax / top, torch.full_like(amax, float("nan")))
    return d, q


def integer_form(wtype: WeightType, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(N, block_bytes) super-blocks of a TYPES type -> codes (N, 16, 16) int64 >= 0, scale and
    minimum (N, 16) int64 per 16 values, d and dmin (N,) float32. Q6_K's codes are stored plus 32:
    its minimum is 32 times the scale (dmin = 32 d)."""
    f = wtype.split(blocks)
    n = blocks.shape[0]
    if wtype.name == "q6_k":
        scale = f["scales"].view(torch.int8).long()
        d = fp16_from_bytes(f["d"]).view(n)
        return kquants.codes_q6_k(f).long().view(n, 16, 16), scale, scale, d, 32 * d
    codes = {"q4_k": kquants.codes_q4_k, "q5_k": kquants.codes_q5_k}[wtype.name](f)
    sc, mn = (v.long().repeat_interleave(2, dim=1) for v in kquants.scale_min_k4(f["scales"]))
    return codes.long().view(n, 16, 16), sc, mn, fp16_from_bytes(f["d"]).view(n), fp16_from_bytes(f["dmin"]).view(n)


def q8_block_linear_reference(x: torch.Tensor, blocks: torch.Tensor, wtype: WeightType) -> torch.Tensor:
    """x (m, k) @ W.T with x rounded by ``quantize_q8k``, for W (n, row_bytes) blocks of a TYPES
    type (columns in the blocks' order) -> (m, n) float32; sums exact in integers, scaled in
    float64."""
    if wtype.name not in TYPES:
        raise ValueError(f"8-bit activations are for {', '.join(TYPES)}, not {wtype.name}")
    m, k = x.shape
    n, nb = blocks.shape[0], k // QK_K
    dx, xq = quantize_q8(x)
    dx, xq = dx.double().view(m, 1, nb, 8, 1), xq.long().view(m, nb, 8, 2, 16)
    codes, scale, minimum, d, dmin = (t.view(n, nb, *t.shape[1:]) for t in
                                      integer_form(wtype, blocks.reshape(n * nb, wtype.block_bytes)))
    codes, scale, minimum = codes.view(n, nb, 8, 2, 16), scale.view(n, nb, 8, 2), minimum.view(n, nb, 8, 2)
    dots = torch.einsum("nbghl,mbghl->mnbgh", codes, xq)                     # (m, n, nb, 8, 2) exact
    sums = xq.sum(-1).unsqueeze(1)                                           # (m, 1, nb, 8, 2)
    d, dmin = d.double().view(1, n, nb, 1, 1), dmin.double().view(1, n, nb, 1, 1)
    y = dx * (d * (dots * scale).double() - dmin * (sums * minimum).double())
    return y.sum((-1, -2, -3)).float()
