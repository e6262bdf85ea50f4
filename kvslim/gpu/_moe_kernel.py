"""The Triton kernels of ``moe`` (imported only when one runs: importing kvslim needs no triton).

``topk_softmax``: one program per token reads its E router logits, picks the top K by logit
(softmax is monotonic, so the top K probabilities are the top K logits; ties go to the lower
expert id) and writes their routing weights: the softmax probabilities, or with RENORMALIZE
those divided by their sum, which is the softmax over the K chosen logits alone (the full
denominator cancels). float32 inside, the weights rounded once to their tensor's type.
``router_gemv``: the router's logits (and the shared expert's gate beside them) from x and the
fused matrix, each token's top K by its last program: the matmul and ``topk_softmax`` as one.
``combine``: a token's output, its pairs' weighted expert outputs summed plus the shared
expert's output times sigmoid of its gate, rounded once.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, last_to_arrive, rearm, sigmoid, split_sums, stored_as


@triton.jit
def topk_softmax(logits_ptr, weights_ptr, ids_ptr, E, logits_stride, K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    """Program t: logits (T, E) any float type, rows logits_stride apart (the router's columns of
    a fused projection) -> weights (T, K) of their tensor's type and ids (T, K) int64, in
    descending order of logit, as torch.topk of the softmax gives them."""
    after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * logits_stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    _top_k(x, e, weights_ptr, ids_ptr, t, K, BLOCK_K, RENORMALIZE)


@triton.jit
def _top_k(x, e, weights_ptr, ids_ptr, t, K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Token t's float32 logits x (-inf past E) -> its K routing weights and ids, stored
    (``topk_softmax``'s; ``router_gemv``'s last program takes it too)."""
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
def router_gemv(x_ptr, w_ptr, parts_ptr, count_ptr, gate_ptr, weights_ptr, ids_ptr, R, H, chunks_per_split,
                GATES: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                PDL: tl.constexpr = False):
    """Program (tile of BLOCK_N rows, split s of H, token t): a mixture's router logits and its
    top-k in one launch, where a matmul and ``topk_softmax`` were two. x (T, H) and W (R, H),
    both contiguous, any float types; W's first GATES rows are gates' (the shared expert's),
    the other R - GATES the router's. Each program stores its float32 partial x[t, H_s] .
    W[rows, H_s] in parts (splits, T, R) and counts itself in token t's counter; the token's
    last (``last_to_arrive``) sums its logits over the splits in order, rounds them to x's
    type (what the matmul's output held), stores the gates' in gate (T, GATES) and routes the
    rest as ``topk_softmax`` does (``_top_k``): tokens route in parallel, one program each."""
    after_previous(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.program_id(2)
    n_splits, n_tokens = tl.num_programs(1), tl.num_programs(2)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    first = split * chunks_per_split
    for c in range(first, tl.minimum(first + chunks_per_split, tl.cdiv(H, BLOCK_H))):
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + t * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :],
                    mask=(rows < R)[:, None] & (cols < H)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(parts_ptr + (split * n_tokens + t) * R + rows, acc, mask=rows < R)
    if last_to_arrive(count_ptr + t, tl.num_programs(0) * n_splits):
        g = tl.arange(0, BLOCK_G)
        gates, _ = split_sums(parts_ptr + t * R + g, n_tokens * R, n_splits, g < GATES, 0)
        tl.store(gate_ptr + t * GATES + g, stored_as(gates, gate_ptr), mask=g < GATES)
        e = tl.arange(0, BLOCK_E)
        logits, _ = split_sums(parts_ptr + t * R + GATES + e, n_tokens * R, n_splits, e < R - GATES, 0)
        logits = tl.where(e < R - GATES, stored_as(logits, x_ptr).to(tl.float32), float("-inf"))
        _top_k(logits, e, weights_ptr, ids_ptr, t.to(tl.int64), K, BLOCK_K, RENORMALIZE)
        rearm(count_ptr + t)


@triton.jit
def combine(pairs_ptr, shared_ptr, gate_ptr, out_ptr, H, gate_stride, K: tl.constexpr, BLOCK: tl.constexpr,
            PDL: tl.constexpr = False):
    """Program (token t, block of BLOCK features): out[t] = ``gated_sum``, rounded once to out's
    type. pairs (T K, H) float32, the routing weights applied; shared (T, H) and gate (T, 1,
    rows gate_stride apart) any float type."""
    after_previous(PDL)
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
