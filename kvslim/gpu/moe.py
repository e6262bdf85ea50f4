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

from . import FP_FUSION, kernels, pow2, serves

MAX_EXPERTS = 4096           # one program holds a token's logits in registers
BLOCK = 1024                 # features a ``combine`` program sums


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
                                     num_warps=4, **FP_FUSION)
    return weights, ids


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
                                                    K=top_k, BLOCK=BLOCK, num_warps=4, **FP_FUSION)
    return out
