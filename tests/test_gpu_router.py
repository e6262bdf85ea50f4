"""The Triton router (kvslim/gpu/router.py) against the torch form of ``Router``, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py), on
logits that a test here rebuilds: bf16 logits over 256 experts as a Qwen3.6-35B-A3B layer has
them (top 8, renormalised), float32 ones without renormalising, an expert count that is not a
power of two, and tied logits. The module's own forward is run there too, with the kernels on.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import router as gpu
from kvslim.models.layers import Router

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not gpu.available(), reason="triton is not installed: no GPU kernel to check")

# (tokens, experts, top k, renormalise, dtype)
CASES = [(3, 256, 8, True, "bfloat16"), (5, 64, 4, False, "float32"), (2, 10, 3, True, "float32"),
         (4, 16, 2, True, "bfloat16")]


def _logits(case, seed: int) -> torch.Tensor:
    """Random logits; the last case's tokens have their two largest logits tied."""
    n, n_experts, _, _, dtype = case
    logits = (torch.randn(n, n_experts, generator=torch.Generator().manual_seed(seed)) * 2).to(getattr(torch, dtype))
    if case == CASES[-1]:                          # (compared by value: the child's cases are copies)
        top = logits.argmax(-1)
        logits[torch.arange(n), (top + 1) % n_experts] = logits[torch.arange(n), top]
    return logits


def _router(seed: int = 7) -> tuple[Router, torch.Tensor]:
    """A 64-expert router over hidden 32 (top 4, renormalised) and bf16 inputs for 3 tokens."""
    gen = torch.Generator().manual_seed(seed)
    module = Router(32, 64, 4, True).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64, 32, generator=gen))
    return module, torch.randn(3, 32, generator=gen).to(torch.bfloat16)


def routed_in_child(cases, path: Path) -> None:
    """In the interpreted child (kernels on): each case's kernel output and the module's forward."""
    out = {"cases": [gpu.topk_softmax(_logits(c, i), c[2], c[3], getattr(torch, c[4])) for i, c in enumerate(cases)]}
    module, x = _router()
    out["module"] = gpu.runs_on(x), module(x)
    torch.save(out, path)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    return run_interpreted("tests.test_gpu_router", "routed_in_child", CASES, tmp_path_factory.mktemp("router"))


def _torch_weights(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool, dtype) -> torch.Tensor:
    """``Router``'s weights for the chosen ids: the softmax in float32, renormalised, cast."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    return (probs / probs.sum(-1, keepdim=True) if renormalize else probs).to(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"e{c[1]}-k{c[2]}-{'renorm' if c[3] else 'probs'}-{c[4]}")
def test_topk_softmax_matches_the_torch_router(routed, case):
    """Under the interpreter (which breaks ties to the lower id whatever the kernel asks: the
    CUDA test below checks that the compiled kernel does too): ``_check``."""
    _check(case, *routed["cases"][CASES.index(case)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"e{c[1]}-k{c[2]}-{'renorm' if c[3] else 'probs'}-{c[4]}")
def test_topk_softmax_on_cuda_matches_the_torch_router(case):
    compiled_process()
    weights, ids = gpu.topk_softmax(_logits(case, CASES.index(case)).cuda(), case[2], case[3], getattr(torch, case[4]))
    _check(case, weights.cpu(), ids.cpu())


def _check(case, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """The chosen experts are the top k by logit in descending order, ties to the lower id (as
    a stable sort orders them); the weights are the torch form's for those ids,
    within one rounding of their type (float32 sums in another order)."""
    logits = _logits(case, CASES.index(case))
    n, n_experts, top_k, renormalize, dtype = case
    assert weights.shape == ids.shape == (n, top_k) and ids.dtype == torch.int64
    assert weights.dtype == getattr(torch, dtype)
    # descending logits, ties to the lower id: a stable sort; torch.topk's own order of ties is unspecified
    assert torch.equal(ids, torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :top_k])
    if case == CASES[-1]:                                                        # the tie was there
        assert (logits.float().gather(1, ids[:, :2]).diff(dim=-1) == 0).all()
    else:
        assert torch.equal(logits.float().gather(1, ids), torch.topk(logits.float(), top_k, dim=-1).values)
    want = _torch_weights(logits, ids, renormalize, weights.dtype).float()
    ulp = torch.finfo(weights.dtype).eps
    assert ((weights.float() - want).abs() <= ulp * want.abs() + 1e-7).all(), (weights.float() - want).abs().max()
    if renormalize:
        assert torch.allclose(weights.float().sum(-1), torch.ones(n), atol=top_k * ulp)


def test_the_router_module_takes_the_kernel_with_the_kernels_on(routed):
    """With the kernels on, ``Router.forward`` routes through ``topk_softmax``: the torch form's
    experts, and weights within one rounding of bf16."""
    ran, (weights, ids) = routed["module"]
    assert ran
    module, x = _router()
    with torch.no_grad():
        want_weights, want_ids = module(x)                    # the kernels are off here: the torch form
    assert torch.equal(ids, want_ids) and weights.dtype == want_weights.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps
    assert ((weights.float() - want_weights.float()).abs() <= ulp * want_weights.float().abs()).all()


def test_bad_routing_shapes_are_named():
    with pytest.raises(ValueError, match="0 < top_k <= E"):
        gpu.topk_softmax(torch.zeros(2, 4), 5, True, torch.float32)
    with pytest.raises(ValueError, match=r"logits \(T, E\)"):
        gpu.topk_softmax(torch.zeros(4), 2, True, torch.float32)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_topk_softmax_compiles_for_an_h100_without_one(dtype):
    """The launch a 35B-A3B decode step makes (256 experts, top 8), lowered for sm_90."""
    from kvslim.gpu import _router_kernel as kernel
    pointers = {"logits_ptr": f"*{dtype}", "weights_ptr": f"*{dtype}", "ids_ptr": "*i64"}
    constexprs = dict(K=8, BLOCK_E=256, BLOCK_K=8, RENORMALIZE=True)
    assert compile_for_sm90(kernel.topk_softmax, pointers, constexprs, 4).asm["cubin"]
