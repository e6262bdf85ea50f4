"""The Triton mixture kernels (kvslim/gpu/moe.py) against the torch forms of ``Router`` and
``SparseMoE``, on the CPU.

The kernels run under Triton's interpreter in one child process (tests/triton_harness.py), on
inputs that a test here rebuilds. The router: bf16 logits over 256 experts as a Qwen3.6-35B-A3B
layer has them (top 8, renormalised), float32 ones without renormalising, an expert count that
is not a power of two, and tied logits; the module's own forward with the kernels on. The sum:
top 8 and top 2, bf16 and float32, a width that is not a whole number of blocks, and a whole
mixture layer (router, shared expert and its gate fused, experts) with the kernels on.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import moe as gpu
from kvslim.gpu import available
from kvslim.models.layers import Router, SparseMoE

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

ROUTING = ("router_gemv", "topk_softmax", "gemv_experts_combined", "combine")     # launches the layer test counts
# (tokens, experts, top k, renormalise, dtype)
CASES = [(3, 256, 8, True, "bfloat16"), (5, 64, 4, False, "float32"), (2, 10, 3, True, "float32"),
         (4, 16, 2, True, "bfloat16")]


def _logits(case, seed: int) -> torch.Tensor:
    """Random logits, as the router's columns of a fused projection's output (rows strided, one
    more column for the shared expert's gate); the last case's tokens have their two largest
    logits tied."""
    n, n_experts, _, _, dtype = case
    fused = torch.randn(n, n_experts + 1, generator=torch.Generator().manual_seed(seed)) * 2
    logits = fused.to(getattr(torch, dtype))[:, 1:]
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
    """In the interpreted child (kernels on): each case's kernel output and the modules' forwards."""
    out = {"cases": [gpu.topk_softmax(_logits(c, i), c[2], c[3], getattr(torch, c[4])) for i, c in enumerate(cases)]}
    module, x = _router()
    out["module"] = gpu.runs_on(x), module(x)
    out["combine"] = [gpu.combine(*_combine_inputs(c, i)) for i, c in enumerate(COMBINE_CASES)]
    out["router gemv"] = [_router_gemv_runs(c, i) for i, c in enumerate(ROUTER_GEMV)]
    from kvslim.gpu import quant_matmul
    calls = []
    for module, name in ((gpu, "combine"), (quant_matmul, "gemv_experts_combined"), (quant_matmul, "gemv"),
                         (quant_matmul, "gemv_experts"), (quant_matmul, "gemv_mixture_down"), (gpu, "router_gemv"),
                         (gpu, "topk_softmax")):
        inner = getattr(module, name)
        setattr(module, name, lambda *a, _f=inner, _n=name, **k: calls.append(_n) or _f(*a, **k))
    shared, x = _mixture(quantized_shared=True)
    out["shared pair"] = shared(x), list(calls)                             # the shared expert among the pairs
    calls.clear()
    quant_matmul.SHARED_AS_PAIR = False
    out["shared apart"] = shared(x), list(calls)                            # its own two GEMVs
    calls.clear()
    layer, x = _mixture()
    out["layer"] = layer.fused is not None, layer(x), [c for c in calls if c in ROUTING]   # the combine in the GEMV
    calls.clear()
    quant_matmul.SUMS_IN_GEMV = False
    out["layer apart"] = layer(x), [c for c in calls if c in ROUTING]        # the combine launch
    calls.clear()
    out["layer prompt"] = layer(torch.randn(20, 64)), [c for c in calls if c in ROUTING]   # more than 16 tokens
    torch.save(out, path)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    return run_interpreted("tests.test_gpu_moe", "routed_in_child", CASES, tmp_path_factory.mktemp("router"))


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
    from kvslim.gpu import _moe_kernel as kernel
    pointers = {"logits_ptr": f"*{dtype}", "weights_ptr": f"*{dtype}", "ids_ptr": "*i64"}
    constexprs = dict(K=8, BLOCK_E=256, BLOCK_K=8, RENORMALIZE=True)
    assert compile_for_sm90(kernel.topk_softmax, pointers, constexprs, 4).asm["cubin"]


# the router's matmul and top-k in one launch: (tokens, experts, top k, renormalise, dtype, hidden)
ROUTER_GEMV = [(1, 256, 8, True, "bfloat16", 512), (3, 64, 4, False, "float32", 300), (16, 10, 3, True, "bfloat16", 96)]


def _router_gemv_inputs(case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H) and the fused matrix (1 + E, H): the shared expert's gate row, then the router's."""
    n, n_experts, _, _, dtype, hidden = case
    gen = torch.Generator().manual_seed(seed + 30)
    x = torch.randn(n, hidden, generator=gen).to(getattr(torch, dtype))
    return x, (torch.randn(1 + n_experts, hidden, generator=gen) * hidden ** -0.5).to(getattr(torch, dtype))


def _router_gemv_runs(case, seed: int, cuda: bool = False) -> list:
    """``router_gemv`` twice (its counters set back to 0 in between)."""
    x, weight = (t.cuda() if cuda else t for t in _router_gemv_inputs(case, seed))
    return [[t.cpu() for t in gpu.router_gemv(x, weight, 1, case[2], case[3])] for _ in range(2)]


def _check_router_gemv(case, runs: list, seed: int) -> None:
    """The two calls' bits the same; against the fused matmul (float32 sums, rounded to x's type)
    then the torch router: the same experts, and gate logits and weights within one rounding of
    their type (bf16) or float32 sums' error in another order (float32)."""
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    gate, weights, ids = runs[0]
    x, weight = _router_gemv_inputs(case, seed)
    n, _, top_k, renormalize, _, _ = case
    logits = torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
    sums = torch.nn.functional.linear(x.double().abs(), weight.double().abs())[:, :1]     # the gate's error scale
    ulp = torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 1e-5
    assert gate.shape == (n, 1) and gate.dtype == x.dtype
    assert ((gate.double() - logits[:, :1].double()).abs() <= ulp * logits[:, :1].double().abs() + 1e-6 * sums).all()
    assert ids.shape == weights.shape == (n, top_k) and ids.dtype == torch.int64 and weights.dtype == x.dtype
    assert torch.equal(ids, torch.sort(-logits[:, 1:].float(), dim=-1, stable=True).indices[:, :top_k])
    want = _torch_weights(logits[:, 1:], ids, renormalize, x.dtype).float()
    assert ((weights.float() - want).abs() <= ulp * want.abs() + 1e-7).all(), (weights.float() - want).abs().max()


@pytest.mark.parametrize("case", ROUTER_GEMV, ids=lambda c: f"t{c[0]}-e{c[1]}-k{c[2]}-h{c[5]}-{c[4]}")
def test_the_router_gemv_is_the_matmul_then_the_routing(routed, case):
    _check_router_gemv(case, routed["router gemv"][ROUTER_GEMV.index(case)], ROUTER_GEMV.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", ROUTER_GEMV, ids=lambda c: f"t{c[0]}-e{c[1]}-k{c[2]}-h{c[5]}-{c[4]}")
def test_the_router_gemv_on_cuda(case):
    compiled_process()
    _check_router_gemv(case, _router_gemv_runs(case, ROUTER_GEMV.index(case), cuda=True), ROUTER_GEMV.index(case))


def test_bad_router_gemv_calls_are_named():
    with pytest.raises(ValueError, match=r"x \(T <= 16, H\), weight \(G \+ E, H\)"):
        gpu.router_gemv(torch.zeros(17, 8), torch.zeros(5, 8), 1, 2, True)
    with pytest.raises(ValueError, match="0 < top_k <= E"):
        gpu.router_gemv(torch.zeros(2, 8), torch.zeros(5, 8), 1, 5, True)


def test_the_router_gemv_compiles_with_its_ordering():
    """A 35B-A3B decode step's routing launch (bf16, 256 experts and the gate, top 8) for sm_90:
    the barrier between the partial's store and the acq_rel atomic, the partials read from L2
    after it, the counter set back."""
    from kvslim.gpu import _moe_kernel as kernel
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "parts_ptr": "*fp32", "count_ptr": "*i32", "gate_ptr": "*bf16",
                "weights_ptr": "*bf16", "ids_ptr": "*i64"}
    constexprs = dict(gpu.ROUTER_TILE, GATES=1, K=8, BLOCK_E=256, BLOCK_G=1, BLOCK_K=8, RENORMALIZE=True)
    compiled = compile_for_sm90(kernel.router_gemv, pointers, constexprs, 4)
    ptx = compiled.asm["ptx"]
    counted = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "ld.global.cg" in ptx[counted:] and "atom.global.gpu.relaxed.exch" in ptx[counted:]
    assert ".local" not in ptx
    # the last program's sums, the gates' then the logits', each a wave of up to 8 splits
    # (``split_sums``), where it loaded and added a split at a time (the tail's SASS: 8 waits)
    from kvslim.gpu import cuobjdump, load_waves
    sass = cuobjdump(compiled, "-sass")
    assert load_waves(sass[sass.index("ATOMG.E.ADD"):]) <= 2


# (tokens, top k, features, dtype of the output and of the shared expert's)
COMBINE_CASES = [(3, 8, 64, "bfloat16"), (5, 2, 1500, "float32")]


def _combine_inputs(case, seed: int):
    """Weighted pair outputs (T k, H) float32, the shared expert's output and its gate's logit (a
    column of a wider matrix, as the fused gate and router matmul gives it), the output dtype."""
    n, top_k, hidden, dtype = case
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randn(n * top_k, hidden, generator=gen)
    shared = torch.randn(n, hidden, generator=gen).to(getattr(torch, dtype))
    gate = (torch.randn(n, 5, generator=gen) * 2).to(getattr(torch, dtype))[:, :1]
    return pairs, top_k, shared, gate, getattr(torch, dtype)


@pytest.mark.parametrize("case", COMBINE_CASES, ids=lambda c: f"k{c[1]}-h{c[2]}-{c[3]}")
def test_combine_sums_the_pairs_and_the_gated_shared_expert(routed, case):
    """Against float64: within one rounding of the output's type (plus float32 sums' ulps)."""
    got = routed["combine"][COMBINE_CASES.index(case)]
    pairs, top_k, shared, gate, dtype = _combine_inputs(case, COMBINE_CASES.index(case))
    n, hidden = shared.shape
    want = pairs.double().view(n, top_k, hidden).sum(1) + torch.sigmoid(gate.double()) * shared.double()
    scale = pairs.double().abs().view(n, top_k, hidden).sum(1) + shared.double().abs()
    assert got.dtype == dtype and got.shape == (n, hidden)
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    assert ((got.double() - want).abs() <= ulp * want.abs() + 1e-6 * scale).all(), (got.double() - want).abs().max()


def _mixture(seed: int = 5, quantized_shared: bool = False) -> tuple[SparseMoE, torch.Tensor]:
    """A float32 mixture layer (hidden 64, 8 experts of 32, top 2, shared expert of 48) with
    quantized experts (q8_0 gate_up, q4_0 down: the kernels' grouped path), fused as a load
    leaves it, and 3 tokens. ``quantized_shared``: a shared expert of 32, quantized as the
    experts are (the pairs' GEMVs can take it)."""
    from kvslim import weights as W
    from kvslim.weights.modules import QuantExperts, QuantLinear
    gen = torch.Generator().manual_seed(seed)
    layer = SparseMoE(64, 8, 2, 32, 32 if quantized_shared else 48)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    layer.experts = QuantExperts(W.QuantTensor.quantize(layer.experts.gate_up_proj, W.get("q8_0")),
                                 W.QuantTensor.quantize(layer.experts.down_proj, W.get("q4_0")))
    if quantized_shared:
        mlp = layer.shared_expert
        for name, kind in (("gate_proj", "q8_0"), ("up_proj", "q8_0"), ("down_proj", "q4_0")):
            setattr(mlp, name, QuantLinear(W.QuantTensor.quantize(getattr(mlp, name).weight.data, W.get(kind))))
        mlp.fuse_projections()
    layer.fuse_projections()
    return layer, torch.randn(3, 64, generator=gen)


def test_a_mixture_layer_takes_the_kernels_and_matches_the_torch_forms(routed):
    """The whole layer with the kernels on (the fused gate and router matmul with its routing in
    one launch, the experts' kernels, the combine in the down projection's GEMV) against the
    same layer's torch forms here, unfused too; with the combine launched apart (``SUMS_IN_GEMV``
    off), the same bits; a prompt of 20 tokens routes by the matmul and topk_softmax."""
    fused, got, calls = routed["layer"]
    apart, calls_apart = routed["layer apart"]
    assert fused and calls == ["router_gemv", "gemv_experts_combined"] and calls_apart == ["router_gemv", "combine"]
    assert routed["layer prompt"][1] == ["topk_softmax", "combine"]    # a prompt's: the matmul, then topk_softmax
    assert torch.equal(got, apart)
    layer, x = _mixture()
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSLIM_Q8_ACTIVATIONS", "0")            # the kernels multiply float activations
        want = layer(x)
        layer.fused = None
        unfused = layer(x)
    torch.testing.assert_close(want, unfused, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_shared_expert_joins_the_routed_pairs_and_matches_the_torch_forms(routed):
    """A mixture layer whose shared expert is quantized as its experts are, with the kernels on:
    the shared expert is one more pair a token in the routed experts' two GEMVs (no GEMV of its
    own), and the output is the torch forms' here; with ``SHARED_AS_PAIR`` off, its own two
    GEMVs and the combine in the down projection's, the same output within float32 sums' order."""
    got, calls = routed["shared pair"]
    apart, calls_apart = routed["shared apart"]
    assert calls == ["router_gemv", "gemv_experts", "gemv_mixture_down"]
    assert calls_apart == ["router_gemv", "gemv", "gemv", "gemv_experts", "gemv_experts_combined"]
    layer, x = _mixture(quantized_shared=True)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSLIM_Q8_ACTIVATIONS", "0")            # the kernels multiply float activations
        want = layer(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(apart, want, atol=1e-5, rtol=1e-4)


def test_bad_combine_shapes_are_named():
    with pytest.raises(ValueError, match=r"pairs \(T top_k, H\) float32"):
        gpu.combine(torch.zeros(5, 8), 2, torch.zeros(3, 8), torch.zeros(3, 1), torch.float32)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_combine_compiles_for_an_h100_without_one(dtype):
    """A 35B-A3B layer's sum (top 8), lowered for sm_90."""
    from kvslim.gpu import _moe_kernel as kernel
    pointers = {"pairs_ptr": "*fp32", "shared_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
    assert compile_for_sm90(kernel.combine, pointers, {"K": 8, "BLOCK": gpu.BLOCK}, 4).asm["cubin"]
