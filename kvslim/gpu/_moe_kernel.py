"""The Triton kernels of ``moe`` (imported only when one runs: importing kvslim needs no triton).

``topk_softmax``: one program per token reads its E router logits, picks the top K by logit
(softmax is monotonic, so the top K probabilities are the top K logits; ties go to the lower
expert id) and writes their routing weights: the softmax probabilities, or with RENORMALIZE
those divided by their sum, which is the softmax over the K chosen logits alone (the full
denominator cancels). float32 inside, the weights rounded once to their tensor's type.
``combine``: a token's output, its pairs' weighted expert outputs summed plus the shared
expert's output times sigmoid of its gate, rounded once.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import sigmoid, stored_as


@triton.jit
def topk_softmax(logits_ptr, weights_ptr, ids_ptr, E, logits_stride, K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Program t: logits (T, E) any float type, rows logits_stride apart (the router's columns of
    a fused projection) -> weights (T, K) of their tensor's type and ids (T, K) int64, in
    descending order of logit, as torch.topk of the softmax gives them."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * logits_stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))                       # unnormalised; 0 past E
    slot = tl.arange(0, BLOCK_K)
    weight = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    left = x
    for i in tl.static_range(K):
        best = tl.argmax(left, axis=0, tie_break_left=True)
        weight = tl.where(slot == i, tl.sum(tl.where(e == best, p, 0.0), axis=0), weight)
        ids = tl.where(slot == i, best.to(tl.int64), ids)
        left = tl.where(e == best, float("-inf"), left)
    weight = weight / (tl.sum(weight, axis=0) if RENORMALIZE else tl.sum(p, axis=0))
    at = t * K + slot
    tl.store(weights_ptr + at, stored_as(weight, weights_ptr), mask=slot < K)
    tl.store(ids_ptr + at, ids, mask=slot < K)


@triton.jit
def combine(pairs_ptr, shared_ptr, gate_ptr, out_ptr, H, gate_stride, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token t, block of BLOCK features): out[t] = ``gated_sum``, rounded once to out's
    type. pairs (T K, H) float32, the routing weights applied; shared (T, H) and gate (T, 1,
    rows gate_stride apart) any float type."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    total = gated_sum(pairs_ptr, shared_ptr, gate_ptr, t, h, H, ok, gate_stride, K, "")
    tl.store(out_ptr + t * H + h, stored_as(total, out_ptr), mask=ok)


@triton.jit
def gated_sum(pairs_ptr, shared_ptr, gate_ptr, t, h, H, ok, gate_stride, K: tl.constexpr, CACHE: tl.constexpr,
              GATED: tl.constexpr = True):
    """Token t's features h in float32: sum_k pairs[t K + k, h], in order of k, + sigmoid(gate[t])
    * shared[t, h]. ``combine`` and the expert GEMV that combines in its launch
    (``_quant_matmul_kernel._last_pair_combines``, which reads the pairs from L2: CACHE ".cg")
    both take it: the same bits from either. GATED False: the pairs' sum alone (the shared
    expert, gated, among them)."""
    acc = tl.zeros(h.shape, tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(pairs_ptr + (t * K + k) * H + h, mask=ok, other=0.0, cache_modifier=CACHE)
    if GATED:
        g = tl.load(gate_ptr + t * gate_stride).to(tl.float32)
        shared = tl.load(shared_ptr + t * H + h, mask=ok, other=0.0).to(tl.float32)
        acc = acc + shared * sigmoid(g)
    return acc


INTERPRETED = not isinstance(topk_softmax, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
