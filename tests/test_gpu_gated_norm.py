"""The Triton gated norm (kvslim/gpu/gated_norm.py) against the DeltaNet layers' torch form, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py): bf16
x and a z sliced out of a fused projection's output (rows strided, heads contiguous), as a
DeltaNet layer hands them over at -np > 1 or in a prompt; float32 ones; a head width that is
not a power of two and more heads than one program takes. Each head gets its own scale, so a
norm taken over the wrong columns shows.
"""
from __future__ import annotations

import pytest
import torch

from kvslim.gpu import available
from kvslim.gpu import gated_norm as gpu
from kvslim.models.layers import RMSNormGated

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (rows, heads, width, dtype); widths past TILE // 2 make several programs a row
CASES = [(3, 4, 64, "bfloat16"), (2, 5, 40, "float32"), (2, 40, 128, "bfloat16")]
EPS = 1e-6


def _inputs(case, seed: int):
    """The layer's norm (weight near 1), its x (R, H, D), every head at its own scale, and z:
    the (R, H, D) slice of a (R, H*D + 9) fused projection output."""
    rows, heads, width, dtype = case
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNormGated(width, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(width, generator=gen))
    scales = torch.logspace(-1, 1, heads)[None, :, None]
    x = (torch.randn(rows, heads, width, generator=gen) * scales).to(getattr(torch, dtype))
    fused = (torch.randn(rows, heads * width + 9, generator=gen) * 2).to(getattr(torch, dtype))
    z = fused[:, 7:7 + heads * width].view(rows, heads, width)
    return norm, x, z


def norms_in_child(cases, path) -> None:
    """In the interpreted child (kernels on): the kernel, and the layer's norm, which takes it."""
    out = []
    for seed, case in enumerate(cases):
        norm, x, z = _inputs(case, seed)
        with torch.no_grad():
            out.append((gpu.gated_rms_norm(x, z, norm.weight, EPS), norm(x, z)))
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_gated_norm", "norms_in_child", CASES, tmp_path_factory.mktemp("norm"))


def _check(case, got: torch.Tensor, seed: int) -> None:
    """got against the float64 form within one rounding of its type, and against the layer's
    torch form (rounds the norm, then the product) within two bf16 ulps."""
    norm, x, z = _inputs(case, seed)
    xd, zd = x.double(), z.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * norm.weight.double() * torch.nn.functional.silu(zd)
    assert got.dtype == z.dtype and got.shape == want.shape and got.is_contiguous()
    ulp = torch.finfo(got.dtype).eps if got.dtype != torch.float32 else 1e-6
    assert ((got.double() - want).abs() <= ulp * want.abs() + 1e-6).all(), (got.double() - want).abs().max()
    with torch.no_grad():
        torch_form = norm(x, z)                                     # here the kernels are off
    bf16 = torch.finfo(torch.bfloat16).eps
    assert ((got.double() - torch_form.double()).abs() <= 2 * bf16 * torch_form.double().abs() + 1e-6).all()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-h{c[1]}-d{c[2]}-{c[3]}")
def test_gated_rms_norm_matches_the_layers_norm(interpreted, case):
    kernel, through_layer = interpreted[CASES.index(case)]
    _check(case, kernel, CASES.index(case))
    assert torch.equal(through_layer, kernel)                       # the layer takes it with the kernels on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-h{c[1]}-d{c[2]}-{c[3]}")
def test_gated_rms_norm_on_cuda_matches_the_layers_norm(case):
    compiled_process()
    norm, x, z = _inputs(case, CASES.index(case))
    _check(case, gpu.gated_rms_norm(x.cuda(), z.cuda(), norm.weight.cuda(), EPS).cpu(), CASES.index(case))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="x and z"):
        gpu.gated_rms_norm(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="contiguous heads"):
        gpu.gated_rms_norm(torch.zeros(2, 4, 3).transpose(1, 2), torch.zeros(2, 3, 4), torch.ones(4), EPS)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gated_rms_norm_compiles_for_an_h100_without_one(dtype):
    from kvslim.gpu import _gated_norm_kernel as kernel
    pointers = {"x_ptr": f"*{dtype}", "z_ptr": f"*{dtype}", "w_ptr": "*fp32", "out_ptr": f"*{dtype}", "eps": "fp32"}
    assert compile_for_sm90(kernel.gated_rms_norm, pointers, {"BLOCK_H": 16, "BLOCK_D": 128}, 4).asm["cubin"]
