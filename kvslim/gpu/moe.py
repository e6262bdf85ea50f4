"""A mixture layer's routing and its outputs' sum, one Triton launch each.

The torch forms (``kvslim.models.layers.Router`` and ``SparseMoE``, the references) launch about
six kernels a layer for the routing in a decode step (the float copy and softmax, topk, the sum
and division, the cast back) and five for the sum (the pairs' sum and its cast, the shared
expert's sigmoid gate, its product and the add); a 35B-A3B step has 40 such layers.
``topk_softmax`` gives the same weights and ids from the router logits in one launch, ``combine``
the layer's output from the pairs' weighted outputs and the shared expert's (``_moe_kernel``);
tests/test_gpu_moe.py holds both to the torch forms under Triton's interpreter.
"""
from __future__ import annotations

import torch

from . import FP_FUSION, counters, kernels, pdl, pow2, serves

MAX_EXPERTS = 4096           # one program holds a token's logits in registers
BLOCK = 1024                 # features a ``combine`` program sums
MAX_ROUTER_TOKENS = 16       # a decode batch's tokens: ``router_gemv`` re-reads the matrix (from L2) per token
ROUTER_TILE = dict(BLOCK_N=8, BLOCK_H=256)     # rows and columns a ``router_gemv`` step holds
# Whether a decode batch's router matmul and top-k are one launch (``router_gemv``: 40 fewer a
# 35B-A3B step), its logits' sums by each token's last program. Untimed on a GPU
# (benchmarks/gpu_model.py --no-sums-in-gemv turns it off with the GEMVs' folds).
ROUTER_GEMV = True
ROUTER_PROGRAMS = 264        # split H until a token's programs are about this many (2 an H100 SM)


def _kernel():
    return kernels("_moe_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernels run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_moe_kernel", x.device)


def routes(logits: torch.Tensor) -> bool:
    """Whether ``topk_softmax`` serves these router logits: the kernels run here and a token's
    logits fit one program (MAX_EXPERTS)."""
    return logits.shape[-1] <= MAX_EXPERTS and runs_on(logits)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) -> (weights (T, top_k) of ``dtype``, expert ids (T, top_k) int64): the top_k
    experts by softmax probability in descending order, their probabilities (divided by their
    sum where ``renormalize``), computed in float32 and rounded once to ``dtype``."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"logits (T, E) and 0 < top_k <= E expected, got {tuple(logits.shape)} and {top_k}")
    n, n_experts = logits.shape
    weights = torch.empty(n, top_k, device=logits.device, dtype=dtype)
    ids = torch.empty(n, top_k, device=logits.device, dtype=torch.int64)
    if n:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        _kernel().topk_softmax[(n,)](logits, weights, ids, n_experts, logits.stride(0), K=top_k,
                                     BLOCK_E=pow2(n_experts), BLOCK_K=pow2(top_k), RENORMALIZE=renormalize,
                                     num_warps=4, **FP_FUSION, **pdl(logits.device))
    return weights, ids


def routes_in_gemv(x: torch.Tensor, weight: torch.Tensor, gates: int) -> bool:
    """Whether ``router_gemv`` serves x and the fused matrix: a decode batch's few tokens
    (MAX_ROUTER_TOKENS), experts that fit one program, the kernels on x's device; ROUTER_GEMV on."""
    return ROUTER_GEMV and _router_operands(x, weight, gates)


def _router_operands(x: torch.Tensor, weight: torch.Tensor, gates: int) -> bool:
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROUTER_TOKENS and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and 0 < weight.shape[0] - gates <= MAX_EXPERTS
            and weight.is_floating_point() and weight.device == x.device and runs_on(x))


def router_gemv(x: torch.Tensor, weight: torch.Tensor, gates: int, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (T, H), weight (G + E, H): G gates' rows (the shared expert's), then E experts' ->
    (gate logits (T, G), weights (T, top_k), ids (T, top_k) int64), in one launch: the logits
    F.linear(x, weight) gives, rounded to x's type (float32 sums, split over H and added in
    order), their first G columns, and ``topk_softmax`` of the rest (weights of x's type)."""
    if not _router_operands(x, weight, gates) or not 0 < top_k <= weight.shape[0] - gates:
        raise ValueError(f"x (T <= {MAX_ROUTER_TOKENS}, H), weight (G + E, H) of floats on x's kernel device and "
                         f"0 < top_k <= E expected, got x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}, G {gates}, top_k {top_k}")
    (n, hidden), rows = x.shape, weight.shape[0]
    tiles = -(-rows // ROUTER_TILE["BLOCK_N"])
    chunks = -(-hidden // ROUTER_TILE["BLOCK_H"])
    per_split = -(-chunks // max(1, min(chunks, ROUTER_PROGRAMS // tiles)))
    splits = -(-chunks // per_split)
    parts = torch.empty(splits, n, rows, device=x.device, dtype=torch.float32)
    gate = torch.empty(n, gates, device=x.device, dtype=x.dtype)
    weights = torch.empty(n, top_k, device=x.device, dtype=x.dtype)
    ids = torch.empty(n, top_k, device=x.device, dtype=torch.int64)
    _kernel().router_gemv[(tiles, splits, n)](
        x.contiguous(), weight.contiguous(), parts, counters(n, x.device), gate, weights, ids, rows, hidden, per_split,
        GATES=gates, K=top_k, BLOCK_E=pow2(rows - gates), BLOCK_G=pow2(gates), BLOCK_K=pow2(top_k),
        RENORMALIZE=renormalize, num_warps=4, **ROUTER_TILE, **FP_FUSION, **pdl(x.device))
    return gate, weights, ids


def combine(pairs: torch.Tensor, top_k: int, shared: torch.Tensor, gate: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """pairs (T top_k, H) float32: each (token, chosen expert) pair's output times its routing
    weight, token-major; shared (T, H) the shared expert's output; gate (T, 1) its gate's logit
    -> (T, H) of ``dtype``: the pairs summed per token plus sigmoid(gate) * shared, in float32,
    rounded once."""
    n, hidden = shared.shape
    if pairs.shape != (n * top_k, hidden) or pairs.dtype != torch.float32 or gate.shape != (n, 1) \
            or not pairs.is_contiguous():
        raise ValueError(f"pairs (T top_k, H) float32, shared (T, H) and gate (T, 1) expected, got pairs "
                         f"{tuple(pairs.shape)} {pairs.dtype}, shared {tuple(shared.shape)}, gate {tuple(gate.shape)}")
    out = torch.empty(n, hidden, device=shared.device, dtype=dtype)
    if n:
        _kernel().combine[(n, -(-hidden // BLOCK))](pairs, shared.contiguous(), gate, out, hidden, gate.stride(0),
                                                    K=top_k, BLOCK=BLOCK, num_warps=4, **FP_FUSION, **pdl(pairs.device))
    return out
