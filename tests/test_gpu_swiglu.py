"""The Triton SwiGLU activation (kvslim/gpu/swiglu.py) against the torch form, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py): the
halves of a fused gate_up output (strided rows) in bf16, as the shared expert's MLP gives them,
float32 ones as the routed experts' kernel gives them, cast to bf16, and a width that is not a
whole number of the kernel's blocks.
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
    """In the interpreted child (kernels on): the kernel, and ``layers.swiglu``, which takes it."""
    out = []
    for i, case in enumerate(cases):
        gate, up = _halves(case, i)
        out.append((gpu.silu_mul(gate, up, getattr(torch, case[3])), swiglu(gate, up, getattr(torch, case[3]))))
    torch.save(out, path)


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
    kernel, through_layers = interpreted[CASES.index(case)]
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


def test_bad_halves_are_named():
    with pytest.raises(ValueError, match="gate and up"):
        gpu.silu_mul(torch.zeros(2, 4), torch.zeros(2, 5), torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        gpu.silu_mul(torch.zeros(4, 2).T, torch.zeros(4, 2).T, torch.float32)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_silu_mul_compiles_for_an_h100_without_one(dtype):
    from kvslim.gpu import _swiglu_kernel as kernel
    pointers = {"gate_ptr": f"*{dtype}", "up_ptr": f"*{dtype}", "out_ptr": "*bf16"}
    assert compile_for_sm90(kernel.silu_mul, pointers, {"BLOCK": gpu.BLOCK}, 4).asm["cubin"]
