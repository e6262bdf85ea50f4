"""The Triton q/k norm and rotary embedding (kvslim/gpu/rope.py) against the torch forms, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py): a
gated layer's q (the first half of each head's 2D values, strided), Qwen3.5's zero-centred
norm and partial rotation (64 of 256 dims), a plain norm with full rotation, no norm, bf16 and
float32.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import rope as gpu
from kvslim.gpu import available
from kvslim.models.layers import RMSNorm, Rope, apply_rope

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (tokens, heads, head_dim, rotated fraction, norm: None / "plain" / "zero_centered", gated q?, dtype)
CASES = [(3, 4, 256, 0.25, "zero_centered", True, "bfloat16"), (2, 2, 64, 1.0, "plain", False, "float32"),
         (4, 3, 128, 0.5, None, False, "bfloat16"), (2, 2, 32, 1.0, "zero_centered", True, "float32")]


def _inputs(case, seed: int):
    """x (N, H, D) (for a gated q, a slice of (N, H, 2D)), the norm or None, cos and sin."""
    n, heads, dim, fraction, norm, gated, dtype = case
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    x = (torch.randn(n, heads, dim * (2 if gated else 1), generator=gen) * 3).to(dtype)[..., :dim]
    module = None
    if norm:
        module = RMSNorm(dim, 1e-6, zero_centered=norm == "zero_centered").to(dtype)
        with torch.no_grad():
            module.weight.copy_(torch.randn(dim, generator=gen) * 0.3 + (0 if norm == "zero_centered" else 1))
    cos, sin = Rope(dim, 10_000_000.0, fraction).tables(torch.randint(0, 40_000, (n,), generator=gen), dtype)
    return x, module, cos, sin


def rope_in_child(cases, path: Path) -> None:
    torch.save([gpu.norm_rope(*_inputs(c, i)) for i, c in enumerate(cases)], path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_rope", "rope_in_child", CASES, tmp_path_factory.mktemp("rope"))


def _check(case, got: torch.Tensor, seed: int) -> None:
    """Against the torch forms in float64 (the norm, then apply_rope): within a rounding or two
    of x's type (the inputs' own roundings aside: float32 inside, rounded once)."""
    x, norm, cos, sin = _inputs(case, seed)
    with torch.no_grad():
        if norm is not None:
            norm = norm.double()
        normed = x.double() if norm is None else norm(x.double())
        want = apply_rope(normed, cos.double(), sin.double())
    assert got.dtype == x.dtype and got.shape == x.shape
    ulp = 2 * torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 1e-5
    scale = normed.abs().amax(-1, keepdim=True)
    assert ((got.double() - want).abs() <= ulp * scale).all(), (got.double() - want).abs().max()


def _ids(c):
    return f"h{c[1]}-d{c[2]}-rot{c[3]}-{c[4]}-{'gated' if c[5] else 'plain'}-{c[6]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_norm_rope_matches_the_torch_forms(interpreted, case):
    _check(case, interpreted[CASES.index(case)], CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_norm_rope_on_cuda_matches_the_torch_forms(case):
    compiled_process()
    x, norm, cos, sin = _inputs(case, CASES.index(case))
    got = gpu.norm_rope(x.cuda(), None if norm is None else norm.cuda(), cos.cuda(), sin.cuda())
    _check(case, got.cpu(), CASES.index(case))


def test_bad_tables_are_named():
    with pytest.raises(ValueError, match=r"cos, sin \(N, rot <= D, even\)"):
        gpu.norm_rope(torch.zeros(2, 3, 8), None, torch.zeros(2, 10), torch.zeros(2, 10))


def test_norm_rope_compiles_for_an_h100_without_one():
    """Qwen3.6's attention heads: 256 values, 64 rotated, a zero-centred norm, bf16."""
    from kvslim.gpu import _rope_kernel as kernel
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16",
                "eps": "fp32"}
    constexprs = {"D": 256, "ROT": 64, "NORM": 2, "BLOCK_D": 256}
    assert compile_for_sm90(kernel.norm_rope, pointers, constexprs, 2).asm["cubin"]
