"""A mixture's routing in one Triton launch: ``Router``'s softmax, top-k and renormalisation.

The torch form (``kvslim.models.layers.Router``, the reference) launches about six kernels a
layer in a decode step (the float copy and softmax, topk, the sum and division, the cast back);
a 35B-A3B step has 40 of them. ``topk_softmax`` gives the same weights and ids from the router
logits in one (``_router_kernel``); tests/test_gpu_router.py holds it to the torch form under
Triton's interpreter.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from . import FP_FUSION, available, pow2
from . import runs_on as gpu_runs_on

MAX_EXPERTS = 4096           # one program holds a token's logits in registers


@lru_cache(maxsize=None)
def _kernel():
    from . import _router_kernel                        # imports triton: only when a kernel runs
    return _router_kernel


def runs_on(logits: torch.Tensor) -> bool:
    """Whether the kernel can route these logits here (``kvslim.gpu.runs_on``)."""
    return available() and logits.shape[-1] <= MAX_EXPERTS and gpu_runs_on(_kernel(), logits.device)


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
        _kernel().topk_softmax[(n,)](logits.contiguous(), weights, ids, n_experts, K=top_k, BLOCK_E=pow2(n_experts),
                                     BLOCK_K=pow2(top_k), RENORMALIZE=renormalize, num_warps=4, **FP_FUSION)
    return weights, ids
