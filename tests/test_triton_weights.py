"""The Triton quantized GEMV/GEMM (kvslim/gpu/quant_matmul.py) against gguf.quants, on the CPU.

Weights are GGUF blocks: Q8_0 and Q4_0 from ``gguf.quants.quantize``; the K-quants, the grid
i-quants, MXFP4 and NVFP4 random bytes with sane fp16 super-scales (MXFP4: exponents near 1, some
subnormal; NVFP4: each of the 256 e4m3 scale bytes in turn), so every code, grid index, sign,
scale and min pattern occurs. The reference is ``gguf.quants.dequantize`` then a float64 matmul,
and each type's values themselves, bit for bit (the exact GEMM of an identity). The kernels run
under Triton's interpreter in one child process (tests/triton_harness.py); the references run
here. What the interpreter cannot check (bf16 tl.dot, which it computes wrongly; compilation;
tf32; speed) is left to the sm_90 compile tests and the CUDA test.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvslim import weights
from kvslim.gpu import available
from kvslim.gpu import quant_matmul as gpu
from kvslim.weights import QuantTensor

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

TYPES = ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs",
         "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "mxfp4", "nvfp4"]
# blocks of 32, 64 (NVFP4) or 256 values; 288 and 320: not whole GEMV steps of 128 or 256
COLS = {t: {32: 288, 64: 320}.get(weights.get(t).block_size, 512) for t in TYPES}
# ("gemv", type, M, N, K, split_k or None) and ("gemm", type, M, N, K, dot)
GEMV_SHAPES = ((1, 64, None), (5, 40, None), (16, 33, 1))
GRID_TYPES = TYPES[TYPES.index("iq2_xxs"):]            # the grid i-quants, MXFP4 and NVFP4
# the grid types take one GEMV shape each, in turn (their values are checked bit for bit below),
# but NVFP4, the one type of 64-value blocks, takes all three
ROTATED = [t for t in GRID_TYPES if t != "nvfp4"]
GEMV = [("gemv", t, m, n, COLS[t], split) for t in TYPES if t not in ROTATED for m, n, split in GEMV_SHAPES]
GEMV += [("gemv", t, m, n, COLS[t], split) for t, (m, n, split) in zip(ROTATED, GEMV_SHAPES * 3)]
# the per-value tile of the types that the GEMV reads block by block (their twin path)
PER_VALUE = [("per-value gemv", t.name.lower(), 5, 40, COLS[t.name.lower()], None) for t in gpu.BLOCKWISE]
GEMM = [("gemm", t, m, n, COLS[t], dot) for t in TYPES for m, n, dot in ((33, 64, "ieee"), (40, 40, "fp16"))]
GEMM += [("gemm", "q6_k", 130, 32, 256, "ieee")]                       # two M tiles of 128
GEMM += [("gemm", "q4_0", 20, 48, COLS["q4_0"], "fp16")]                 # 32 rows a tile: Q4_0's exact codes
# ("values", type, K, N, K, "ieee"): the exact GEMM of the K x K identity gives W's values themselves
VALUES = [("values", t, 256, 32, 256, "ieee") for t in TYPES]
# ("linear", type, x's leading shape, N, K, bias?, reordered columns?)
LINEAR = [("linear", "q4_k", (1, 1), 48, 256, False, False), ("linear", "q8_0", (2, 9), 32, 256, True, False),
          ("linear", "q5_k", (3,), 32, 256, True, True)]
# ("rounded", type, M, N, K, split_k): bf16 x, y stored in bf16 by the kernel against its float32 y
ROUNDED = [("rounded", "q4_0", 1, 64, 288, 1), ("rounded", "q4_k", 1, 40, 512, None),
           ("rounded", "q6_k", 5, 33, 512, 1), ("rounded", "q8_0", 33, 40, 288, None)]
# of sum |x||w|: float32 sums, then one rounding of x and one of w to the dot's type (tf32 truncates)
# SwiGLU from a fused [gate; up] matrix: (kind, type, M, 2I, K, split_k; out dtype): one split (the
# GEMV's epilogue), several (the split sums'), the per-value tile's type, M = 1's TERMS path, and
# 41 rows (the GEMM, then silu_mul)
SWIGLU = [("swiglu", "q4_0", 1, 48, 288, 1, "float32"), ("swiglu", "q4_0", 5, 40, 288, 3, "bfloat16"),
          ("swiglu", "q4_k", 1, 32, 512, None, "bfloat16"), ("swiglu", "iq4_xs", 3, 24, 512, 1, "float32"),
          ("swiglu", "q8_0", 41, 32, 288, None, "float32")]
# A split GEMV's partials summed by each tile's last program: (kind, type, M, N or 2I, K, split_k,
# swiglu?, out dtype), computed twice that way (the counters set back to 0 in between) and once
# by the ``sum_splits`` launch
SUMS = [("sums", "q4_0", 1, 16, 1024, 4, False, "float32"), ("sums", "q4_k", 5, 16, 768, 3, False, "float32"),
        ("sums", "q6_k", 1, 16, 768, 3, True, "bfloat16"), ("sums", "q8_0", 16, 18, 288, 2, True, "float32")]
# Q4_0 at one row with x rounded to 8 bits (``q8``): (kind, type, M, N or 2I, K, split_k, swiglu?,
# out dtype); x's second block all zeros (its scale 0)
Q8 = [("q8", "q4_0", 1, 64, 1024, None, False, "float32"), ("q8", "q4_0", 1, 40, 288, 1, False, "bfloat16"),
      ("q8", "q4_0", 1, 48, 512, None, True, "bfloat16"), ("q8", "q4_0", 1, 64, 512, 1, True, "float32"),
      ("q8", "q4_k", 1, 64, 1024, None, False, "bfloat16"), ("q8", "q4_k", 1, 48, 512, 1, True, "float32"),
      ("q8", "q6_k", 1, 40, 1024, None, False, "bfloat16"), ("q8", "q6_k", 1, 32, 512, 1, True, "float32"),
      ("q8 linear", "q4_0", 1, 32, 256, None, False, "float32"),    # quant_linear with Q8_ACTIVATIONS on
      ("q8 nan", "q4_k", 1, 32, 512, 1, False, "float32")]           # a NaN in x: NaN out, not dropped
# a mixer's output projection with the residual add and norm in its launch: (kind, type, M, N, K,
# split_k, sums by the last program?, dtype of x, y and the residual)
ADD_NORM = [("add norm", "q4_0", 1, 64, 1024, None, True, "bfloat16"), ("add norm", "q4_k", 3, 40, 512, 1, True,
                                                                         "float32"),
            ("add norm", "q8_0", 2, 24, 288, 2, True, "bfloat16"), ("add norm", "q6_k", 1, 32, 768, 3, False,
                                                                     "float32")]
TOLERANCE = {"ieee": 1e-5, "tf32": 4e-3, "fp16": 2e-3, "bf16": 1e-2}


def _weight(name: str, n: int, k: int, seed: int) -> QuantTensor:
    """An (n, k) matrix of ``name`` blocks."""
    wtype = weights.get(name)
    gen = np.random.default_rng(seed)
    if name in ("q8_0", "q4_0"):
        raw = gguf.quants.quantize(gen.standard_normal((n, k), dtype=np.float32), wtype.ggml_type)
    else:                                            # random codes and small scales; fp16 scales set below
        raw = gen.integers(0, 256, (n * k // wtype.block_size, wtype.block_bytes), dtype=np.uint8)
        at = 0
        for field, size in wtype.fields:
            if field in ("d", "dmin"):
                scale = gen.uniform(0.002, 0.02, raw.shape[0]).astype(np.float16)
                raw[:, at:at + size] = scale.view(np.uint8).reshape(-1, 2)
            elif name == "iq1_m" and field == "scales":         # its d: the top nibbles of the 4 scale words
                scale = gen.uniform(0.002, 0.02, raw.shape[0]).astype(np.float16).view(np.uint16)
                for word in range(4):
                    top = ((scale >> (4 * word)) & 0x0F).astype(np.uint8)
                    raw[:, at + 2 * word + 1] = (raw[:, at + 2 * word + 1] & 0x0F) | (top << 4)
            elif field == "e":                                  # MXFP4: 2^(e - 128) from 2^-9 to 2; e < 2 subnormal
                raw[:, at] = gen.integers(119, 130, raw.shape[0])
                raw[::7, at] = gen.integers(0, 2, raw[::7].shape[0])
            elif name == "nvfp4" and field == "scales":        # e4m3: every byte in turn (0, 0x7F, subnormals, bit 7)
                raw[:, at:at + size] = gen.permutation(np.arange(raw.shape[0] * size) % 256).reshape(-1, size)
            at += size
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw).reshape(n, -1)), wtype, k)


def _inputs(case, seed: int):
    """The case's weight and x (float32, M rows) and, for ``linear``, bias and column order."""
    kind, name, lead, n, k = case[:5]
    w = _weight(name, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.eye(k) if kind == "values" else torch.randn(*(lead if kind == "linear" else (lead,)), k, generator=gen)
    bias = torch.randn(n, generator=gen) if kind == "linear" and case[5] else None
    if kind == "linear" and case[6]:
        w = w.index_select(1, torch.randperm(k, generator=gen))      # columns no longer whole blocks
    return w, x, bias


def _run(case, x, w, bias):
    if case[0] == "rounded":                                    # (bf16 y, float32 y, quant_linear's y)
        x = x.to(torch.bfloat16)
        ys = [gpu.gemv(x, w.data, w.wtype.ggml_type, split_k=case[5], out_dtype=dtype) if case[2] <= gpu.MAX_GEMV_ROWS
              else gpu.gemm(x, w.data, w.wtype.ggml_type, dot="ieee", out_dtype=dtype)
              for dtype in (torch.bfloat16, torch.float32)]
        decode = case[5] is None and case[2] <= gpu.MAX_GEMV_ROWS      # (a bf16 GEMM's tl.dot: not in the interpreter)
        return ys + [weights.quant_linear(x, w) if decode else None]
    if case[0] == "swiglu":
        return gpu.matmul(x, w.data, w.wtype.ggml_type, dot="ieee", out_dtype=getattr(torch, case[6]), swiglu=True) \
            if case[5] is None else gpu.gemv(x, w.data, w.wtype.ggml_type, split_k=case[5],
                                             out_dtype=getattr(torch, case[6]), swiglu=True)
    if case[0] == "q8 linear":
        x = x.clone()
        x[:, 32:64] = 0
        before, gpu.Q8_ACTIVATIONS = gpu.Q8_ACTIVATIONS, True
        try:
            return weights.quant_linear(x, w)
        finally:
            gpu.Q8_ACTIVATIONS = before
    if case[0] in ("q8", "q8 nan"):
        x = x.clone()
        x[:, 32:64] = 0
        if case[0] == "q8 nan":
            x[:, 300] = float("nan")
        return gpu.gemv(x, w.data, w.wtype.ggml_type, split_k=case[5], swiglu=case[6], out_dtype=getattr(torch, case[7]),
                        q8=True)
    if case[0] == "sums":
        return [gpu.gemv(x, w.data, w.wtype.ggml_type, split_k=case[5], swiglu=case[6], out_dtype=getattr(torch, case[7]),
                         last_sums=last) for last in (True, True, False)]
    if case[0] == "add norm":
        return _add_norm_runs(case, x, w)
    if case[0] in ("gemv", "per-value gemv"):
        return gpu.gemv(x, w.data, w.wtype.ggml_type, split_k=case[5], blockwise=case[0] == "gemv")
    if case[0] in ("gemm", "values"):
        return gpu.gemm(x, w.data, w.wtype.ggml_type, dot=case[5])
    return weights.quant_linear(x, w, bias)               # its float32 GEMM is exact ("ieee") at torch's default


def _results_in_child(cases, path: Path) -> None:
    """In the interpreted child: every case's output, and what ``runs_on`` says of CPU tensors."""
    out = {"y": [], "runs_on_cpu": gpu.runs_on(torch.zeros(1))}
    for i, case in enumerate(cases):
        w, x, bias = _inputs(case, i)
        out["y"].append(_run(case, x, w, bias))
    torch.save(out, path)


CASES = GEMV + PER_VALUE + GEMM + VALUES + LINEAR + ROUNDED + SWIGLU + SUMS + Q8 + ADD_NORM


def _add_norm_runs(case, x: torch.Tensor, w: QuantTensor, cuda: bool = False) -> list:
    """The GEMV with the add and norm in its launch, twice, then the GEMV and ``add_rms_norm``."""
    from kvslim.gpu.add_norm import add_rms_norm
    move = (lambda t: t.cuda()) if cuda else (lambda t: t)
    dtype = getattr(torch, case[7])
    x, blocks, (residual, weight) = move(x.to(dtype)), move(w.data), (move(t) for t in _norm_operands(case))
    folded = [gpu.gemv(x, blocks, w.wtype.ggml_type, split_k=case[5], out_dtype=dtype, last_sums=case[6],
                       add_norm=(residual, weight, 1e-6)) for _ in range(2)]
    apart = add_rms_norm(residual, gpu.gemv(x, blocks, w.wtype.ggml_type, split_k=case[5], out_dtype=dtype,
                                            last_sums=case[6]), weight, 1e-6)
    return [tuple(t.cpu() for t in pair) for pair in folded + [apart]]


def _norm_operands(case) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual (M, N) (rows strided: a wider tensor's) and a norm weight (N,) for an add-norm case."""
    gen = torch.Generator().manual_seed(case[3])
    dtype = getattr(torch, case[7])
    residual = (torch.randn(case[2], case[3] + 5, generator=gen) * 4).to(dtype)[:, 5:]
    return residual, torch.rand(case[3], generator=gen) + 0.5


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case computed once by one interpreted child process."""
    out = run_interpreted("tests.test_triton_weights", "_results_in_child", CASES, tmp_path_factory.mktemp("triton"))
    out["y"] = dict(zip(CASES, out["y"]))
    return out


def _check(case, got: torch.Tensor, seed: int) -> None:
    """got within TOLERANCE of sum |x||w| of the float64 product of gguf.quants' values."""
    w, x, bias = _inputs(case, seed)
    dense = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.wtype.ggml_type)).double()
    if w.input_index is not None:
        dense = dense.index_select(1, torch.argsort(w.input_index))
    want = x.double() @ dense.T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ dense.abs().T
    dot = case[5] if case[0] == "gemm" else "ieee"
    assert got.shape == want.shape and got.dtype == x.dtype
    assert ((got.double().cpu() - want).abs() <= TOLERANCE[dot] * bound + 1e-6).all()


@pytest.mark.parametrize("case", GEMV, ids=lambda c: f"{c[1]}-m{c[2]}-n{c[3]}-k{c[4]}-split{c[5]}")
def test_gemv_matches_gguf_dequantize(interpreted, case):
    """M = 1, 5, 16; N not whole tiles; K split by default (several programs' partials summed) or not."""
    _check(case, interpreted["y"][case], CASES.index(case))


def _check_swiglu(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, dtype: torch.dtype) -> None:
    """got (M, I) against silu(x gate^T) * (x up^T) in float64 from gguf.quants' values of the
    fused (2I, K) matrix ``dense``: each product's error bound (TOLERANCE's) carried through
    silu (slope at most 1.1) and the product, plus one rounding of ``dtype``."""
    half = dense.shape[0] // 2
    xd = x.double()
    gate, up = xd @ dense[:half].T, xd @ dense[half:].T
    bound_g, bound_u = (xd.abs() @ dense[:half].abs().T) * 1e-5, (xd.abs() @ dense[half:].abs().T) * 1e-5
    want = torch.nn.functional.silu(gate) * up
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.double().cpu() - want).abs()
    assert (err <= 1.1 * bound_g * (up.abs() + bound_u) + torch.nn.functional.silu(gate).abs() * bound_u
            + ulp * want.abs() + 1e-6).all(), err.max()


@pytest.mark.parametrize("case", SWIGLU, ids=lambda c: f"{c[1]}-m{c[2]}-n{c[3]}-split{c[5]}-{c[6]}")
def test_swiglu_in_the_gemv_matches_gguf_dequantize(interpreted, case):
    """A fused [gate; up] projection's silu(gate) * up from the GEMV's own launch (one split), its
    split sums' (several), or after the GEMM (41 rows), in float32 or rounded once to bf16."""
    w, x, _ = _inputs(case, CASES.index(case))
    dense = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.wtype.ggml_type)).double()
    _check_swiglu(interpreted["y"][case], x, dense, getattr(torch, case[6]))


def _check_sums(case, ys, seed: int) -> None:
    """The last programs' sums, twice, are the ``sum_splits`` launch's bit for bit and within
    the product's bound of gguf.quants' values."""
    assert torch.equal(ys[0], ys[2]) and torch.equal(ys[1], ys[2])
    w, x, _ = _inputs(case, seed)
    if case[6]:
        dense = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.wtype.ggml_type)).double()
        _check_swiglu(ys[0].cpu(), x, dense, getattr(torch, case[7]))
    else:
        _check(case, ys[0], seed)


def _q8_reference(x: torch.Tensor, w: QuantTensor, swiglu: bool) -> torch.Tensor:
    """``weights.activations``' 8-bit-activation product (its integer sums exact, scaled in float64),
    then silu(gate) * up in float64 for a fused matrix."""
    from kvslim.weights.activations import q8_block_linear_reference
    y = q8_block_linear_reference(x.float(), w.data, w.wtype).double()
    if swiglu:
        half = y.shape[1] // 2
        y = torch.nn.functional.silu(y[:, :half]) * y[:, half:]
    return y


def _check_q8(case, got: torch.Tensor, seed: int) -> None:
    """Within float32 sums' error of the reference's value, plus one rounding of the output type;
    all NaN where x held a NaN (as the float GEMV and the reference give)."""
    if case[0] == "q8 nan":
        assert torch.isnan(got).all()
        return
    w, x, _ = _inputs(case, seed)
    x[:, 32:64] = 0
    want = _q8_reference(x, w, case[6])
    ulp = torch.finfo(got.dtype).eps if got.dtype != torch.float32 else 0.0
    assert got.dtype == getattr(torch, case[7]) and got.shape == want.shape
    assert ((got.double().cpu() - want).abs() <= 1e-5 * want.abs().max() + ulp * want.abs()).all()


@pytest.mark.parametrize("case", Q8, ids=lambda c: f"{c[0]}-{c[1]}-n{c[3]}-k{c[4]}-split{c[5]}-swiglu{c[6]}-{c[7]}")
def test_gemv_on_8_bit_activations_matches_the_reference(interpreted, case):
    """Q4_0, Q4_K and Q6_K, x rounded to 8 bits in the GEMV (``q8``) and the products in integers (dp4a's
    twin under the interpreter): ``weights.activations``' product, the C step's reference, for
    whole and partial chunks, splits, SwiGLU pairs, bf16 and float32 outputs, a block of zeros."""
    _check_q8(case, interpreted["y"][case], CASES.index(case))


@pytest.mark.parametrize("case", SUMS, ids=lambda c: f"{c[1]}-m{c[2]}-n{c[3]}-split{c[5]}-swiglu{c[6]}")
def test_split_sums_by_the_last_program_match_the_sums_launch(interpreted, case):
    """Each tile's last program adds the splits' partials in the GEMV's own launch: the same bits
    as the separate sums launch, for plain outputs and SwiGLU, and again on a second call (the
    counters were set back to 0)."""
    _check_sums(case, interpreted["y"][case], CASES.index(case))


def _check_add_norm(case, runs: list, seed: int) -> None:
    """The GEMV that adds its output to the residual and norms the sum in its launch, twice (the
    row counter set back to 0), gives ``add_rms_norm``'s bits on the GEMV's output: both the
    normed rows and the sums (where the launch cannot, with sums_splits' launch, the same
    two launches); and the sum is the residual plus the product within its bound."""
    (normed, summed), again, (want_normed, want_summed) = runs              # (CPU tensors)
    assert torch.equal(normed, want_normed) and torch.equal(summed, want_summed)
    assert torch.equal(again[0], normed) and torch.equal(again[1], summed)
    residual, _ = _norm_operands(case)
    assert normed.dtype == summed.dtype == residual.dtype and summed.shape == residual.shape
    w, x, _ = _inputs(case, seed)
    dense = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.wtype.ggml_type)).double()
    xd = x.to(residual.dtype).double()
    want, bound = residual.double() + xd @ dense.T, xd.abs() @ dense.abs().T
    ulp = torch.finfo(residual.dtype).eps if residual.dtype != torch.float32 else 0.0
    assert ((summed.double() - want).abs() <= 1e-5 * bound + 2 * ulp * (want.abs() + bound) + 1e-6).all()


@pytest.mark.parametrize("case", ADD_NORM, ids=lambda c: f"{c[1]}-m{c[2]}-n{c[3]}-split{c[5]}-last{c[6]}-{c[7]}")
def test_the_add_norm_in_the_gemvs_launch_is_add_rms_norms(interpreted, case):
    _check_add_norm(case, interpreted["y"][case], CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("case", ADD_NORM, ids=lambda c: f"{c[1]}-m{c[2]}-n{c[3]}-split{c[5]}-last{c[6]}-{c[7]}")
def test_the_add_norm_in_the_gemvs_launch_on_cuda(case):
    compiled_process()
    w, x, _ = _inputs(case, CASES.index(case))
    _check_add_norm(case, _add_norm_runs(case, x, w, cuda=True), CASES.index(case))


@pytest.mark.parametrize("last_sums", [False, True])
def test_the_gemv_that_adds_and_norms_compiles_with_its_ordering(last_sums):
    """A mixer's output projection with the add and norm in its launch, for sm_90 (1-row Q4_0,
    bf16, hidden 2048): every tile's y stored before the row counter's acq_rel atomic (a
    bar.sync between), y read back from L2 after it, the counter set back; no local memory."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get("q4_0").ggml_type)
    num_warps = config.pop("num_warps")
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16", res_ptr="*bf16", norm_ptr="*fp32", sum_ptr="*bf16",
                    normed_ptr="*bf16", norm_eps="fp32", row_count_ptr="*i32")
    constexprs = dict(config, TYPE=int(weights.get("q4_0").ggml_type), LAST_SUMS=last_sums, ADD_NORM=True,
                      BLOCK_H=2048)
    ptx = compile_for_sm90(kernel.quant_gemv, pointers, constexprs, num_warps).asm["ptx"]
    counted = ptx.rindex("atom.global.gpu.acq_rel.add")                # the row counter's: the last
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "ld.global.cg" in ptx[counted:] and "atom.global.gpu.relaxed.exch" in ptx[counted:]
    assert ".local" not in ptx


@pytest.mark.parametrize("name,shared", [("q4_0", 9), ("q4_k", 0)])
def test_the_mixture_down_projection_that_adds_and_norms_compiles_with_its_ordering(name, shared):
    """A 35B-A3B decode step's down projection with its combine and the next add and norm
    (bf16, top 8, with and without the shared expert among the pairs), for sm_90: the combined
    row's store before the token's row counter's acq_rel atomic (the last atomic), the row read
    back from L2 after it, the counter set back; no local memory."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get(name).ggml_type)
    constexprs = dict(TYPE=int(weights.get(name).ggml_type), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                      TERMS=config["TERMS"], SCALED=True, TOP_K=shared or 8, SHARED=shared, ADD_NORM=True,
                      BLOCK_H=2048)
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i64", scale_ptr="*bf16", shared_ptr="*bf16",
                    gate_ptr="*bf16", shared_w_ptr="*u8", res_ptr="*bf16", norm_ptr="*fp32", sum_ptr="*bf16",
                    normed_ptr="*bf16", norm_eps="fp32", row_count_ptr="*i32")
    ptx = compile_for_sm90(kernel.quant_gemv_experts, pointers, constexprs, config["num_warps"]).asm["ptx"]
    counted = ptx.rindex("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "ld.global.cg" in ptx[counted:] and "atom.global.gpu.relaxed.exch" in ptx[counted:]
    assert ".local" not in ptx


@pytest.mark.parametrize("case", PER_VALUE, ids=lambda c: c[1])
def test_the_blockwise_types_per_value_twin_matches_too(interpreted, case):
    """Q8_0, Q4_0 and Q6_K through the per-value tile (``blockwise=False``), which the
    GEMV's timings set beside the blockwise reads."""
    _check(case, interpreted["y"][case], CASES.index(case))


@pytest.mark.parametrize("case", GEMM, ids=lambda c: f"{c[1]}-m{c[2]}-n{c[3]}-{c[5]}")
def test_gemm_matches_gguf_dequantize(interpreted, case):
    """Exact float32 tl.dot (ieee) and fp16 operands; bf16 only on a GPU (the interpreter's is wrong)."""
    _check(case, interpreted["y"][case], CASES.index(case))


@pytest.mark.parametrize("case", VALUES, ids=lambda c: c[1])
def test_dequantized_values_are_gguf_dequantize_bit_for_bit(interpreted, case):
    """Every value of W as the kernels dequantize it equals gguf.quants' (products in its order;
    the exact dot of an identity row adds only zeros): 32 rows of 256 values, every grid index,
    sign and scale pattern, MXFP4's subnormal exponents, each of NVFP4's 256 scale bytes twice."""
    w, _, _ = _inputs(case, CASES.index(case))
    want = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.wtype.ggml_type))
    assert torch.equal(interpreted["y"][case].T, want)


@pytest.mark.parametrize("case", LINEAR, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[2]))}")
def test_linear_matches_reference_linear(interpreted, case):
    """Through ``weights.quant_linear`` (the kernels on): GEMV for a decode token, GEMM for 18 rows,
    a bias, a column order not in blocks."""
    _check(case, interpreted["y"][case], CASES.index(case))


@pytest.mark.parametrize("case", ROUNDED, ids=lambda c: f"{c[1]}-m{c[2]}-split{c[5]}")
def test_kernels_store_bf16_as_torch_rounds_their_float32_sums(interpreted, case):
    """y stored in x's bf16 by the kernel itself (``out_dtype``: quant_linear's, so a decode step
    launches no conversion after each GEMV) equals its float32 y rounded by torch, bit for bit:
    one split, several (summed in float32, then rounded), and the GEMM."""
    _check_rounded(interpreted["y"][case])


def _check_rounded(ys) -> None:
    rounded, full, linear = ys
    assert rounded.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(rounded, full.to(torch.bfloat16))
    assert (full.to(torch.bfloat16) != full).any()                   # the rounding was there to get right
    if linear is not None:
        assert linear.dtype == torch.bfloat16 and torch.equal(linear, rounded)


def test_interpreted_kernels_run_on_cpu_tensors(interpreted):
    assert interpreted["runs_on_cpu"]


def test_cpu_tensors_without_the_interpreter_are_refused():
    compiled_process()
    assert not gpu.runs_on(torch.zeros(1))


def test_supported_types():
    T = gguf.GGMLQuantizationType
    assert [gpu.supports(weights.get(t).ggml_type) for t in TYPES] == [True] * len(TYPES)
    assert not any(gpu.supports(t) for t in (T.Q5_0, T.Q4_1, T.IQ4_NL, T.F16, T.TQ1_0, T.TQ2_0))


def test_bad_calls_raise_before_any_kernel():
    """Checked at the entry point: an unsupported type, rows that are not K values of the type,
    tensors a kernel cannot run on here."""
    w = _weight("q4_k", 8, 256, 0)
    with pytest.raises(ValueError, match="supported: Q8_0"):
        gpu.gemv(torch.zeros(1, 256), w.data, gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match="rows of K values"):
        gpu.gemv(torch.zeros(1, 512), w.data, w.wtype.ggml_type)
    with pytest.raises(ValueError, match="rows of K values"):
        gpu.gemm(torch.zeros(1, 100), w.data, w.wtype.ggml_type)
    if not gpu.runs_on(torch.zeros(1)):
        with pytest.raises(ValueError, match="one CUDA device"):
            gpu.gemv(torch.zeros(1, 256), w.data, w.wtype.ggml_type)
    experts = w.data[None].expand(3, -1, -1)
    with pytest.raises(ValueError, match="one expert id per row of x, or k per row"):   # 5 pairs for 2 rows
        gpu.gemv_experts(torch.zeros(2, 256), experts, torch.zeros(5, dtype=torch.long), w.wtype.ggml_type)
    with pytest.raises(ValueError, match=r"one float scale per pair \(4\)"):
        gpu.gemv_experts(torch.zeros(2, 256), experts, torch.zeros(4, dtype=torch.long), w.wtype.ggml_type,
                         scales=torch.ones(2))
    assert gpu.pairs_per_row(torch.zeros(2, 256), torch.zeros(16, dtype=torch.long)) == 8


def test_split_count_fills_the_gpu_and_keeps_a_chunk_per_split():
    config = gpu.gemv_config(1)
    assert gpu.split_count(4096, 1024, config) == 8                  # 128 tiles of 8 outputs
    assert gpu.split_count(512, 32, config) == 2                     # capped by K's 2 chunks
    assert gpu.split_count(4096, 4096, config) == 2                  # 512 tiles
    assert gpu.split_count(2048, 12288, config) == 1                 # 1,536 tiles: enough


# the routed experts: (type, experts E, outputs N, K, pairs P); up to gpu.MAX_GEMV_PAIRS pairs the
# expert GEMV, beyond it the grouped GEMM (the last three: 16 and 32 slots a tile, empty experts)
EXPERT_CASES = [("q8_0", 5, 40, 288, 7), ("q4_0", 2, 9, 96, 3), ("q4_k", 3, 16, 512, 4), ("q6_k", 4, 24, 512, 6),
                ("q4_0", 6, 40, 96, 150), ("q5_k", 3, 70, 256, 140), ("q8_0", 9, 24, 64, 300),
                ("q5_k", 3, 16, 256, 4)]
# the grid types: each in the expert GEMV and in the grouped GEMM
EXPERT_CASES += [(t, 3, 16, 256, 5) for t in GRID_TYPES] + [(t, 2, 24, 256, 130) for t in GRID_TYPES]


def _expert_inputs(case, seed: int):
    """E matrices of the case's type stacked (E, N, row_bytes), P rows of x and an expert id each
    (int64 as topk gives them; int32 for odd seeds: the kernels read either)."""
    name, n_experts, n, k, pairs = case
    mats = [_weight(name, n, k, 100 * seed + e) for e in range(n_experts)]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(n_experts, (pairs,), generator=gen)
    return mats, torch.stack([m.data for m in mats]), torch.randn(pairs, k, generator=gen), \
        ids.int() if seed % 2 else ids


def _moe_module(seed: int = 0, tokens: int = 3):
    """A QuantExperts of 4 experts (hidden 64, intermediate 32, q8_0 gate_up, q4_0 down) and the
    routing of ``tokens`` tokens to 2 experts each (3: a decode batch's GEMV; more than 64: the
    grouped GEMM)."""
    from kvslim.weights.modules import QuantExperts
    gate_up = [_weight("q8_0", 64, 64, 10 + e) for e in range(4)]
    down = [_weight("q4_0", 64, 32, 20 + e) for e in range(4)]
    module = QuantExperts(QuantTensor(torch.stack([w.data for w in gate_up]), gate_up[0].wtype, 64),
                          QuantTensor(torch.stack([w.data for w in down]), down[0].wtype, 32))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=gen)
    experts = torch.tensor([[0, 3], [2, 0], [1, 1]]) if tokens == 3 else torch.randint(4, (tokens, 2), generator=gen)
    return module, x, torch.rand(tokens, 2, generator=gen), experts


def _experts_in_child(cases, path: Path) -> None:
    """In the interpreted child: each grouped GEMV case, and the module's grouped forward."""
    out = {"y": []}
    for i, case in enumerate(cases):
        mats, blocks, x, ids = _expert_inputs(case, i)
        out["y"].append(gpu.experts_matmul(x, blocks, gpu.route(ids, len(mats)), mats[0].wtype.ggml_type))
    out["swiglu"] = []
    for case in EXPERT_SWIGLU:
        mats, blocks, x, ids = _expert_inputs(case[:5], EXPERT_CASES.index(case[:5]))
        xs = x.to(getattr(torch, case[5]))
        out["swiglu"].append(gpu.experts_swiglu(xs, blocks, gpu.route(ids, len(mats)), mats[0].wtype.ggml_type))
    out["combined"] = [_combined_runs(case, i) for i, case in enumerate(COMBINED)]
    out["shared pair"] = [_shared_pair_runs(case, i) for i, case in enumerate(SHARED_PAIR)]
    out["mixture add norm"] = [_mixture_add_norm_runs(i) for i in range(MIXTURE_ADD_NORM)]
    mats, blocks, x, ids = _expert_inputs(EXPERT_CASES[1], 1)
    out["q8 experts"] = gpu.gemv_experts(x, blocks, ids, mats[0].wtype.ggml_type, q8=True)
    mats, blocks, x, ids = _expert_inputs(HALF_GROUPED, EXPERT_CASES.index(HALF_GROUPED))
    out["half grouped"] = gpu.experts_matmul(x.half(), blocks, gpu.route(ids, len(mats)), mats[0].wtype.ggml_type)
    for tokens in MOE_TOKENS:
        module, x, w, experts = _moe_module(tokens=tokens)
        out[tokens] = module.groups(x, experts), module(x, w, experts)
    module, x, w, experts = _dense_moe_module()
    out["dense"] = module.groups(x, experts), module(x, w, experts)
    torch.save(out, path)


def _dense_moe_module():
    """Dense Experts (5 of hidden 64, intermediate 48, float32) and 100 tokens routed to 2 each:
    200 pairs, past the batched products, into the grouped GEMM."""
    from kvslim.models.layers import Experts
    gen = torch.Generator().manual_seed(4)
    module = Experts(5, 64, 48)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(5, 96, 64, generator=gen) * 0.1)
        module.down_proj.copy_(torch.randn(5, 64, 48, generator=gen) * 0.1)
    return module, torch.randn(100, 64, generator=gen), torch.rand(100, 2, generator=gen), \
        torch.randint(5, (100, 2), generator=gen)


MOE_TOKENS = (3, 90)          # 6 pairs: the expert GEMV; 180: the grouped GEMM
# experts' fused [gate; up] matrices through ``experts_swiglu`` (EXPERT_CASES' inputs, x's dtype):
# the expert GEMV's own launch in float32 and bf16, and the grouped GEMM then silu_mul
EXPERT_SWIGLU = [EXPERT_CASES[0] + ("float32",), EXPERT_CASES[2] + ("bfloat16",), EXPERT_CASES[4] + ("float32",)]
HALF_GROUPED = EXPERT_CASES[4]           # q4_0, 150 pairs: the grouped GEMM, here with f16 x (tl.dot in f16)


# a mixture's down projection with its combine in the expert GEMV's launch: (type, E, N, K,
# tokens, top_k, dtype of x, the routing weights, the shared expert's output and the result)
COMBINED = [("q4_0", 5, 40, 288, 3, 2, "float32"), ("q4_k", 4, 24, 512, 2, 4, "bfloat16")]


def _combined_inputs(case, seed: int):
    """The experts, each pair's row and expert id (``_expert_inputs``), its routing weight, the
    shared expert's output and its gate's logit (a column of a wider matrix), in the case's dtype."""
    name, n_experts, n, k, tokens, top_k, dtype = case
    mats, blocks, x, ids = _expert_inputs((name, n_experts, n, k, tokens * top_k), seed)
    gen = torch.Generator().manual_seed(seed + 50)
    dtype = getattr(torch, dtype)
    scales = torch.rand(tokens * top_k, generator=gen).to(dtype)
    shared = torch.randn(tokens, n, generator=gen).to(dtype)
    gate = (torch.randn(tokens, 3, generator=gen) * 2).to(dtype)[:, 1:2]
    return mats, blocks, x.to(dtype), ids, scales, shared, gate


def _combined_runs(case, seed: int, cuda: bool = False) -> list:
    """The combine in the GEMV's launch twice (its counters set back to 0 in between), then
    the two launches it replaces (``gemv_experts``, ``moe.combine``)."""
    from kvslim.gpu import moe
    mats, blocks, x, ids, scales, shared, gate = (t.cuda() if cuda and torch.is_tensor(t) else t
                                                  for t in _combined_inputs(case, seed))
    ggml_type = mats[0].wtype.ggml_type
    runs = [gpu.gemv_experts_combined(x, blocks, ids, ggml_type, scales, shared, gate) for _ in range(2)]
    pairs = gpu.gemv_experts(x, blocks, ids, ggml_type, scales)
    return [y.cpu() for y in runs + [moe.combine(pairs, case[5], shared, gate, shared.dtype)]]


def _check_combined(case, ys, seed: int) -> None:
    """Bit for bit the two launches' result, and within their error of float64 from gguf.quants."""
    assert torch.equal(ys[0], ys[2]) and torch.equal(ys[1], ys[2])
    mats, _, x, ids, scales, shared, gate = _combined_inputs(case, seed)
    tokens, top_k = case[4], case[5]
    want, bound = torch.zeros(tokens, case[2], dtype=torch.float64), torch.zeros(tokens, case[2], dtype=torch.float64)
    for p in range(ids.numel()):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        want[p // top_k] += scales[p].double() * (dense @ x[p].double())
        bound[p // top_k] += scales[p].double() * (dense.abs() @ x[p].double().abs())
    want += torch.sigmoid(gate.double()) * shared.double()
    ulp = torch.finfo(shared.dtype).eps if shared.dtype != torch.float32 else 0.0
    assert ys[0].dtype == shared.dtype and ys[0].shape == want.shape
    assert ((ys[0].double() - want).abs() <= TOLERANCE["ieee"] * bound + ulp * want.abs() + 1e-6).all()


# a mixture's shared expert as one more pair a token in the two expert GEMVs: (type, E, hidden H,
# intermediate I, tokens, top_k, dtype of x and the outputs, 8-bit activations)
# (the pair's logic is the type's GEMV's: small types keep the interpreter's programs few; a Q4_K
# case, 256 wide at least, cost it 30 s)
SHARED_PAIR = [("q8_0", 3, 96, 64, 2, 2, "bfloat16", False), ("q4_0", 4, 96, 64, 3, 2, "float32", True)]
# the mixture down projections that add and norm (``_mixture_add_norm_runs``): COMBINED's, then the
# last SHARED_PAIR case's
MIXTURE_ADD_NORM = len(COMBINED) + 1


def _shared_pair_inputs(case, seed: int):
    """Routed experts' [gate; up] (E, 2I, H) and down (E, H, I) matrices and a shared expert's of
    the same shapes (its matrices last in each list), x (T, H), the routing (T top_k ids and
    weights) and the shared expert's gate logit (T, 1), a column of a wider matrix."""
    name, n_experts, hidden, inter, tokens, top_k, dtype, _ = case
    gate_up = [_weight(name, 2 * inter, hidden, 300 + 10 * seed + e) for e in range(n_experts + 1)]
    down = [_weight(name, hidden, inter, 400 + 10 * seed + e) for e in range(n_experts + 1)]
    gen = torch.Generator().manual_seed(seed + 60)
    dtype = getattr(torch, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(tokens)]).reshape(-1)
    scales = torch.rand(tokens * top_k, generator=gen).to(dtype)
    gate = (torch.randn(tokens, 3, generator=gen) * 2).to(dtype)[:, 1:2]
    return gate_up, down, x, ids, scales, gate


def _shared_pair_runs(case, seed: int, cuda: bool = False) -> list:
    """The SwiGLU pairs with the shared one (``gemv_experts(shared=)``), then the down projection
    with the shared pair and the combine (``gemv_mixture_down``) twice (its counters set back
    to 0 in between)."""
    gate_up, down, x, ids, scales, gate = _shared_pair_inputs(case, seed)
    move = (lambda t: t.cuda()) if cuda else (lambda t: t)
    stack = [move(torch.stack([m.data for m in mats[:-1]])) for mats in (gate_up, down)]
    ggml_type, dtype, q8 = gate_up[0].wtype.ggml_type, x.dtype, case[7]
    h = gpu.gemv_experts(move(x), stack[0], move(ids), ggml_type, swiglu=True, out_dtype=dtype,
                         shared=move(gate_up[-1].data), q8=q8)
    runs = [gpu.gemv_mixture_down(h, stack[1], move(ids), ggml_type, move(scales), move(down[-1].data), move(gate),
                                  dtype, q8=q8) for _ in range(2)]
    return [t.cpu() for t in [h] + runs]


def _mixture_add_norm_runs(i: int, cuda: bool = False) -> list:
    """A mixture's down projection with the next add and norm in its launch (``add_norm``), twice,
    then without it and ``add_rms_norm`` after: COMBINED's cases through ``gemv_experts_combined``,
    then SHARED_PAIR's last through ``gemv_mixture_down`` (on its SwiGLU rows)."""
    from kvslim.gpu.add_norm import add_rms_norm
    move = (lambda t: t.cuda()) if cuda else (lambda t: t)
    if i < len(COMBINED):
        mats, blocks, x, ids, scales, shared, gate = _combined_inputs(COMBINED[i], i)
        args = [move(t) for t in (x, blocks, ids)] + [mats[0].wtype.ggml_type]
        args += [move(t) for t in (scales, shared, gate)]
        down = lambda **k: gpu.gemv_experts_combined(*args, **k)          # noqa: E731
        dtype, width = shared.dtype, COMBINED[i][2]
    else:
        seed = len(SHARED_PAIR) - 1
        case = SHARED_PAIR[seed]
        gate_up, mats, x, ids, scales, gate = _shared_pair_inputs(case, seed)
        h = gpu.gemv_experts(move(x), move(torch.stack([m.data for m in gate_up[:-1]])), move(ids),
                             gate_up[0].wtype.ggml_type, swiglu=True, out_dtype=x.dtype, shared=move(gate_up[-1].data),
                             q8=case[7])
        stack = move(torch.stack([m.data for m in mats[:-1]]))
        down = lambda **k: gpu.gemv_mixture_down(h, stack, move(ids), mats[0].wtype.ggml_type, move(scales),  # noqa
                                                 move(mats[-1].data), move(gate), x.dtype, q8=case[7], **k)
        dtype, width = x.dtype, case[2]
    gen = torch.Generator().manual_seed(70 + i)
    residual = move((torch.randn(gate.shape[0], width + 3, generator=gen) * 3).to(dtype)[:, 3:])
    weight = move(torch.rand(width, generator=gen) + 0.5)
    runs = [down(add_norm=(residual, weight, 1e-6)) for _ in range(2)]
    runs.append(add_rms_norm(residual, down(), weight, 1e-6))
    return [tuple(t.cpu() for t in pair) for pair in runs]


def _check_mixture_add_norm(runs: list) -> None:
    """The add and norm in the down projection's launch: ``add_rms_norm``'s bits on its output, twice."""
    for pair in runs[:2]:
        assert all(torch.equal(a, b) for a, b in zip(pair, runs[2]))


def _check_shared_pair(case, got: list, seed: int) -> None:
    """Each token's SwiGLU rows, its routed experts' then the shared expert's, against float64
    from gguf.quants (or the 8-bit reference); the mixture's output, from those rows, against
    the float64 sum of the routed products times their weights and the shared product times
    sigmoid(gate), within float32 sums' error and one rounding of the type; the second call's
    bits the first's."""
    gate_up, down, x, ids, scales, gate = _shared_pair_inputs(case, seed)
    h, y, again = got
    tokens, top_k, q8 = case[4], case[5], case[7]
    ulp = torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 0.0
    assert h.shape == (tokens * (top_k + 1), case[3]) and y.shape == (tokens, case[2]) and y.dtype == x.dtype
    assert torch.equal(y, again)
    want, bound = torch.zeros(tokens, case[2], dtype=torch.float64), torch.zeros(tokens, case[2], dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k + 1):
            e = ids[t * top_k + k].item() if k < top_k else -1          # -1: the shared expert's matrices
            row = h[t * (top_k + 1) + k:t * (top_k + 1) + k + 1]
            if q8:
                ref = _q8_reference(x[t:t + 1], gate_up[e], True)
                assert ((row.double() - ref).abs() <= 1e-5 * ref.abs().max() + ulp * ref.abs()).all(), (t, k)
            else:
                dense = torch.from_numpy(gguf.quants.dequantize(gate_up[e].data.numpy(), gate_up[e].wtype.ggml_type))
                _check_swiglu(row, x[t:t + 1].float(), dense.double(), x.dtype)
            weight = scales[t * top_k + k].double() if k < top_k else torch.sigmoid(gate[t, 0].double())
            if q8:
                product = _q8_reference(row, down[e], False)[0]
                want[t] += weight * product
                bound[t] += weight * product.abs().max() * 1e-5
            else:
                dense = torch.from_numpy(gguf.quants.dequantize(down[e].data.numpy(), down[e].wtype.ggml_type)).double()
                want[t] += weight * (dense @ row[0].double())
                bound[t] += weight * (dense.abs() @ row[0].double().abs()) * TOLERANCE["ieee"]
    assert ((y.double() - want).abs() <= bound + ulp * want.abs() + 1e-6).all(), (y.double() - want).abs().max()


@pytest.fixture(scope="module")
def interpreted_experts(tmp_path_factory):
    return run_interpreted("tests.test_triton_weights", "_experts_in_child", EXPERT_CASES,
                           tmp_path_factory.mktemp("triton_experts"))


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"{c[0]}-e{c[1]}-n{c[2]}-k{c[3]}-p{c[4]}")
def test_routed_experts_match_gguf_dequantize(interpreted_experts, case):
    """Each pair's row times the matrix of its expert id, read on the device (GEMV or grouped GEMM)."""
    got = interpreted_experts["y"][EXPERT_CASES.index(case)]
    mats, _, x, ids = _expert_inputs(case, EXPERT_CASES.index(case))
    for p in range(x.shape[0]):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        want, bound = dense @ x[p].double(), dense.abs() @ x[p].double().abs()
        assert ((got[p].double() - want).abs() <= TOLERANCE["ieee"] * bound + 1e-6).all(), p


def test_q4_0_grouped_gemm_in_f16_takes_exact_codes_and_scales_after(interpreted_experts):
    """The grouped GEMM with f16 products on Q4_0: each block's codes c - 8 exactly in f16, one
    product, then the block's scale in float32. Against float64 from gguf.quants with x in f16
    as given, float32 sums' bound: the dequantized tile's values, d (c - 8) rounded to f16, were
    off by up to 2^-11 relative and failed it."""
    got = interpreted_experts["half grouped"]
    mats, _, x, ids = _expert_inputs(HALF_GROUPED, EXPERT_CASES.index(HALF_GROUPED))
    x = x.half().double()
    assert gpu.route(ids, len(mats)).tile_expert is not None                  # the grouped GEMM, not the GEMV
    for p in range(x.shape[0]):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        want, bound = dense @ x[p], dense.abs() @ x[p].abs()
        assert ((got[p].double() - want).abs() <= TOLERANCE["ieee"] * bound + 1e-6).all(), p


@pytest.mark.parametrize("case", EXPERT_SWIGLU, ids=lambda c: f"{c[0]}-n{c[2]}-p{c[4]}-{c[5]}")
def test_experts_swiglu_matches_gguf_dequantize(interpreted_experts, case):
    """Each pair's silu(gate) * up of its expert's fused matrix, in x's type."""
    got = interpreted_experts["swiglu"][EXPERT_SWIGLU.index(case)]
    mats, _, x, ids = _expert_inputs(case[:5], EXPERT_CASES.index(case[:5]))
    xs = x.to(getattr(torch, case[5]))
    assert got.shape == (x.shape[0], case[2] // 2)
    for p in range(x.shape[0]):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        _check_swiglu(got[p:p + 1], xs[p:p + 1].float(), dense, xs.dtype)


def test_q4_0_expert_gemv_on_8_bit_activations_matches_the_reference(interpreted_experts):
    """The expert GEMV with x rounded to 8 bits: each pair against ``weights.activations``' product
    of its expert (9 outputs and 3 blocks: a partial tile and chunk)."""
    mats, _, x, ids = _expert_inputs(EXPERT_CASES[1], 1)
    got = interpreted_experts["q8 experts"]
    for p in range(x.shape[0]):
        want = _q8_reference(x[p:p + 1], mats[ids[p]], False)
        assert ((got[p:p + 1].double() - want).abs() <= 1e-5 * want.abs().max()).all(), p


@pytest.mark.parametrize("case", COMBINED, ids=lambda c: f"{c[0]}-t{c[4]}-k{c[5]}-{c[6]}")
def test_the_combine_in_the_expert_gemv_is_the_combine_launchs(interpreted_experts, case):
    """The down projection's expert GEMV that also sums each token's pairs and its gated shared
    expert (by the last of the token's pair programs a tile) gives ``combine``'s bits on
    ``gemv_experts``' products, in float32 and bf16, again on a second call."""
    _check_combined(case, interpreted_experts["combined"][COMBINED.index(case)], COMBINED.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("case", COMBINED, ids=lambda c: f"{c[0]}-t{c[4]}-k{c[5]}-{c[6]}")
def test_the_combine_in_the_expert_gemv_on_cuda(case):
    compiled_process()
    _check_combined(case, _combined_runs(case, COMBINED.index(case), cuda=True), COMBINED.index(case))


@pytest.mark.parametrize("case", SHARED_PAIR, ids=lambda c: f"{c[0]}-t{c[4]}-k{c[5]}-{c[6]}{'-q8' if c[7] else ''}")
def test_the_shared_expert_as_one_more_pair_matches_gguf_dequantize(interpreted_experts, case):
    """A mixture's shared expert in the routed experts' two GEMVs: ``_check_shared_pair``."""
    _check_shared_pair(case, interpreted_experts["shared pair"][SHARED_PAIR.index(case)], SHARED_PAIR.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("case", SHARED_PAIR, ids=lambda c: f"{c[0]}-t{c[4]}-k{c[5]}-{c[6]}{'-q8' if c[7] else ''}")
def test_the_shared_expert_as_one_more_pair_on_cuda(case):
    compiled_process()
    _check_shared_pair(case, _shared_pair_runs(case, SHARED_PAIR.index(case), cuda=True), SHARED_PAIR.index(case))


@pytest.mark.parametrize("i", range(MIXTURE_ADD_NORM))
def test_the_add_norm_in_the_mixtures_down_projection_is_add_rms_norms(interpreted_experts, i):
    """The next layer's residual add and input norm by the last of each token's tiles of the
    mixture's down projection (its combine's launch, with or without the shared expert among the
    pairs): ``add_rms_norm``'s bits, again on a second call."""
    _check_mixture_add_norm(interpreted_experts["mixture add norm"][i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("i", range(MIXTURE_ADD_NORM))
def test_the_add_norm_in_the_mixtures_down_projection_on_cuda(i):
    compiled_process()
    _check_mixture_add_norm(_mixture_add_norm_runs(i, cuda=True))


def test_bad_shared_expert_calls_are_named():
    """A shared matrix of another shape, scales beside it, or a down projection's x without the
    shared rows: named before any kernel."""
    w = _weight("q4_0", 8, 64, 1)
    experts = torch.stack([w.data, w.data])
    x, ids = torch.zeros(2, 64), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="one expert's shape"):
        gpu.gemv_experts(x, experts, ids, w.wtype.ggml_type, shared=w.data[:4])
    with pytest.raises(ValueError, match="unscaled"):
        gpu.gemv_experts(x, experts, ids, w.wtype.ggml_type, scales=torch.ones(4), shared=w.data)
    with pytest.raises(ValueError, match=r"x \(T \(top_k \+ 1\), I\)"):
        gpu.gemv_mixture_down(torch.zeros(4, 64), experts, ids, w.wtype.ggml_type, torch.ones(4), w.data,
                              torch.zeros(2, 1), torch.float32)


@pytest.mark.parametrize("tokens", MOE_TOKENS)
def test_quantized_experts_route_through_the_kernels_without_a_loop(interpreted_experts, tokens):
    """With the kernels on, QuantExperts' forward takes the grouped path (no host sync, no loop)
    for a decode batch and for a prompt, and gives what the loop over chosen experts gives here."""
    grouped, got = interpreted_experts[tokens]
    assert grouped
    module, x, w, experts = _moe_module(tokens=tokens)
    with pytest.MonkeyPatch.context() as patch:          # the kernels multiply float activations
        patch.setenv("KVSLIM_Q8_ACTIVATIONS", "0")
        want = module(x, w, experts)                     # the kernels are off in this process: the loop
    # outputs reach ~1e3 here: float32 sums in another order differ by ulps of the largest
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-4)


def test_dense_experts_group_a_prompt_through_the_kernel(interpreted_experts):
    """Dense experts with the kernels on: a prompt's 200 pairs through ``gemm_experts`` (its dense form)
    (exact float32 dot here), as the loop over chosen experts gives them."""
    grouped, got = interpreted_experts["dense"]
    assert grouped
    module, x, w, experts = _dense_moe_module()
    with torch.no_grad():
        want = module(x, w, experts)                     # the kernels are off in this process: the loop
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n,n_experts,skew", [(129, 4, False), (600, 256, False), (500, 8, True), (2048, 64, True)])
def test_route_puts_each_pair_once_in_a_tile_of_its_expert(n, n_experts, skew):
    """The grouped GEMM's order, made on the device: every pair in exactly one slot, each tile's
    pairs all of the tile's expert, in their original order, padding -1 only at a tile's end, and
    the tiles past the last expert's marked empty (n_experts). Skewed: most pairs to a few
    experts, some experts none."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(n_experts, (n,), generator=gen)
    if skew:
        ids = torch.where(torch.rand(n, generator=gen) < 0.8, ids % 3, ids)
    route = gpu.route(ids, n_experts)
    bm = route.block_m
    assert bm in (16, 32, 64) and route.pairs.numel() == route.tile_expert.numel() * bm
    assert sorted(route.pairs[route.pairs >= 0].tolist()) == list(range(n))
    tiles = route.pairs.view(-1, bm)
    for t, expert in enumerate(route.tile_expert.tolist()):
        held = tiles[t][tiles[t] >= 0]
        if expert == n_experts:
            assert held.numel() == 0
            continue
        assert held.numel() > 0 and (ids[held.long()] == expert).all()
        assert (tiles[t][:held.numel()] == held).all() and held.tolist() == sorted(held.tolist())
    real = route.tile_expert[route.tile_expert < n_experts]
    assert (real.diff() >= 0).all() and real.numel() == sum(-(-int(c) // bm) for c in torch.bincount(ids) if c)


def test_route_never_reads_a_value_back():
    """No op of the routing asks for a value on the host (on a GPU each would be a sync): the
    CPU profile holds no .item(), nonzero or unique."""
    ids = torch.randint(256, (4096,), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gpu.route(ids, 256)
    names = {event.name for event in prof.events()}
    assert "aten::argsort" in names or "aten::sort" in names          # the profile saw the routing
    assert not names & {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::_unique2"}


def test_a_few_pairs_keep_the_gemv():
    ids = torch.arange(gpu.MAX_GEMV_PAIRS) % 7
    route = gpu.route(ids, 7)
    assert route.tile_expert is None and route.ids is ids


CUDA_CASES = [c for c in CASES if c[0] != "add norm"] + [("gemm", t, 40, 40, COLS[t], dot) for t in TYPES
                                                          for dot in ("bf16", "tf32")]   # (add norm: its own test)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_kernels_on_cuda_match_gguf_dequantize(case):
    """The same cases compiled for the GPU in this process, plus bf16 and tf32 tl.dot."""
    compiled_process()
    w, x, bias = _inputs(case, CASES.index(case) if case in CASES else 0)
    on_gpu = QuantTensor(w.data.cuda(), w.wtype, w.cols,
                         None if w.input_index is None else w.input_index.cuda())
    got = _run(case, x.cuda(), on_gpu, None if bias is None else bias.cuda())
    if case[0] == "swiglu":
        dense = torch.from_numpy(gguf.quants.dequantize(w.data.numpy(), w.wtype.ggml_type)).double()
        _check_swiglu(got.cpu(), x, dense, getattr(torch, case[6]))
    elif case[0] == "rounded":                     # (bf16 y, float32 y, quant_linear's y): as the interpreted test
        _check_rounded([None if y is None else y.cpu() for y in got])
    elif case[0] == "sums":
        _check_sums(case, [y.cpu() for y in got], CASES.index(case))
    elif case[0] in ("q8", "q8 linear", "q8 nan"):
        _check_q8(case, got, CASES.index(case))
    else:
        _check(case, got, CASES.index(case) if case in CASES else 0)


POINTERS = {"x_ptr": "*fp32", "w_ptr": "*u8", "grid_ptr": "*i8", "y_ptr": "*fp32", "parts_ptr": "*fp32", "count_ptr": "*i32"}


@pytest.mark.parametrize("name,rows", [("q8_0", 1), ("q4_0", 1), ("q4_0", 16), ("q4_k", 4), ("q6_k", 16), ("q3_k", 1), ("iq4_xs", 4),
                                       ("iq2_xxs", 1), ("iq2_xs", 4), ("iq2_s", 1), ("iq3_xxs", 16), ("iq3_s", 1),
                                       ("iq1_s", 4), ("iq1_m", 1), ("mxfp4", 16), ("nvfp4", 1)])
def test_gemv_compiles_for_an_h100_without_one(name, rows):
    """The interpreter cannot say whether ptxas takes it: lower it for sm_90 with the launcher's config.
    One row: x and y bf16, as a bf16 model's decode step (y rounded by its bits, ``_stored``)."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(rows, weights.get(name).ggml_type)
    num_warps = config.pop("num_warps")
    constexprs = dict(config, TYPE=int(weights.get(name).ggml_type))
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16") if rows == 1 else POINTERS
    assert compile_for_sm90(kernel.quant_gemv, pointers, constexprs, num_warps).asm["cubin"]


def test_the_splits_sum_compiles_for_an_h100_without_one():
    """A split GEMV's partials summed and rounded to bf16 by their bits in one launch."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    pointers = {"parts_ptr": "*fp32", "y_ptr": "*bf16"}
    assert compile_for_sm90(kernel.sum_splits, pointers, {"BLOCK": gpu.SUM_BLOCK}, 4).asm["cubin"]


@pytest.mark.parametrize("swiglu", [False, True])
def test_the_last_programs_sums_compile_with_their_ordering(swiglu):
    """The split GEMV that sums its own partials, for sm_90 (1-row Q4_0, bf16 x and y): every
    thread's partial stored before one thread's acq_rel atomic at GPU scope (a bar.sync between),
    the partials read back from L2 (.cg) after it, and the counter set back to 0."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get("q4_0").ggml_type)
    num_warps = config.pop("num_warps")
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16", parts_ptr="*fp32", count_ptr="*i32")
    constexprs = dict(config, TYPE=int(weights.get("q4_0").ggml_type), SWIGLU=swiglu, LAST_SUMS=True)
    compiled = compile_for_sm90(kernel.quant_gemv, pointers, constexprs, num_warps)
    ptx = compiled.asm["ptx"]
    counted = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "ld.global.cg" in ptx[counted:] and "atom.global.gpu.relaxed.exch" in ptx[counted:]
    # up to 8 splits' partials (and up's) loaded at once, then added in order (``split_sums``): one
    # wait on L2 past the counter, where a split at a time waited once a split (4 to 8 at decode)
    from kvslim.gpu import cuobjdump, load_waves
    sass = cuobjdump(compiled, "-sass")
    assert load_waves(sass[sass.index("ATOMG.E.ADD"):]) == 1


def test_the_gemvs_add_and_norm_wait_on_memory_twice():
    """A mixer's output projection as a decode step launches it (1-row Q4_0, bf16, split K, the
    residual add and norm by the last program, 2,048 features; ints divisible by 16 as a launch
    marks them), for sm_90: past the second counter, the residual, y and the norm's weights load
    in two waves. The weights were loaded after sum's store, which they may alias: 4 waits."""
    from kvslim.gpu import _quant_matmul_kernel as kernel, cuobjdump, load_waves
    config = gpu.gemv_config(1, weights.get("q4_0").ggml_type)
    num_warps = config.pop("num_warps")
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16", parts_ptr="*fp32", count_ptr="*i32", res_ptr="*bf16",
                    norm_ptr="*bf16", sum_ptr="*bf16", normed_ptr="*bf16", row_count_ptr="*i32", norm_eps="fp32")
    constexprs = dict(config, TYPE=int(weights.get("q4_0").ggml_type), LAST_SUMS=True, ADD_NORM=True, BLOCK_H=2048)
    compiled = compile_for_sm90(kernel.quant_gemv, pointers, constexprs, num_warps, ("N", "K", "res_stride", "M"))
    sass = cuobjdump(compiled, "-sass")
    second = sass.index("ATOMG.E.ADD", sass.index("ATOMG.E.ADD") + 1)
    assert load_waves(sass[second:]) <= 2


@pytest.mark.parametrize("name,swiglu", [(t, swiglu) for t in ("q4_0", "q4_k", "q6_k") for swiglu in (False, True)])
def test_the_8_bit_activation_gemv_compiles_to_dp4a(name, swiglu):
    """The 1-row GEMV on 8-bit activations for sm_90 (bf16 x and y): its products are dp4a
    instructions, no spills; and the expert GEMV's."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get(name).ggml_type)
    num_warps = config.pop("num_warps")
    assert gpu.q8_config(config, weights.get(name).ggml_type, 1, True)       # the tile and TERMS a launch takes
    config.update(TYPE=int(weights.get(name).ggml_type), Q8=2)                # compiled: dp4a instructions
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16")
    compiled = compile_for_sm90(kernel.quant_gemv, pointers, dict(config, SWIGLU=swiglu), num_warps)
    assert "dp4a.s32.s32" in compiled.asm["ptx"] and ".local" not in compiled.asm["ptx"]
    experts = {k: config[k] for k in ("TYPE", "BLOCK_N", "BLOCK_K", "TERMS", "Q8")}
    compiled = compile_for_sm90(kernel.quant_gemv_experts, dict(pointers, ids_ptr="*i64", scale_ptr="*bf16"),
                                dict(experts, SCALED=True, SWIGLU=swiglu), num_warps)
    assert "dp4a.s32.s32" in compiled.asm["ptx"]


@pytest.mark.parametrize("name", ["q4_0", "q4_k"])
def test_the_expert_gemv_that_combines_compiles_with_its_ordering(name):
    """A 35B-A3B decode step's down projection with its combine (top 8, bf16), for sm_90: the
    barrier between the pair's store and the acq_rel atomic, the pairs read from L2 after it."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get(name).ggml_type)
    constexprs = dict(TYPE=int(weights.get(name).ggml_type), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                      TERMS=config["TERMS"], SCALED=True, TOP_K=8)
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i64", scale_ptr="*bf16", shared_ptr="*bf16",
                    gate_ptr="*bf16")
    ptx = compile_for_sm90(kernel.quant_gemv_experts, pointers, constexprs, config["num_warps"]).asm["ptx"]
    counted = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "ld.global.cg" in ptx[counted:] and "atom.global.gpu.relaxed.exch" in ptx[counted:]


@pytest.mark.parametrize("name,q8", [("q4_0", 2), ("q4_k", 0), ("q6_k", 2)])
def test_the_shared_expert_pair_launches_compile_for_an_h100_without_one(name, q8):
    """A 35B-A3B decode step's two expert GEMVs with the shared expert as a 9th pair (bf16), for
    sm_90: the SwiGLU one and the down projection with its combine (its ordering as above), the
    pair's matrix picked by a select of pointers, no local memory."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    ggml_type = weights.get(name).ggml_type
    config = gpu.gemv_config(1, ggml_type)
    if q8:
        gpu.q8_config(config, ggml_type, 1, True)
    constexprs = dict(TYPE=int(ggml_type), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                      TERMS=config["TERMS"], Q8=q8, SHARED=9)
    pointers = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i64", scale_ptr="*bf16", shared_ptr="*bf16",
                    gate_ptr="*bf16", shared_w_ptr="*u8")
    swiglu = compile_for_sm90(kernel.quant_gemv_experts, pointers, dict(constexprs, SWIGLU=True),
                              config["num_warps"]).asm["ptx"]
    down = compile_for_sm90(kernel.quant_gemv_experts, pointers, dict(constexprs, SCALED=True, TOP_K=9),
                            config["num_warps"]).asm["ptx"]
    assert ".local" not in swiglu and ".local" not in down
    counted = down.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in down[down.rindex("st.global", 0, counted):counted]


@pytest.mark.parametrize("name", ["q4_0", "q4_k", "q6_k"])
def test_swiglu_launches_compile_for_an_h100_without_one(name):
    """A decode step's SwiGLU launches for sm_90: the 1-row GEMV with both halves and its bf16
    store, the split sums', and the expert GEMV's with bf16 x and y (the shared and routed experts)."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get(name).ggml_type)
    num_warps = config.pop("num_warps")
    ggml_type = int(weights.get(name).ggml_type)
    bf16 = dict(POINTERS, x_ptr="*bf16", y_ptr="*bf16")
    assert compile_for_sm90(kernel.quant_gemv, bf16, dict(config, TYPE=ggml_type, SWIGLU=True), num_warps).asm["cubin"]
    assert compile_for_sm90(kernel.sum_splits, {"parts_ptr": "*fp32", "y_ptr": "*bf16"},
                            {"BLOCK": gpu.SUM_BLOCK, "SWIGLU": True}, 4).asm["cubin"]
    experts = dict(TYPE=ggml_type, BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], TERMS=config["TERMS"],
                   SWIGLU=True)
    assert compile_for_sm90(kernel.quant_gemv_experts, dict(bf16, ids_ptr="*i64", scale_ptr="*bf16"), experts,
                            num_warps).asm["cubin"]


@pytest.mark.parametrize("name,dot", [("q4_0", "fp16"), ("q5_k", "bf16"), ("q6_k", "bf16"), ("q2_k", "bf16"),
                                      ("iq4_xs", "fp16")] + [(t, "bf16") for t in GRID_TYPES])
def test_gemm_compiles_for_an_h100_without_one(name, dot):
    """The prefill GEMM's tensor-core tl.dot at M = 512, x in the dot's own half type."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemm_config(512)
    num_warps = config.pop("num_warps")
    dtype, precision = kernel.DOTS[dot]
    constexprs = dict(config, TYPE=int(weights.get(name).ggml_type), DOT_DTYPE=dtype, PRECISION=precision)
    pointers = dict(POINTERS, x_ptr="*" + dot, y_ptr="*" + dot)                 # y in x's type, as quant_linear's
    assert compile_for_sm90(kernel.quant_gemm, pointers, constexprs, num_warps).asm["cubin"]


@pytest.mark.parametrize("name", ["q4_0", "q4_k", "q6_k"] + GRID_TYPES)
def test_grouped_expert_gemv_compiles_for_an_h100_without_one(name):
    """The expert GEMV with the launcher's blocks, lowered for sm_90 (the interpreter cannot say
    whether ptxas takes the id-indexed pointer arithmetic), as a decode step's down projection
    launches it: topk's int64 ids, bf16 routing weights applied in the kernel."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemv_config(1, weights.get(name).ggml_type)
    constexprs = dict(TYPE=int(weights.get(name).ggml_type), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                      TERMS=config["TERMS"], SCALED=True)
    pointers = dict(POINTERS, x_ptr="*bf16", ids_ptr="*i64", scale_ptr="*bf16")
    assert compile_for_sm90(kernel.quant_gemv_experts, pointers, constexprs, config["num_warps"]).asm["cubin"]


@pytest.mark.parametrize("name,dot", [("q4_0", "bf16"), ("q4_k", "bf16"), ("q6_k", "fp16")]
                         + [(t, "bf16") for t in GRID_TYPES])
def test_grouped_expert_gemm_compiles_for_an_h100_without_one(name, dot):
    """The prompt's grouped GEMM at 16 slots a tile (a 512-token batch over 256 experts at top-8)."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemm_config(gpu.experts_block_m(4096, 256))
    num_warps = config.pop("num_warps")
    dtype, precision = kernel.DOTS[dot]
    constexprs = dict(config, TYPE=int(weights.get(name).ggml_type), DOT_DTYPE=dtype, PRECISION=precision,
                      SCALED=True)
    pointers = dict(POINTERS, x_ptr="*" + dot, pairs_ptr="*i32", tile_expert_ptr="*i32", scale_ptr="*" + dot)
    assert compile_for_sm90(kernel.quant_gemm_experts, pointers, constexprs, num_warps).asm["cubin"]


def test_dense_grouped_gemm_compiles_for_an_h100_without_one():
    """The dense experts' grouped GEMM with bf16 weights and activations at 16 slots a tile."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    config = gpu.gemm_config(gpu.experts_block_m(4096, 256))
    num_warps = config.pop("num_warps")
    dtype, precision = kernel.DOTS["bf16"]
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "grid_ptr": "*i8", "pairs_ptr": "*i32", "tile_expert_ptr": "*i32",
                "y_ptr": "*fp32"}
    constexprs = dict(config, TYPE=kernel.DENSE.value, DOT_DTYPE=dtype, PRECISION=precision)
    assert compile_for_sm90(kernel.quant_gemm_experts, pointers, constexprs, num_warps).asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("case", EXPERT_SWIGLU, ids=lambda c: f"{c[0]}-n{c[2]}-p{c[4]}-{c[5]}")
def test_experts_swiglu_on_cuda_matches_gguf_dequantize(case):
    compiled_process()
    torch.set_float32_matmul_precision("highest")
    mats, blocks, x, ids = _expert_inputs(case[:5], EXPERT_CASES.index(case[:5]))
    xs = x.to(getattr(torch, case[5]))
    got = gpu.experts_swiglu(xs.cuda(), blocks.cuda(), gpu.route(ids.cuda(), len(mats)), mats[0].wtype.ggml_type).cpu()
    for p in range(x.shape[0]):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        _check_swiglu(got[p:p + 1], xs[p:p + 1].float(), dense, xs.dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_q4_0_grouped_gemm_on_cuda_takes_exact_codes(dtype):
    """``test_q4_0_grouped_gemm_in_f16_takes_exact_codes_and_scales_after`` compiled, and in bf16
    (the interpreter's bf16 tl.dot is wrong): the codes' c - 8 from their bits in either type."""
    compiled_process()
    mats, blocks, x, ids = _expert_inputs(HALF_GROUPED, EXPERT_CASES.index(HALF_GROUPED))
    x = x.to(dtype)
    got = gpu.experts_matmul(x.cuda(), blocks.cuda(), gpu.route(ids.cuda(), len(mats)), mats[0].wtype.ggml_type).cpu()
    for p in range(x.shape[0]):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        want, bound = dense @ x[p].double(), dense.abs() @ x[p].double().abs()
        assert ((got[p].double() - want).abs() <= TOLERANCE["ieee"] * bound + 1e-6).all(), p


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernels wait for a GPU")
@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: f"{c[0]}-e{c[1]}-p{c[4]}")
def test_routed_experts_on_cuda_match_gguf_dequantize(case):
    compiled_process()
    torch.set_float32_matmul_precision("highest")         # the grouped GEMM's dot: exact float32 ("ieee")
    mats, blocks, x, ids = _expert_inputs(case, EXPERT_CASES.index(case))
    got = gpu.experts_matmul(x.cuda(), blocks.cuda(), gpu.route(ids.cuda(), len(mats)), mats[0].wtype.ggml_type).cpu()
    for p in range(x.shape[0]):
        dense = torch.from_numpy(gguf.quants.dequantize(mats[ids[p]].data.numpy(), mats[0].wtype.ggml_type)).double()
        want, bound = dense @ x[p].double(), dense.abs() @ x[p].double().abs()
        assert ((got[p].double() - want).abs() <= TOLERANCE["ieee"] * bound + 1e-6).all(), p


# a quantized embedding's lookup (``quant_matmul.rows``): the interpreted checks are in
# tests/test_triton_wiring.py, with quant_linear's
def embedding_inputs() -> list:
    """(ids, table, dtype): Q4_0, Q6_K and IQ4_XS tables of 20 rows of 512 (the K- and i-quant
    ones random blocks), ids of a prompt and a decode batch (2-D), one past the table and one
    negative."""
    tables = [_weight(name, 20, 512, 3) for name in ("q4_0", "q6_k", "iq4_xs")]
    return [(torch.tensor([3, 19, 0, 3]), tables[0], "bfloat16"), (torch.tensor([[7], [2]]), tables[1], "float32"),
            (torch.tensor([5, 20, -1]), tables[2], "float16")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
def test_embedding_rows_on_cuda():
    from kvslim.weights.matmul import embedding_rows
    compiled_process()
    for ids, w, dtype in embedding_inputs():
        inside = ids.clamp(0, w.shape[0] - 1)
        want = embedding_rows(inside, w, getattr(torch, dtype))
        want[(ids != inside)] = 0
        got = gpu.rows(ids.cuda(), w.data.cuda(), w.wtype.ggml_type, w.cols, getattr(torch, dtype))
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("name", ["q4_0", "q4_k", "q6_k", "iq2_xxs"])
def test_embedding_rows_compile_for_an_h100_without_one(name):
    from kvslim.gpu import _quant_matmul_kernel as kernel
    pointers = {"ids_ptr": "*i64", "w_ptr": "*u8", "grid_ptr": "*i8", "out_ptr": "*bf16"}
    constexprs = {"TYPE": int(weights.get(name).ggml_type), "BLOCK_K": 1024}
    assert compile_for_sm90(kernel.quant_rows, pointers, constexprs, 4).asm["cubin"]
