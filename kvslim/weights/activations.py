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
from ..formats.ggml import IQ4NL_VALUES
from . import kquants
from .types import WeightType

QK_K = kquants.QK_K
GROUP = 32                               # values per activation scale
TYPES = ("q4_k", "q5_k", "q6_k", "q4_0", "iq4_nl", "iq4_xs")   # block_linear_q8.c's


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


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) bytes -> (N, 32) codes: the low nibbles are values 0-15, the high ones 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).long()


def integer_form(wtype: WeightType, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(N, block_bytes) blocks of a TYPES type -> codes (N, G, 2, 16) int64 per group of 32 and
    half, scale and minimum (N, G, 2) int64 per half, d and dmin (N,) float32: values
    d * scale * code - dmin * minimum. Q6_K's codes are stored plus 32: its minimum is 32 times the
    scale (dmin = 32 d). The 32-value block types have one group, scale 1 and no minimum."""
    f = wtype.split(blocks)
    n = blocks.shape[0]
    d = fp16_from_bytes(f["d"]).view(n)
    if wtype.block_size == GROUP:
        if wtype.name == "q4_0":
            codes = _nibbles(f["qs"]) - 8
        else:                                                                   # iq4_nl
            codes = torch.tensor(IQ4NL_VALUES)[_nibbles(f["qs"])]
        ones = torch.ones(n, 1, 2, dtype=torch.long)
        return codes.view(n, 1, 2, 16), ones, 0 * ones, d, torch.zeros_like(d)
    if wtype.name == "iq4_xs":
        codes = torch.tensor(IQ4NL_VALUES)[kquants.iq4_xs_indices(f)]
        scale = kquants.iq4_xs_scales(f).long().unsqueeze(-1).expand(n, 8, 2)
        return codes.view(n, 8, 2, 16), scale, 0 * scale, d, torch.zeros_like(d)
    if wtype.name == "q6_k":
        scale = f["scales"].view(torch.int8).long().view(n, 8, 2)
        return kquants.codes_q6_k(f).long().view(n, 8, 2, 16), scale, scale, d, 32 * d
    codes = {"q4_k": kquants.codes_q4_k, "q5_k": kquants.codes_q5_k}[wtype.name](f)
    sc, mn = (v.long().unsqueeze(-1).expand(n, 8, 2) for v in kquants.scale_min_k4(f["scales"]))
    return codes.long().view(n, 8, 2, 16), sc, mn, d, fp16_from_bytes(f["dmin"]).view(n)


def q8_block_linear_reference(x: torch.Tensor, blocks: torch.Tensor, wtype: WeightType) -> torch.Tensor:
    """x (m, k) @ W.T with x rounded by ``quantize_q8``, for W (n, row_bytes) blocks of a TYPES
    type (columns in the blocks' order) -> (m, n) float32; sums exact in integers, scaled in
    float64."""
    if wtype.name not in TYPES:
        raise ValueError(f"8-bit activations are for {', '.join(TYPES)}, not {wtype.name}")
    m, k = x.shape
    n, nb, per = blocks.shape[0], k // wtype.block_size, wtype.block_size // GROUP
    dx, xq = quantize_q8(x)
    dx, xq = dx.double().view(m, 1, nb, per, 1), xq.long().view(m, nb, per, 2, 16)
    codes, scale, minimum, d, dmin = (t.view(n, nb, *t.shape[1:]) for t in
                                      integer_form(wtype, blocks.reshape(n * nb, wtype.block_bytes)))
    dots = torch.einsum("nbghl,mbghl->mnbgh", codes, xq)                     # (m, n, nb, G, 2) exact
    sums = xq.sum(-1).unsqueeze(1)                                           # (m, 1, nb, G, 2)
    d, dmin = d.double().view(1, n, nb, 1, 1), dmin.double().view(1, n, nb, 1, 1)
    y = dx * (d * (dots * scale).double() - dmin * (sums * minimum).double())
    return y.sum((-1, -2, -3)).float()
