"""The Triton SwiGLU activation (kvslim/gpu/swiglu.py) against the torch form, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py): the
halves of a fused gate_up output (strided rows) in bf16, as the shared expert's MLP gives them,
float32 ones as the routed experts' kernel gives them, cast to bf16, and a width that is not a
whole number of the kernel's blocks; and gated attention's output gate, the gate's columns strided
by row and by head as the query projection leaves them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import swiglu as gpu
from kvslim.gpu import available
from kvslim.models.layers import swiglu

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (rows, width, input dtype, output dtype)
CASES = [(3, 64, "bfloat16", "bfloat16"), (6, 40, "float32", "bfloat16"), (2, 1500, "float32", "float32")]


def _halves(case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up: the two halves of one (rows, 2 width) tensor, values up to about +-8."""
    rows, width, dtype, _ = case
    joint = (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(seed)) * 3).to(getattr(torch, dtype))
    return joint.chunk(2, dim=-1)


def swiglu_in_child(cases, path: Path) -> None:
    """In the interpreted child (kernels on): the kernel, and ``layers.swiglu``, which takes it;
    then the output gate of GATES."""
    out = []
    for i, case in enumerate(cases):
        gate, up = _halves(case, i)
        out.append((gpu.silu_mul(gate, up, getattr(torch, case[3])), swiglu(gate, up, getattr(torch, case[3]))))
    gates = [gpu.sigmoid_mul(*_gated_output(case, seed), getattr(torch, case[4])) for seed, case in enumerate(GATES)]
    torch.save({"swiglu": out, "gates": gates}, path)


# gated attention's output: (tokens, heads, head_dim, gate dtype, output dtype)
GATES = [(3, 4, 64, "bfloat16", "bfloat16"), (2, 3, 40, "float32", "float32")]


def _gated_output(case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate as the gated query projection leaves it, each head's second half of (N, H, 2D)
    (rows and heads strided), and the attention's float32 output (N, H, D)."""
    n, heads, dim, dtype, _ = case
    gen = torch.Generator().manual_seed(10 + seed)
    q = (torch.randn(n, heads, 2 * dim, generator=gen) * 3).to(getattr(torch, dtype))
    return q[..., dim:], torch.randn(n, heads, dim, generator=gen) * 2


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_swiglu", "swiglu_in_child", CASES, tmp_path_factory.mktemp("swiglu"))


def _check(case, got: torch.Tensor, seed: int) -> None:
    """got against silu(gate) * up in float64: within one rounding of its type (bf16 inputs: the
    torch form rounds silu(gate) and the product, the kernel once)."""
    gate, up = _halves(case, seed)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    assert got.dtype == getattr(torch, case[3]) and got.shape == want.shape
    ulp = torch.finfo(got.dtype).eps if got.dtype != torch.float32 else 1e-6
    assert ((got.double() - want).abs() <= ulp * want.abs() + 1e-6).all(), (got.double() - want).abs().max()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-w{c[1]}-{c[2]}-to-{c[3]}")
def test_silu_mul_matches_the_torch_form(interpreted, case):
    kernel, through_layers = interpreted["swiglu"][CASES.index(case)]
    _check(case, kernel, CASES.index(case))
    assert torch.equal(through_layers, kernel)                      # the layers take it with the kernels on
    gate, up = _halves(case, CASES.index(case))
    torch_form = swiglu(gate, up, getattr(torch, case[3]))        # here the kernels are off
    bf16 = torch.finfo(torch.bfloat16).eps
    assert ((kernel.double() - torch_form.double()).abs() <= 2 * bf16 * torch_form.double().abs() + 1e-6).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-w{c[1]}-{c[2]}-to-{c[3]}")
def test_silu_mul_on_cuda_matches_the_torch_form(case):
    compiled_process()
    gate, up = _halves(case, CASES.index(case))
    _check(case, gpu.silu_mul(gate.cuda(), up.cuda(), getattr(torch, case[3])).cpu(), CASES.index(case))


def _check_gate(case, got: torch.Tensor, seed: int) -> None:
    """got against x * sigmoid(gate) in float64, within one rounding of its type; and against the
    attention layer's torch form (cast, sigmoid, product: three roundings) within two bf16 ulps."""
    gate, x = _gated_output(case, seed)
    want = x.double() * torch.sigmoid(gate.double())
    assert got.dtype == getattr(torch, case[4]) and got.shape == want.shape
    ulp = torch.finfo(got.dtype).eps if got.dtype != torch.float32 else 1e-6
    assert ((got.double() - want).abs() <= ulp * want.abs() + 1e-6).all(), (got.double() - want).abs().max()
    torch_form = x.to(got.dtype) * torch.sigmoid(gate)
    bf16 = torch.finfo(torch.bfloat16).eps
    assert ((got.double() - torch_form.double()).abs() <= 2 * bf16 * torch_form.double().abs() + 1e-6).all()


@pytest.mark.parametrize("case", GATES, ids=lambda c: f"n{c[0]}-h{c[1]}-d{c[2]}-{c[3]}")
def test_sigmoid_mul_matches_the_gated_attention_output(interpreted, case):
    _check_gate(case, interpreted["gates"][GATES.index(case)], GATES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", GATES, ids=lambda c: f"n{c[0]}-h{c[1]}-d{c[2]}-{c[3]}")
def test_sigmoid_mul_on_cuda_matches_the_gated_attention_output(case):
    compiled_process()
    gate, x = _gated_output(case, GATES.index(case))
    _check_gate(case, gpu.sigmoid_mul(gate.cuda(), x.cuda(), getattr(torch, case[4])).cpu(), GATES.index(case))


def test_bad_halves_are_named():
    with pytest.raises(ValueError, match="gate and up"):
        gpu.silu_mul(torch.zeros(2, 4), torch.zeros(2, 5), torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        gpu.silu_mul(torch.zeros(4, 2).T, torch.zeros(4, 2).T, torch.float32)


@pytest.mark.parametrize("dtype,act", [("bf16", "silu"), ("fp32", "silu"), ("bf16", "sigmoid")])
def test_act_mul_compiles_for_an_h100_without_one(dtype, act):
    from kvslim.gpu import _swiglu_kernel as kernel
    pointers = {"gate_ptr": f"*{dtype}", "up_ptr": f"*{dtype}", "out_ptr": "*bf16"}
    assert compile_for_sm90(kernel.act_mul, pointers, {"BLOCK": gpu.BLOCK, "ACT": act}, 4).asm["cubin"]
