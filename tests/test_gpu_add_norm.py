"""The Triton residual add + RMSNorm (kvslim/gpu/add_norm.py) against the torch forms, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py):
bf16 rows as a decode step gives them (a zero-centred norm, Qwen3.5's 1 + w), float32 rows with
a plain weight, rows of the mixer's output at a stride wider than the hidden size, and a hidden
size that is not a power of two (the kernel's block is).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import add_norm as gpu
from kvslim.gpu import available
from kvslim.models.layers import RMSNorm

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (rows, hidden, dtype, zero-centred, delta's row stride or None)
CASES = [(3, 64, "bfloat16", True, None), (5, 96, "float32", False, None), (2, 200, "bfloat16", False, 256)]


def _inputs(case, seed: int):
    """x, delta (delta's rows at its stride) and a norm with a random weight."""
    rows, hidden, dtype, zero_centred, stride = case
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    x = (torch.randn(rows, hidden, generator=gen) * 4).to(dtype)
    wide = (torch.randn(rows, stride or hidden, generator=gen) * 2).to(dtype)
    norm = RMSNorm(hidden, 1e-6, zero_centred)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.3 + (0.0 if zero_centred else 1.0))
    return x, wide[:, :hidden], norm.to(dtype)


def add_norm_in_child(cases, path: Path) -> None:
    """In the interpreted child (kernels on): the kernel through RMSNorm.add_forward, which takes it."""
    out = []
    for i, case in enumerate(cases):
        x, delta, norm = _inputs(case, i)
        with torch.no_grad():
            out.append(norm.add_forward(x, delta))
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_add_norm", "add_norm_in_child", CASES, tmp_path_factory.mktemp("add_norm"))


def _check(case, got: tuple[torch.Tensor, torch.Tensor], seed: int) -> None:
    """The sum exactly torch's (one rounding of x + delta); the norm within two roundings of
    float64's norm of that sum (the torch forms round the normalised x and its product apart)."""
    x, delta, norm = _inputs(case, seed)
    normed, summed = got
    assert summed.dtype == normed.dtype == x.dtype and summed.shape == normed.shape == x.shape
    assert torch.equal(summed, x + delta)
    s = summed.double()
    weight = norm.weight.double() + (1.0 if norm.zero_centered else 0.0)
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps) * weight
    ulp = torch.finfo(x.dtype).eps
    assert ((normed.double() - want).abs() <= 2 * ulp * want.abs() + 1e-6).all(), (normed.double() - want).abs().max()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-h{c[1]}-{c[2]}-{'1+w' if c[3] else 'w'}")
def test_add_rms_norm_matches_the_torch_forms(interpreted, case):
    seed = CASES.index(case)
    _check(case, interpreted[seed], seed)
    x, delta, norm = _inputs(case, seed)
    with torch.no_grad():
        torch_normed, torch_summed = norm.add_forward(x, delta)       # here the kernels are off
    assert torch.equal(interpreted[seed][1], torch_summed)
    ulp = torch.finfo(x.dtype).eps
    assert ((interpreted[seed][0].double() - torch_normed.double()).abs()
            <= 2 * ulp * torch_normed.double().abs() + 1e-6).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-h{c[1]}-{c[2]}-{'1+w' if c[3] else 'w'}")
def test_add_rms_norm_on_cuda_matches_the_torch_forms(case):
    compiled_process()
    seed = CASES.index(case)
    x, delta, norm = _inputs(case, seed)
    weight = (norm.weight + 1.0) if norm.zero_centered else norm.weight
    with torch.no_grad():
        got = gpu.add_rms_norm(x.cuda(), delta.cuda(), weight.cuda(), norm.eps)
    _check(case, tuple(t.cpu() for t in got), seed)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="x and delta"):
        gpu.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 5), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        gpu.add_rms_norm(torch.zeros(4, 2).T, torch.zeros(4, 2).T, torch.ones(4), 1e-6)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_add_rms_norm_compiles_for_an_h100_without_one(dtype):
    from kvslim.gpu import _add_norm_kernel as kernel
    pointers = {"x_ptr": f"*{dtype}", "d_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "sum_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}", "eps": "fp32"}
    assert compile_for_sm90(kernel.add_rms_norm, pointers, {"BLOCK": 2048}, 8).asm["cubin"]
