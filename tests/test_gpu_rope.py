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


def _qk_inputs(case, seed: int):
    """q as ``_inputs`` gives it and a k of half its heads (at least 1), contiguous, with a norm
    of q's kind and its own weight, on q's tables."""
    q, q_norm, cos, sin = _inputs(case, seed)
    n, heads, dim, _, norm, _, _ = case
    k, k_norm, _, _ = _inputs((n, max(1, heads // 2), dim, case[3], norm, False, case[6]), seed + 10)
    return q, k, q_norm, k_norm, cos, sin


# rotary tables: (head_dim, theta, rotated fraction, scaling, largest position, tokens, dtype)
TABLES = [(256, 10_000_000.0, 0.25, None, 262_144, 5, "bfloat16"), (128, 10_000.0, 1.0, None, 40_000, 40, "float32"),
          (64, 500_000.0, 1.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131_072, 3,
           "bfloat16")]


def _table_inputs(case, seed: int) -> tuple[Rope, torch.Tensor]:
    dim, theta, fraction, scaling, top, n, _ = case
    positions = torch.randint(0, top, (n,), generator=torch.Generator().manual_seed(seed))
    return Rope(dim, theta, fraction, scaling), positions


def rope_in_child(cases, path: Path) -> None:
    out = [gpu.norm_rope(*_inputs(c, i)) for i, c in enumerate(cases)]
    out += [gpu.norm_rope_qk(*_qk_inputs(c, i)) for i, c in enumerate(cases)]
    tables = []
    for i, case in enumerate(TABLES):
        rope, positions = _table_inputs(case, i)
        tables.append(rope.tables(positions, getattr(torch, case[6])))        # the kernels on: one launch
    torch.save({"norm_rope": out, "tables": tables}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_rope", "rope_in_child", CASES, tmp_path_factory.mktemp("rope"))


def _check(case, got: torch.Tensor, seed: int) -> None:
    _check_tensor(got, *_inputs(case, seed))


def _check_tensor(got: torch.Tensor, x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Against the torch forms in float64 (the norm, then apply_rope): within a rounding or two
    of x's type (the inputs' own roundings aside: float32 inside, rounded once)."""
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
    _check(case, interpreted["norm_rope"][CASES.index(case)], CASES.index(case))


def _check_qk(case, got: tuple, seed: int) -> None:
    q, k, q_norm, k_norm, cos, sin = _qk_inputs(case, seed)
    _check_tensor(got[0], q, q_norm, cos, sin)
    _check_tensor(got[1], k, k_norm, cos, sin)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_q_and_k_in_one_launch_match_the_torch_forms(interpreted, case):
    """``norm_rope_qk``: q's heads and k's (fewer, contiguous, their own norm weight) in one
    launch, each against the torch forms with its own norm."""
    _check_qk(case, interpreted["norm_rope"][len(CASES) + CASES.index(case)], CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_q_and_k_in_one_launch_on_cuda(case):
    compiled_process()
    q, k, q_norm, k_norm, cos, sin = _qk_inputs(case, CASES.index(case))
    moved = [None if m is None else m.cuda() for m in (q_norm, k_norm)]
    got = gpu.norm_rope_qk(q.cuda(), k.cuda(), *moved, cos.cuda(), sin.cuda())
    _check_qk(case, [t.cpu() for t in got], CASES.index(case))


def _check_tables(case, got: tuple, seed: int) -> None:
    """The kernel's cos and sin against ``Rope.tables``' torch form here (float32 angles, then
    cos and sin, rounded to the type): within one rounding of bf16 (libraries' cos and sin may
    differ in their last float32 bit: numpy's and torch's do for a sixth of these values), or 2
    float32 ulps of 1."""
    rope, positions = _table_inputs(case, seed)
    want = rope.tables(positions, getattr(torch, case[6]))                # the kernels are off here
    tol = torch.finfo(torch.bfloat16).eps if case[6] == "bfloat16" else 2.4e-7
    for g, w in zip(got, want):
        assert g.shape == w.shape == (case[5], rope.rot_dim) and g.dtype == w.dtype
        assert ((g.float() - w.float()).abs() <= tol).all(), (g.float() - w.float()).abs().max()
        if case[6] == "bfloat16":                                          # rounded the same, nearly everywhere
            assert (g.float() == w.float()).float().mean() > 0.9


@pytest.mark.parametrize("case", TABLES, ids=lambda c: f"d{c[0]}-rot{c[2]}-{c[6]}{'-scaled' if c[3] else ''}")
def test_rope_tables_in_one_launch_match_the_torch_form(interpreted, case):
    _check_tables(case, interpreted["tables"][TABLES.index(case)], TABLES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", TABLES, ids=lambda c: f"d{c[0]}-rot{c[2]}-{c[6]}{'-scaled' if c[3] else ''}")
def test_rope_tables_on_cuda(case):
    compiled_process()
    rope, positions = _table_inputs(case, TABLES.index(case))
    inv_freq = rope.inv_freq.cuda()
    got = gpu.tables(positions.cuda(), inv_freq, getattr(torch, case[6]))
    _check_tables(case, [t.cpu() for t in got], TABLES.index(case))


def test_q_and_k_of_other_kinds_are_not_paired():
    """Norms of two kinds (or one missing), or two types: two launches, and the pair refused by name."""
    q, k = torch.zeros(2, 4, 64), torch.zeros(2, 2, 64)
    plain, centred = RMSNorm(64, 1e-6), RMSNorm(64, 1e-6, zero_centered=True)
    assert gpu.pairs(q, k, plain, RMSNorm(64, 1e-6)) and gpu.pairs(q, k, None, None)
    assert not gpu.pairs(q, k, plain, centred) and not gpu.pairs(q, k, plain, None)
    assert not gpu.pairs(q, k.bfloat16(), None, None)
    with pytest.raises(ValueError, match="norms of one kind"):
        gpu.norm_rope_qk(q, k, plain, centred, torch.zeros(2, 64), torch.zeros(2, 64))


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
    pointers.update(k_ptr="*bf16", k_w_ptr="*bf16", k_out_ptr="*bf16")
    constexprs = {"D": 256, "ROT": 64, "NORM": 2, "BLOCK_D": 256}
    compiled = compile_for_sm90(kernel.norm_rope, pointers, constexprs, 2,
                                ("row_stride", "head_stride", "table_stride", "k_row_stride", "k_head_stride"))
    # every load issued before the norm's sum and its barrier (Triton 3.9: one wait on memory;
    # 3.6 waits on x first, the rest arriving during the sum); issued after it, the weights',
    # the partners' and the tables' loads were a second round trip
    from kvslim.gpu import cuobjdump
    sass = cuobjdump(compiled, "-sass")
    assert sass.count("LDG") == sass[:sass.index("BAR.SYNC")].count("LDG") > 0
    tables = {"positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16"}
    assert compile_for_sm90(kernel.rope_tables, tables, {"HALF": 32, "BLOCK_N": 16, "BLOCK_F": 32}, 1).asm["cubin"]
