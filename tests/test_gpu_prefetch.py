"""The decode GEMVs' L2 prefetch (``kvslim.gpu.L2_PREFETCH``, ``l2_prefetch``, ``_codecs.prefetch_rows``),
checked without a GPU: which launches ask for it, which bytes it asks for, and what the kernels
compile to with it.

A prefetch changes no value, so parity cannot see it: the tests hold its addresses to each row's
span of bytes (every 128-byte line of it, none outside), the chunk spans it derives to whole bytes,
and its PTX to one prefetch.global.L2 pass per tile, before the PDL wait where the weights are
fixed (the dense GEMV) and after it where the router's ids pick them (the expert GEMV).
"""
from __future__ import annotations

import ast
from pathlib import Path

import gguf
import pytest
import torch

import kvslim.gpu
from kvslim import weights
from kvslim.gpu import quant_matmul

from .test_gpu_pdl import _memory_before_wait
from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

try:
    import triton
    import triton.language as tl
except ImportError:                    # the tests that need it skip
    triton = None

needs_triton = pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed")
PASSES = 5                              # line passes the test kernel takes: 80 lines, past the longest span below

if triton is not None:
    from kvslim.gpu._codecs import PREFETCH_LINES, prefetch_lines

    @triton.jit
    def _lines(at_ptr, wanted_ptr, row_bytes, start, stop, n_rows, BLOCK_N: tl.constexpr, PASSES: tl.constexpr):
        """``prefetch_lines``' offsets and masks for PASSES passes of rows 0 .. BLOCK_N (live below n_rows)."""
        rows = tl.arange(0, BLOCK_N)
        for p in tl.static_range(PASSES):
            line = p * PREFETCH_LINES + tl.arange(0, PREFETCH_LINES)
            at, wanted = prefetch_lines(rows, row_bytes, start, stop, line, rows < n_rows)
            cell = rows[:, None] * (PASSES * PREFETCH_LINES) + p * PREFETCH_LINES + tl.arange(0, PREFETCH_LINES)[None, :]
            tl.store(at_ptr + cell, at)
            tl.store(wanted_ptr + cell, wanted.to(tl.int8))


# (row_bytes, start, stop, live rows of 8): a Q4_0 row of 2048 values whole; a Q6_K row's split of
# 4 (bytes 420-840, not line-aligned); a short row; a span of 64 lines (four passes and one more
# line); an empty span
SPANS = [(1152, 0, 1152, 8), (1680, 420, 840, 5), (210, 105, 210, 8), (8192, 0, 8192, 3), (200, 50, 50, 8)]


def interpreted_lines(spans, path):
    out = []
    for row_bytes, start, stop, n_rows in spans:
        at = torch.zeros(8, PASSES * 16, dtype=torch.int64)
        wanted = torch.zeros(8, PASSES * 16, dtype=torch.int8)
        _lines[(1,)](at, wanted, row_bytes, start, stop, n_rows, BLOCK_N=8, PASSES=PASSES)
        out.append((at, wanted))
    torch.save(out, path)


@needs_triton
def test_prefetch_lines_cover_each_rows_span_and_nothing_else(tmp_path):
    """Every 128-byte line of each live row's bytes [start, stop) holds a wanted address (the
    allocation 128-byte aligned, as torch's CUDA allocations are), no wanted address leaves the
    span, dead rows and an empty span want none, and no line past ``prefetch_rows``' passes
    (lines 0 .. ceil((stop - start) / 128)) is wanted."""
    for (row_bytes, start, stop, n_rows), (at, wanted) in zip(SPANS, run_interpreted(
            "tests.test_gpu_prefetch", "interpreted_lines", SPANS, tmp_path)):
        lines = -(-(stop - start) // 128)
        for r in range(8):
            asked = at[r][wanted[r].bool()].tolist()
            if r >= n_rows or stop <= start:
                assert asked == [], (row_bytes, start, stop, r)
                continue
            first, end = r * row_bytes + start, r * row_bytes + stop
            assert all(first <= a < end for a in asked), (row_bytes, start, stop, r)
            assert {a // 128 for a in asked} == {b // 128 for b in range(first, end)}, (row_bytes, start, stop, r)
            assert wanted[r].nonzero().max().item() == lines                  # the passes' last line


def test_gemv_chunks_are_whole_bytes_of_a_row():
    """``_prefetch_tile`` takes a chunk's bytes as BLOCK_K row_bytes / K: whole for every type the
    GEMVs read, at every block width ``gemv_config`` and the 8-bit tile give them."""
    widths = {quant_matmul.gemv_config(m)["BLOCK_K"] for m in range(1, quant_matmul.MAX_GEMV_ROWS + 1)}
    widths.add(quant_matmul.Q8_TILE["BLOCK_K"])
    assert widths == {128, 256}
    for ggml_type in quant_matmul.SUPPORTED:
        block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        for width in widths:
            assert width * block_bytes % block == 0, (ggml_type.name, width)


def test_l2_prefetch_only_when_on_and_on_cuda(monkeypatch):
    monkeypatch.setattr(kvslim.gpu, "L2_PREFETCH", False)
    assert kvslim.gpu.l2_prefetch(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(kvslim.gpu, "L2_PREFETCH", True)
    assert kvslim.gpu.l2_prefetch(torch.device("cuda", 0)) == {"L2_PREFETCH": True}
    assert kvslim.gpu.l2_prefetch(torch.device("cpu")) == {}               # the interpreter runs no PTX


def test_every_decode_gemv_launch_passes_its_prefetch_option():
    source = Path(quant_matmul.__file__).read_text()
    launches = [ast.unparse(node) for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and getattr(node.func.value, "attr", "") in ("quant_gemv", "quant_gemv_experts")]
    assert len(launches) == 4
    assert all("l2_prefetch(" in launch for launch in launches), launches


def _gemv(name: str, **extra):
    """quant_gemv's 1-row decode launch (bf16 x and y) with ``extra`` constexprs, PTX."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    ggml_type = weights.get(name).ggml_type
    config = quant_matmul.gemv_config(1, ggml_type)
    warps = config.pop("num_warps")
    pointers = dict(x_ptr="*bf16", w_ptr="*u8", grid_ptr="*i8", y_ptr="*bf16", parts_ptr="*fp32", count_ptr="*i32")
    return compile_for_sm90(kernel.quant_gemv, pointers, dict(config, TYPE=int(ggml_type), **extra), warps)


def _experts(name: str, **extra):
    """quant_gemv_experts' decode launch with the shared expert as a 9th pair, PTX."""
    from kvslim.gpu import _quant_matmul_kernel as kernel
    ggml_type = weights.get(name).ggml_type
    config = quant_matmul.gemv_config(1, ggml_type)
    pointers = dict(x_ptr="*bf16", w_ptr="*u8", grid_ptr="*i8", y_ptr="*bf16", parts_ptr="*fp32", count_ptr="*i32",
                    ids_ptr="*i64", scale_ptr="*bf16", shared_ptr="*bf16", gate_ptr="*bf16", shared_w_ptr="*u8")
    constexprs = dict(TYPE=int(ggml_type), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                      TERMS=config["TERMS"], SHARED=9, **extra)
    return compile_for_sm90(kernel.quant_gemv_experts, pointers, constexprs, config["num_warps"])


@needs_triton
@pytest.mark.parametrize("name,swiglu", [("q4_0", False), ("q4_0", True), ("q6_k", False), ("q4_k", True)])
def test_a_prefetching_gemv_asks_l2_before_its_wait(name, swiglu):
    """sm_90 PTX of the dense GEMV (its last program's sums on) with L2_PREFETCH: one prefetch
    pass a tile (two with SWIGLU's up rows), with PDL before griddepcontrol.wait and nothing that
    reads or writes memory there; without L2_PREFETCH, no prefetch; no local memory either way."""
    on = _gemv(name, SWIGLU=swiglu, LAST_SUMS=True, L2_PREFETCH=True, PDL=True)
    ptx = on.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert ptx[:wait].count("prefetch.global.L2") >= (2 if swiglu else 1) and _memory_before_wait(ptx) == []
    assert "prefetch.global.L2" not in ptx[wait:]
    assert kvslim.gpu.resource_usage(on)["STACK"] == 0
    assert "prefetch" not in _gemv(name, SWIGLU=swiglu, LAST_SUMS=True).asm["ptx"]


@needs_triton
@pytest.mark.parametrize("name", ["q4_0", "q6_k"])
def test_a_prefetching_expert_gemv_asks_l2_once_it_knows_the_expert(name):
    """The expert GEMV (SwiGLU pairs, the shared expert as a 9th pair) prefetches after the wait:
    its rows are the expert the router's launch wrote."""
    on = _experts(name, SWIGLU=True, L2_PREFETCH=True, PDL=True)
    ptx = on.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    assert "prefetch.global.L2" not in ptx[:wait] and ptx[wait:].count("prefetch.global.L2") >= 2
    assert kvslim.gpu.resource_usage(on)["STACK"] == 0
    assert "prefetch" not in _experts(name, SWIGLU=True).asm["ptx"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("name", ["q4_0", "q6_k"])
def test_prefetching_gemvs_on_cuda_give_the_plain_bits(name, monkeypatch):
    """On a GPU, the decode GEMV (one split, several with the last program's sums, SwiGLU) and
    the expert GEMV with the prefetch on store the bits they store without it."""
    compiled_process()
    from .test_triton_weights import _weight
    w = _weight(name, 256, 512, 1)
    ggml_type, blocks = w.wtype.ggml_type, w.data.cuda()
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    experts = blocks.reshape(4, 64, -1)
    ids = torch.tensor([2, 0, 3]).cuda()

    def run():
        return [quant_matmul.gemv(x, blocks, ggml_type, out_dtype=torch.bfloat16),
                quant_matmul.gemv(x, blocks, ggml_type, split_k=2, last_sums=True, out_dtype=torch.bfloat16),
                quant_matmul.gemv(x, blocks, ggml_type, swiglu=True, out_dtype=torch.bfloat16),
                quant_matmul.gemv_experts(x, experts, ids, ggml_type, swiglu=True)]
    monkeypatch.setattr(kvslim.gpu, "L2_PREFETCH", False)
    plain = run()
    monkeypatch.setattr(kvslim.gpu, "L2_PREFETCH", True)
    if x.device.type == "cuda":                  # (not under the rehearsal's .cuda(), which leaves tensors on the CPU)
        assert kvslim.gpu.l2_prefetch(x.device) == {"L2_PREFETCH": True}
    for got, want in zip(run(), plain):
        assert torch.equal(got, want)
