"""y = x @ W^T in Triton with W kept as its GGUF blocks on the GPU: ``block_linear.c``'s job on a GPU.

W is a ``kvslim.weights.QuantTensor``'s ``data``, (N, row_bytes) uint8 in the file's layout, copied to the
device as is; no dequantized copy of it is ever stored. Types (``SUPPORTED``): Q8_0, Q4_0,
Q2_K-Q6_K, IQ4_XS, the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: their
lattices reach the kernels as ``grid_table``'s int8 tensors), MXFP4 and NVFP4 (blocks of 64
values; each value addresses its own bytes, so no step or split depends on a block's size). The
kernels (``_quant_matmul_kernel``):

- ``gemv`` for decode (M <= MAX_GEMV_ROWS rows of x): W's bytes are read once and the values
  dequantized in registers; float32 products on the CUDA cores. Split-K: when W has too few
  tiles of BLOCK_N outputs to occupy the GPU, K is cut into splits that run as separate
  programs, each writing a float32 partial; each tile's last program to finish adds them in
  split order (an atomic counter finds it; the order of the sums does not depend on which it
  is), or a second launch does (``sum_splits``): deterministic either way, and the split count
  depends only on the shapes.
- ``gemm`` for prefill: W's tiles dequantized in registers and fed to ``tl.dot`` in DOT_DTYPE
  (fp16, bf16 on tensor cores; tf32; or ieee float32 for exact checks), accumulated in float32.
- ``gemv_experts`` for a mixture's decode: each (token, chosen expert) pair's row times that
  expert's matrix, the expert ids read on the device (``QuantExperts`` routes through it).
- ``gemm_experts`` for a mixture's prompt: the pairs sorted by expert on the device (``route``),
  each expert's run padded to whole tiles, then one tensor-core GEMM over all the tiles; the
  host never learns which experts were chosen, and no loop over experts runs in Python
  (experts kept as float matrices take the same kernel, their tiles read as stored).

``matmul`` picks one by M (``weights.quant_linear`` calls it). The reference is ``kvslim.weights.reference_linear`` (the whole W
through ``gguf.quants.dequantize``, then F.linear); tests/test_triton_weights.py holds the two
together under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import gguf
import torch

from ..formats.base import cached_on
from . import FP_FUSION, counters, kernels, l2_prefetch, pdl, pow2, serves
from .add_norm import add_rms_norm
from .swiglu import silu_mul

_T = gguf.GGMLQuantizationType
GRIDDED = (_T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S, _T.IQ1_S, _T.IQ1_M)   # values index a lattice
SUPPORTED = (_T.Q8_0, _T.Q4_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.IQ4_XS, *GRIDDED, _T.MXFP4, _T.NVFP4)
# The types the GEMV reads block by block (``_gemv_step``), each with the values one column of
# its 1-row step's unsummed products holds (``terms_width``): Q8_0 and Q4_0 a block of 32 (its
# codes' dot with x, then times the block's scale once); a Q4_K or Q5_K byte two (the K-quants'
# 64p + l and 64p + 32 + l); Q6_K's three bytes four (l, l + 32, l + 64 and l + 96 of its half).
VALUES_PER_TERM = {_T.Q8_0: 32, _T.Q4_0: 32, _T.Q4_K: 2, _T.Q5_K: 2, _T.Q6_K: 4}
BLOCKWISE = tuple(VALUES_PER_TERM)
MAX_GEMV_ROWS = 16            # more rows of x: the tensor-core GEMM
# Split K until a GEMV launches about this many programs: 8 per H100 SM, what the 1-row GEMV's
# 40-64 registers a thread (128 threads; Q4_K 117 under Triton 3.6) allow at once. A GEMV is
# bound by the bytes it has in flight: at 2 programs per SM (264, until session 33) a
# 2048-output matrix kept ~2.3 KB of Q4_0 blocks in flight per SM, where an H100's bandwidth
# times its memory latency asks ~25 KB.
GEMV_PROGRAMS = 1056
SUM_BLOCK = 512               # outputs a program of ``sum_splits`` adds over a split GEMV's partials
GEMV_TILE = 2048              # BLOCK_N * BLOCK_K: W values one GEMV step dequantizes (in registers)
GEMV_PRODUCTS = 4096          # BLOCK_M * BLOCK_N * BLOCK_K: the products one GEMV step holds
MAX_GEMV_PAIRS = 128          # more (token, expert) pairs: the grouped GEMM (a decode batch of 16 at top-8)
# Whether the layers take SwiGLU inside the GEMVs (``swiglu``): one launch fewer per fused [gate; up]
# projection (80 a 35B-A3B decode step), but half the programs, each reading both halves and
# holding twice the registers (Triton 3.6, sm_90, 1-row Q4_0: 39 -> 72; the Q4_K expert GEMV 96 ->
# 192). Which wins is a GPU timing's to say (benchmarks/gpu_model.py --no-swiglu-in-gemv); until
# then it is on, the count's side.
SWIGLU_IN_GEMV = True
# Whether sums that needed a launch of their own are made by the last program of the GEMV whose
# results they add (an atomic counter per tile): a split GEMV's partials (``sum_splits``: 120 a
# 35B-A3B decode step) and a mixture's combine after its down projection's expert GEMV
# (``moe.combine``: 40). The same bits either way. Untimed on a GPU (benchmarks/gpu_model.py
# --no-sums-in-gemv sets it beside).
SUMS_IN_GEMV = True
# Whether a mixture's shared expert, when its matrices have the routed experts' type and shape (as
# in Qwen3.5/3.6-35B-A3B and Qwen3-Next, 512 wide), joins the routed experts' two GEMVs as one
# more pair a token (``gemv_experts(shared=)``, ``gemv_mixture_down``) instead of taking two
# GEMVs of its own: 80 launches fewer a 35B-A3B decode step, and its programs run beside the
# routed ones'. Needs SUMS_IN_GEMV and SWIGLU_IN_GEMV. Untimed on a GPU.
SHARED_AS_PAIR = True
# Whether a mixer's quantized output projection takes the residual add and the norm after it in
# its GEMV's launch (``gemv``'s ``add_norm``, by the last tile to store: 40 launches fewer a
# 35B-A3B decode step; ``weights.matmul.quant_linear_add_norm``). Untimed on a GPU
# (benchmarks/gpu_model.py --no-sums-in-gemv turns it off with the other last-program folds).
ADD_NORM_IN_GEMV = True
# Whether decode's 1-row Q4_0, Q4_K and Q6_K GEMVs round x to 8 bits (a scale per 32 values, as
# ``weights.activations.quantize_q8`` and llama.cpp's CUDA decode do) and multiply in integers by
# ``dp4a``: the float loops cost 0.51 (Q4_0), 0.77 (Q4_K) and 0.61 (Q6_K) warp instructions a
# weight byte at sm_90 against the ~0.22 an H200's issue rate allows at full bandwidth; these
# 0.27, 0.27 and 0.37 (Triton 3.6 SASS). Off until a lease times it and a quality run weighs the rounding
# (the outputs move by ~0.5% of their size; benchmarks/gpu_model.py --q8-activations);
# KVSLIM_GPU_Q8_ACTIVATIONS=1 turns it on for any command (the CPU's C step takes 8-bit
# activations by default, ``native.block_linear.q8_activations``).
Q8_ACTIVATIONS = os.environ.get("KVSLIM_GPU_Q8_ACTIVATIONS", "0") == "1"
Q8_TILE = dict(BLOCK_N=32, BLOCK_K=256)     # 32 rows a program: x's rounding paid once for 32 rows
# the types, each with the values of one of its terms: a block (Q4_0), a group of 64 (Q4_K), a half (Q6_K)
Q8_TYPES = {_T.Q4_0: 32, _T.Q4_K: 64, _T.Q6_K: 128}


def _kernel():
    return kernels("_quant_matmul_kernel")              # imports triton: only when a kernel runs


def supports(ggml_type) -> bool:
    """Whether these kernels decode this GGUF type (a gguf.GGMLQuantizationType)."""
    return ggml_type in SUPPORTED


def grid_table(ggml_type, device) -> torch.Tensor:
    """The kernels' ``grid_ptr`` for ``ggml_type``: its lattice (``native.lattices.grid``; IQ1_M's
    is IQ1_S's) flattened to int8, built once per device; one zero byte for a type without one
    (the kernels never read it). 256-2048 entries of 4 or 8 values: 1-16 KB, cache-resident."""
    name = ggml_type.name.lower() if ggml_type in GRIDDED else None

    def build() -> torch.Tensor:
        if name is None:
            return torch.zeros(1, dtype=torch.int8)
        from ..native import lattices
        return torch.from_numpy(lattices.grid(name).reshape(-1).copy())
    return cached_on(device, ("quant_matmul grid", name), build)


def runs_on(x: torch.Tensor) -> bool:
    """Whether these kernels can run on x's device here (``kvslim.gpu.runs_on``)."""
    return serves("_quant_matmul_kernel", x.device)


def terms_width(ggml_type, block_k: int, blockwise: bool = True) -> int:
    """The columns of a 1-row GEMV step's unsummed products (the kernels' TERMS) for the types
    read block by block (``VALUES_PER_TERM``); 0 for the per-value tile, which sums each chunk
    as before. sm_90 cubins, Triton 3.6 (the devices'), instructions a chunk with unsummed
    products against summed:
    Q4_0 225 against 326, Q8_0 201 against 338, Q6_K 319 against 572, Q4_K (blockwise) 659
    against 814; but the per-value Q4_K 1,246 against 1,212 and IQ4_XS 1,633 against 1,478
    (147 registers against 116). (Session 39: Q4_0 and Q8_0 a term per block, ``_legacy_block_dot``.)"""
    return block_k // VALUES_PER_TERM[ggml_type] if blockwise and ggml_type in VALUES_PER_TERM else 0


def gemv_config(n_rows: int, ggml_type=None, blockwise: bool = True) -> dict:
    """Blocks and warps of the GEMV for M = n_rows: 256 columns (one K-quant super-block) per
    step while few rows, then fewer outputs per program. Each value of W's tile holds its own
    64-bit byte pointers: ptxas for sm_90 spilled kilobytes at 32 x 256 values (M = 1), none at
    8 x 256 (96-118 registers; 48-80 from M = 4 on; the grid i-quants, MXFP4 and NVFP4 80-122,
    then 47-80). Not timed on a GPU yet. At one row, TERMS: the width of the products kept
    unsummed until the end of K (``terms_width``; 0 without ``ggml_type``: summed per chunk)."""
    block_m = pow2(n_rows)
    block_k = 256 if block_m <= 2 else 128
    block_n = max(4, min(GEMV_TILE // block_k, GEMV_PRODUCTS // (block_m * block_k)))
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    if n_rows == 1:
        config["TERMS"] = 0 if ggml_type is None else terms_width(ggml_type, block_k, blockwise)
    return config


def gemm_config(n_rows: int) -> dict:
    """Blocks and warps of the GEMM: W's dequantized tile is reused by BLOCK_M rows of x, so
    BLOCK_M is the larger side. ptxas for sm_90 spilled at 128 x 64 x 64 (8 warps) and none at
    BLOCK_K = 32 (179-218 registers for the K-quants, 180-227 for the grid i-quants, MXFP4 and NVFP4;
    the grouped GEMM's 16-slot tiles take up to 254-255, Q4_K and IQ4_XS as IQ2_S and IQ3_S, and
    do not spill either: the cubins' resource usage, Triton 3.9). Not timed on a GPU yet."""
    block_m = min(128, max(16, pow2(n_rows)))
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32, num_warps=8 if block_m >= 128 else 4)


def q8_config(config: dict, ggml_type, n_rows: int, q8: bool | None) -> int:
    """The kernels' Q8 for a GEMV (0: float activations; 1: 8-bit ones, dp4a interpreted; 2: by
    dp4a instructions), ``config`` set to ``Q8_TILE`` where it is not 0: 1-row GEMVs of the
    ``Q8_TYPES`` when ``q8`` (default ``Q8_ACTIVATIONS``) asks."""
    if not (Q8_ACTIVATIONS if q8 is None else q8) or ggml_type not in Q8_TYPES or n_rows != 1:
        return 0
    config.update(Q8_TILE, TERMS=Q8_TILE["BLOCK_K"] // Q8_TYPES[ggml_type])
    return 1 if _kernel().INTERPRETED else 2


def split_count(n_cols: int, n_out: int, config: dict, programs: int = GEMV_PROGRAMS) -> int:
    """Splits of K for a GEMV: enough for ``programs`` programs, at least one chunk per split."""
    tiles = -(-n_out // config["BLOCK_N"])
    chunks = -(-n_cols // config["BLOCK_K"])
    return max(1, min(chunks, programs // tiles))


ROWS_BLOCK = 1024            # columns a ``rows`` program dequantizes


def rows(ids: torch.Tensor, blocks: torch.Tensor, ggml_type, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (any shape, int) of a (V, row_bytes) matrix of ``ggml_type`` blocks of
    ``cols`` values -> (*ids.shape, cols) of ``dtype``: gguf's values, rounded once, one launch
    (an embedding lookup). An id outside [0, V) gives a row of zeros, never other memory: the
    callers refuse such ids first."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    if not supports(ggml_type) or blocks.dim() != 2 or cols % block_size \
            or blocks.shape[1] != cols // block_size * block_bytes or ids.is_floating_point() \
            or ids.device != blocks.device:
        raise ValueError(f"integer ids and a matrix of {getattr(ggml_type, 'name', ggml_type)} rows of {cols} "
                         f"values on their device expected, got ids {ids.dtype} on {ids.device} and blocks "
                         f"{tuple(blocks.shape)} on {blocks.device}")
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), cols, device=blocks.device, dtype=dtype)
    if flat.numel():
        _kernel().quant_rows[(flat.numel(), -(-cols // ROWS_BLOCK))](
            flat, blocks.contiguous(), grid_table(ggml_type, blocks.device), out, blocks.shape[0], cols,
            blocks.shape[1], TYPE=int(ggml_type), BLOCK_K=ROWS_BLOCK, num_warps=4, **FP_FUSION, **pdl(blocks.device))
    return out.reshape(*ids.shape, cols)


def _check(x: torch.Tensor, blocks: torch.Tensor, ggml_type) -> None:
    """A supported type, x (M, K) and blocks (N, row_bytes) whose rows are K values of that type."""
    if not supports(ggml_type):
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"no Triton kernel for {getattr(ggml_type, 'name', ggml_type)}; supported: {names}")
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    whole_rows = x.shape[-1] % block_size == 0 and blocks.shape[-1] == x.shape[-1] // block_size * block_bytes
    if x.dim() != 2 or blocks.dim() != 2 or not whole_rows:
        raise ValueError(f"x (M, K) and {ggml_type.name} rows of K values (N, row_bytes) expected, "
                         f"got {tuple(x.shape)} and {tuple(blocks.shape)}")
    if not runs_on(x) or blocks.device != x.device:
        raise ValueError(f"x and blocks on one CUDA device expected (the CPU under TRITON_INTERPRET=1), "
                         f"got {x.device} and {blocks.device}")


def _check_experts(x: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor, ggml_type,
                   scales: torch.Tensor | None = None) -> None:
    """``_check`` for one expert's matrix, blocks (E, N, row_bytes), the pairs' expert ids
    (``pairs_per_row``) and, if given, one float scale per pair."""
    if blocks.dim() != 3:
        raise ValueError(f"blocks (E, N, row_bytes) expected, got {tuple(blocks.shape)}")
    pairs_per_row(x, ids)
    _check_scales(ids, scales)
    _check(x, blocks[0], ggml_type)


def pairs_per_row(x: torch.Tensor, ids: torch.Tensor) -> int:
    """The pairs that read each row of x: one expert id per row (1), or k per row for x's T
    tokens and their T k consecutive pairs (a token's top_k experts read its one row)."""
    if x.dim() != 2 or ids.dim() != 1 or not x.shape[0] or ids.numel() % x.shape[0]:
        raise ValueError(f"x (T, K) and one expert id per row of x, or k per row, expected, got x "
                         f"{tuple(x.shape)} and ids {tuple(ids.shape)}")
    return ids.numel() // x.shape[0]


def _check_scales(ids: torch.Tensor, scales: torch.Tensor | None) -> None:
    if scales is not None and (scales.numel() != ids.numel() or not scales.is_floating_point()
                               or scales.device != ids.device):
        raise ValueError(f"one float scale per pair ({ids.numel()}) on their device expected, "
                         f"got {tuple(scales.shape)} {scales.dtype} on {scales.device}")


def gemv(x: torch.Tensor, blocks: torch.Tensor, ggml_type, split_k: int | None = None,
         blockwise: bool = True, terms: bool = True, out_dtype: torch.dtype = torch.float32,
         swiglu: bool = False, last_sums: bool | None = None, q8: bool | None = None, add_norm=None):
    """x (M, K) float, M <= MAX_GEMV_ROWS; blocks (N, row_bytes) uint8 of ``ggml_type`` ->
    y (M, N) of ``out_dtype`` (float32 sums, rounded once when stored). ``split_k``: splits of K
    (default ``split_count``). ``blockwise`` False: the BLOCKWISE types through the per-value
    tile too (their blockwise reads' twin). ``terms`` False: at M = 1 too, each chunk's products
    summed across the tile (the twin of TERMS). ``swiglu``: blocks are a fused [gate; up]
    projection (2I rows) and y (M, I) = silu(x W_gate^T) * (x W_up^T), from the float32 sums,
    rounded once: the SwiGLU in the GEMV's launch (one split) or in its split sums' (several),
    where ``layers.swiglu`` was one more launch after a rounding to out_dtype. ``last_sums``
    (default ``SUMS_IN_GEMV``): several splits' partials summed by each tile's last program, in
    the GEMV's launch; False: by ``sum_splits``, one more launch (the same bits). ``q8``: a 1-row
    Q4_0, Q4_K or Q6_K GEMV with x rounded to 8 bits (``q8_config``; default ``Q8_ACTIVATIONS``).
    ``add_norm`` (residual (M, N), norm weight (N,), eps): y is the residual's delta, and the
    call returns (norm of residual + y, residual + y), both of y's type, as
    ``add_norm.add_rms_norm`` gives them (its bits): by the last of the GEMV's tiles, in its
    launch, where the sums are (one split, or ``last_sums``); else by that launch after."""
    _check(x, blocks, ggml_type)
    if x.shape[0] > MAX_GEMV_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_GEMV_ROWS} rows of x, got {x.shape[0]}: use gemm")
    (m, k), n = x.shape, blocks.shape[0]
    if swiglu and n % 2:
        raise ValueError(f"a fused [gate; up] projection has an even number of rows, got {n}")
    config = gemv_config(m, ggml_type if terms else None, blockwise)
    config["Q8"] = q8_config(config, ggml_type, m, q8 if blockwise and terms else False)   # the twins stay float
    splits = split_k or split_count(k, n, config)
    chunks = -(-k // config["BLOCK_K"])
    per_split = -(-chunks // splits)
    splits = -(-chunks // per_split)                     # no split left without a chunk
    width = n // 2 if swiglu else n
    x, blocks = x.contiguous(), blocks.contiguous()
    y = torch.empty(m, width, device=x.device, dtype=out_dtype)
    table = grid_table(ggml_type, x.device)
    constexprs = dict(TYPE=int(ggml_type), BLOCKWISE=blockwise, **config)
    tiles = -(-width // config["BLOCK_N"])
    last_sums = SUMS_IN_GEMV if last_sums is None else last_sums
    fold, norm_args = _norm_epilogue(add_norm, y, swiglu, splits == 1 or last_sums, tiles)
    block_h = pow2(width) if fold else 1                             # (a constexpr: one compile without)
    # one split writes y itself, in out_dtype: no float32 copy to convert after (a decode step's
    # ~300 GEMVs launched as many conversions); several write float32 partials, summed in order
    # and rounded once, by each tile's last program (``last_sums``) or by one more launch
    if splits == 1:
        _kernel().quant_gemv[(tiles, 1)](
            x, blocks, table, y, y, y, m, width, k, blocks.shape[1], per_split, width * blocks.shape[1], *norm_args,
            SWIGLU=swiglu, ADD_NORM=fold, BLOCK_H=block_h, **constexprs, **FP_FUSION, **l2_prefetch(x.device),
            **pdl(x.device))
    elif last_sums:
        parts = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
        _kernel().quant_gemv[(tiles, splits)](
            x, blocks, table, y, parts, counters(tiles, x.device), m, width, k, blocks.shape[1], per_split,
            width * blocks.shape[1], *norm_args, SWIGLU=swiglu, LAST_SUMS=True, ADD_NORM=fold, BLOCK_H=block_h,
            **constexprs, **FP_FUSION, **l2_prefetch(x.device), **pdl(x.device))
    else:
        parts = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
        _kernel().quant_gemv[(-(-n // config["BLOCK_N"]), splits)](
            x, blocks, table, parts, parts, parts, m, n, k, blocks.shape[1], per_split, 0, *norm_args,
            **constexprs, **FP_FUSION, **l2_prefetch(x.device), **pdl(x.device))
        # (the SwiGLU halves here are rows of one GEMV, not pairs: sum_splits applies the activation)
        _kernel().sum_splits[(-(-(m * width) // SUM_BLOCK),)](parts, y, splits, m * width, width, BLOCK=SUM_BLOCK,
                                                               SWIGLU=swiglu, num_warps=4, **FP_FUSION, **pdl(y.device))
    return _normed(y, add_norm, fold, norm_args)


def _normed(y: torch.Tensor, add_norm, fold: bool, norm_args: tuple):
    """A GEMV's result: y; with ``add_norm``, (normed, summed): the launch's own (``fold``) or
    ``add_rms_norm``'s launch after it."""
    if add_norm is None:
        return y
    if fold:
        return norm_args[3], norm_args[2]
    residual, weight, eps = add_norm
    return add_rms_norm(residual, y, weight, eps)


def _norm_epilogue(add_norm, y: torch.Tensor, swiglu: bool, sums_in_launch: bool, at: int) -> tuple[bool, tuple]:
    """(whether the GEMV adds and norms its output in its launch, the kernel's seven arguments
    for it: residual, norm weight, sum, normed, eps, the residual's row stride, the row
    counters, one a row of y from counter ``at`` on, past the launch's others; placeholders
    without). ``add_norm`` (residual (M, N), weight (N,), eps)."""
    if add_norm is None:
        return False, (y, y, y, y, 0.0, 0, y)
    residual, weight, eps = add_norm
    if swiglu or residual.shape != y.shape or residual.stride(-1) != 1 or weight.shape != y.shape[1:] \
            or residual.device != y.device:
        raise ValueError(f"add_norm: a residual (M, N) = {tuple(y.shape)} with contiguous rows and a weight of N "
                         f"on y's device expected (no SwiGLU), got {tuple(residual.shape)} and {tuple(weight.shape)}")
    if not sums_in_launch:
        return False, (y, y, y, y, 0.0, 0, y)
    summed, normed = torch.empty_like(y), torch.empty_like(y)
    return True, (residual, weight.contiguous(), summed, normed, float(eps), residual.stride(0),
                  counters(at + y.shape[0], y.device)[at:])


def gemv_experts(x: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor, ggml_type,
                 scales: torch.Tensor | None = None, swiglu: bool = False,
                 out_dtype: torch.dtype = torch.float32, q8: bool | None = None,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture's routed experts for a few tokens in one launch, without a host sync: pair p's
    row of x (one row per pair, or per token for its consecutive pairs: ``pairs_per_row``) times
    expert ids[p]'s matrix, blocks (E, N, row_bytes) uint8 -> y (P, N) of ``out_dtype`` (float32
    sums rounded once), times scales[p] if given (the pairs' routing weights: no separate launch
    to weight them). ``swiglu``: each expert's matrix is its fused [gate; up] projection (2I
    rows) and y (P, I) = silu(gate) * up, in the same launch (``gemv``'s). ``ids`` (P,), int32 or
    int64 (topk's, read as they are), stays on the device; only the chosen experts' bytes are read.
    ``shared``: a mixture's shared expert's matrix (N, row_bytes), of the experts' type and shape,
    which each of x's T tokens takes as one more pair after its routed ones (ids (T top_k,), no
    scales): y (T (top_k + 1), N), each token's routed rows then its shared one
    (``gemv_mixture_down``'s x)."""
    pairs = ids.numel()
    if shared is not None:
        if scales is not None:
            raise ValueError("a shared expert's pairs are unscaled here: its gate scales gemv_mixture_down's")
        _check_shared(shared, blocks)
        pairs += x.shape[0]
    _check_experts(x, blocks, ids, ggml_type, scales)
    n = blocks.shape[1]
    if swiglu and n % 2:
        raise ValueError(f"a fused [gate; up] projection has an even number of rows, got {n}")
    y = torch.empty(pairs, n // 2 if swiglu else n, device=x.device, dtype=out_dtype)
    return _experts_gemv(x, blocks, ids, ggml_type, scales, y, q8, swiglu=swiglu,
                         shared=None if shared is None else (shared, pairs // x.shape[0]))


def gemv_mixture_down(x: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor, ggml_type, scales: torch.Tensor,
                      shared: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype,
                      q8: bool | None = None, add_norm=None):
    """A mixture's down projection, its shared expert's and its combine in one launch (where
    ``gemv_experts_combined`` follows a launch of the shared expert's own): x (T (top_k + 1), I)
    as ``gemv_experts(..., shared=)`` gives it, blocks (E, N, row_bytes), shared (N, row_bytes)
    the shared expert's down matrix, ids and scales (T top_k,) the routing, gate (T, 1) the shared
    expert's gate logit -> (T, N) of ``out_dtype``: the token's pairs' products, the routed ones
    times their weights and the shared one times sigmoid(gate), summed in float32 in order
    (the shared one last) and rounded once. ``add_norm`` as ``gemv``'s: (normed, summed) of
    the output added to a residual, each token's by the last of its tiles."""
    tokens = gate.shape[0]
    if blocks.dim() != 3 or gate.shape != (tokens, 1) or not tokens or ids.dim() != 1 \
            or ids.numel() % tokens or x.shape[0] != ids.numel() + tokens:
        raise ValueError(f"x (T (top_k + 1), I), blocks (E, N, row_bytes), ids (T top_k,) and gate (T, 1) expected, "
                         f"got x {tuple(x.shape)}, blocks {tuple(blocks.shape)}, ids {tuple(ids.shape)}, "
                         f"gate {tuple(gate.shape)}")
    _check_scales(ids, scales)
    _check_shared(shared, blocks)
    _check(x, blocks[0], ggml_type)
    y = torch.empty(tokens, blocks.shape[1], device=x.device, dtype=out_dtype)
    return _experts_gemv(x, blocks, ids, ggml_type, scales, y, q8, combine=(y, gate),
                         shared=(shared, x.shape[0] // tokens), add_norm=add_norm)


def _check_shared(shared: torch.Tensor, blocks: torch.Tensor) -> None:
    """A shared expert's matrix of the routed experts' shape and bytes, on their device."""
    if (blocks.dim() != 3 or shared.shape != blocks.shape[1:] or shared.dtype != blocks.dtype
            or shared.device != blocks.device):
        raise ValueError(f"the shared expert's matrix must have one expert's shape {tuple(blocks.shape[1:])} and "
                         f"{blocks.dtype} on {blocks.device}, got {tuple(shared.shape)} {shared.dtype} on "
                         f"{shared.device}")


def gemv_experts_combined(x: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor, ggml_type, scales: torch.Tensor,
                          shared: torch.Tensor, gate: torch.Tensor, q8: bool | None = None, add_norm=None):
    """A mixture's down projection and its combine in one launch: ``gemv_experts`` (the pairs'
    products times their routing weights ``scales``) and then, by each token's last pair program
    for a tile, ``moe.combine``'s sum: the token's pairs (T top_k consecutive, ids (T top_k,))
    summed in order plus sigmoid(gate) * shared, rounded once -> (T, N) of shared's type, the
    bits of ``combine`` on ``gemv_experts``' products. shared (T, N) the shared expert's output,
    gate (T, 1) its gate's logit (a column of a wider matrix). ``add_norm`` as
    ``gemv_mixture_down``'s."""
    _check_experts(x, blocks, ids, ggml_type, scales)
    tokens, n = shared.shape
    if scales is None or ids.numel() % max(tokens, 1) or gate.shape != (tokens, 1) or n != blocks.shape[1]:
        raise ValueError(f"routing weights, T top_k ids, shared (T, N) and gate (T, 1) expected, got ids "
                         f"{tuple(ids.shape)}, shared {tuple(shared.shape)}, gate {tuple(gate.shape)} for N = "
                         f"{blocks.shape[1]}")
    out = torch.empty(tokens, n, device=x.device, dtype=shared.dtype)
    return _experts_gemv(x, blocks, ids, ggml_type, scales, out, q8, combine=(shared, gate), add_norm=add_norm)


def _experts_gemv(x, blocks, ids, ggml_type, scales, y, q8, swiglu: bool = False, combine=None,
                  shared=None, add_norm=None):
    """``quant_gemv_experts`` over (tiles of y's columns, pairs) into y (P or T rows). ``combine``
    (the shared expert's output, gate): each token's last pair program a tile writes its
    combined row (TOP_K launch). ``shared`` (matrix, pairs a token): the shared expert as each
    token's last pair (SHARED launch); with ``combine``, the sum is the pairs' alone.
    ``add_norm`` (with ``combine``): (normed, summed) returned, ``gemv``'s."""
    config = gemv_config(1, ggml_type)
    q8_mode = q8_config(config, ggml_type, 1, q8)
    per_token, shared_w = (0, blocks) if shared is None else (shared[1], shared[0].contiguous())
    p = ids.numel() if shared is None else ids.numel() // (per_token - 1) * per_token
    k, width = x.shape[1], y.shape[1]
    tiles = -(-width // config["BLOCK_N"])
    top_k, extra = 0, (y, y, y, y, 0)                 # (parts, counters, shared, gate, gate's row stride)
    if combine is not None:
        output, gate = combine
        top_k = p // y.shape[0]
        extra = (torch.empty(p, width, device=x.device, dtype=torch.float32), counters(y.shape[0] * tiles, x.device),
                 output.contiguous(), gate, gate.stride(0))
    fold, norm_args = _norm_epilogue(add_norm, y, swiglu, combine is not None, y.shape[0] * tiles)
    if y.shape[0]:
        _kernel().quant_gemv_experts[(tiles, p)](
            x.contiguous(), blocks.contiguous(), grid_table(ggml_type, x.device), _ids(ids), _scales(scales, x), y,
            width, k, blocks.shape[2], blocks.shape[1] * blocks.shape[2], p // x.shape[0], width * blocks.shape[2],
            *extra, shared_w, *norm_args, TYPE=int(ggml_type), BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
            TERMS=config["TERMS"], SCALED=scales is not None, SWIGLU=swiglu, TOP_K=top_k, Q8=q8_mode,
            SHARED=per_token, ADD_NORM=fold, BLOCK_H=pow2(width) if fold else 1, num_warps=config["num_warps"],
            **FP_FUSION, **l2_prefetch(x.device), **pdl(x.device))
    return _normed(y, add_norm, fold, norm_args)


def _ids(ids: torch.Tensor) -> torch.Tensor:
    """Expert ids as the kernels read them: int32 or int64 as given (a conversion would be one
    more launch a matrix in every decode step), anything else as int64."""
    return (ids if ids.dtype in (torch.int32, torch.int64) else ids.long()).contiguous()


def _scales(scales: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The pairs' weights as the kernels read them; a stand-in pointer (never read) without."""
    return x if scales is None else scales.reshape(-1).contiguous()


class Route(NamedTuple):
    """Where a mixture call's (token, expert) pairs go, worked out on the device. ``tile_expert``
    is None for a few pairs (the GEMV reads ``ids`` itself); else the pairs sorted by expert,
    each expert's run padded to whole tiles of ``block_m`` slots."""
    ids: torch.Tensor                       # (P,) the expert of each pair
    pairs: torch.Tensor | None              # (tiles * block_m,) int32: the pair in each slot, -1 in padding
    tile_expert: torch.Tensor | None        # (tiles,) int32: each tile's expert, n_experts past the last
    n_experts: int

    @property
    def block_m(self) -> int:
        return self.pairs.numel() // self.tile_expert.numel()


def experts_block_m(n_pairs: int, n_experts: int) -> int:
    """Slots per tile of the grouped GEMM: the mean pairs per expert as a power of two, 16 to 64
    (tl.dot's least M is 16; a wider tile pads an expert's last tile with more empty slots)."""
    return min(64, max(16, pow2(-(-n_pairs // n_experts))))


def route(ids: torch.Tensor, n_experts: int) -> Route:
    """The pairs' order for ``experts_matmul``, without a host sync: ids (P,) as is up to
    MAX_GEMV_PAIRS, else sorted by expert (stable) into tiles. The grid is sized before the
    counts are known: each expert that has pairs pads less than one tile, so
    ceil(P / block_m) + min(E, P) tiles always hold them; the rest are marked empty."""
    n = ids.numel()
    if n <= MAX_GEMV_PAIRS:
        return Route(ids, None, None, n_experts)
    block_m = experts_block_m(n, n_experts)
    n_tiles = -(-n // block_m) + min(n_experts, n)
    ids = ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    tiles = (counts + block_m - 1) // block_m                       # per expert
    tile_end = tiles.cumsum(0)
    by_expert = ids[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[by_expert]   # within its expert
    slot = (tile_end - tiles)[by_expert] * block_m + rank
    pairs = torch.full((n_tiles * block_m,), -1, dtype=torch.int32, device=ids.device).scatter_(0, slot, order.int())
    tile_expert = torch.searchsorted(tile_end, torch.arange(n_tiles, device=ids.device), right=True).int()
    return Route(ids, pairs, tile_expert, n_experts)


def gemm_experts(x: torch.Tensor, weight: torch.Tensor, route_: Route, ggml_type=None,
                 dot: str | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture's prompt in one launch: pair p's row of x (``pairs_per_row``) times expert
    ids[p]'s matrix, through ``route_``'s tiles -> y (P, N) float32, times scales[p] if given. ``weight``: (E, N, row_bytes)
    uint8 blocks of ``ggml_type``, or with ``ggml_type`` None dense experts (E, N, K) in x's own
    float type, read as stored. ``dot`` as ``gemm``'s."""
    if ggml_type is None:
        _check_dense_experts(x, weight, route_.ids)
        _check_scales(route_.ids, scales)
        (n, k), type_code = weight.shape[1:], _kernel().DENSE.value
        row_stride = k                                          # elements, for the dense tiles
    else:
        _check_experts(x, weight, route_.ids, ggml_type, scales)
        n, row_stride, type_code = weight.shape[1], weight.shape[2], int(ggml_type)
    config = gemm_config(route_.block_m)
    y = torch.empty(route_.ids.numel(), n, device=x.device, dtype=torch.float32)
    dtype, precision = _dot_operands(dot, x.dtype)
    grid = (route_.tile_expert.numel(), -(-n // config["BLOCK_N"]))
    _kernel().quant_gemm_experts[grid](x.contiguous(), weight.contiguous(), grid_table(ggml_type, x.device),
                                       route_.pairs, route_.tile_expert, _scales(scales, x), y,
                                       n, x.shape[1], row_stride, n * row_stride, route_.n_experts,
                                       route_.ids.numel() // x.shape[0], TYPE=type_code,
                                       DOT_DTYPE=dtype, PRECISION=precision, SCALED=scales is not None,
                                       **config, **FP_FUSION, **pdl(x.device))
    return y


def _check_dense_experts(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> None:
    """x (T, K), weight (E, N, K) of x's dtype on x's kernel device, the pairs' ids (``pairs_per_row``)."""
    pairs_per_row(x, ids)
    if weight.dim() != 3 or x.shape[1] != weight.shape[2] or weight.dtype != x.dtype:
        raise ValueError(f"x (T, K) and weight (E, N, K) of one dtype expected, got "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype} and ids {tuple(ids.shape)}")
    if not runs_on(x) or weight.device != x.device:
        raise ValueError(f"x and weight on one CUDA device expected (the CPU under TRITON_INTERPRET=1), "
                         f"got {x.device} and {weight.device}")


def _dot_operands(dot: str | None, dtype: torch.dtype) -> tuple:
    """tl.dot's (operand dtype, input precision) for ``dot`` (default ``default_dot(dtype)``)."""
    kernel = _kernel()
    dot = dot or default_dot(dtype)
    if dot not in kernel.DOTS:
        raise ValueError(f"unknown dot {dot!r}; valid: {', '.join(kernel.DOTS)}")
    return kernel.DOTS[dot]


def experts_matmul(x: torch.Tensor, blocks: torch.Tensor, route_: Route, ggml_type,
                   scales: torch.Tensor | None = None) -> torch.Tensor:
    """Each pair's row of x (``pairs_per_row``) times its expert's matrix -> (P, N) float32, times
    scales[p] if given: the GEMV for a few pairs, the grouped GEMM (tl.dot in x's own type) for
    a prompt's, as ``route_`` decided."""
    if route_.tile_expert is None:
        return gemv_experts(x, blocks, route_.ids, ggml_type, scales)
    return gemm_experts(x, blocks, route_, ggml_type, scales=scales)


def experts_swiglu(x: torch.Tensor, blocks: torch.Tensor, route_: Route, ggml_type) -> torch.Tensor:
    """Each pair's silu(gate) * up from its expert's fused [gate; up] matrix (E, 2I, row_bytes)
    -> (P, I) in x's type: in the GEMV's launch for a few pairs, after the grouped GEMM (one
    launch more, ``swiglu.silu_mul``) for a prompt's."""
    if route_.tile_expert is None:
        return gemv_experts(x, blocks, route_.ids, ggml_type, swiglu=True, out_dtype=x.dtype)
    gate, up = gemm_experts(x, blocks, route_, ggml_type).chunk(2, dim=-1)
    return silu_mul(gate, up, x.dtype)


def gemm(x: torch.Tensor, blocks: torch.Tensor, ggml_type, dot: str | None = None,
         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (M, K) float; blocks (N, row_bytes) uint8 of ``ggml_type`` -> y (M, N) of ``out_dtype``
    (float32 sums, rounded once when stored). ``dot``: tl.dot's operands, "fp16", "bf16", "tf32"
    or "ieee" (exact float32); default ``default_dot(x.dtype)``."""
    _check(x, blocks, ggml_type)
    dtype, precision = _dot_operands(dot, x.dtype)
    (m, k), n = x.shape, blocks.shape[0]
    config = gemm_config(m)
    y = torch.empty(m, n, device=x.device, dtype=out_dtype)
    grid = (-(-m // config["BLOCK_M"]), -(-n // config["BLOCK_N"]))
    _kernel().quant_gemm[grid](x.contiguous(), blocks.contiguous(), grid_table(ggml_type, x.device), y,
                               m, n, k, blocks.shape[1], TYPE=int(ggml_type), DOT_DTYPE=dtype, PRECISION=precision,
                               **config, **FP_FUSION, **pdl(x.device))
    return y


def default_dot(dtype: torch.dtype) -> str:
    """The GEMM's operands for activations of ``dtype``: their own half type; float32 as torch's
    own matmuls would take them (``torch.set_float32_matmul_precision``: exact fp32 at "highest",
    its default, else tf32, which keeps fp32's range where fp16 could overflow)."""
    if dtype in (torch.float16, torch.bfloat16):
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return _float32_precision()


def _float32_precision() -> str:
    """"tf32" or "ieee": torch's float32 matmul precision for CUDA, read through the per-backend
    API. torch's legacy getter raises once any per-backend setting has been made, and kvslim's
    CPU prompts make one (``models/matmul_precision.py``: oneDNN's bf16x3 during a forward)."""
    own = torch.backends.cuda.matmul.fp32_precision               # "none": the process-wide setting
    if own == "none":
        own = torch.backends.fp32_precision
    return "tf32" if own == "tf32" else "ieee"


def matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type, dot: str | None = None,
           out_dtype: torch.dtype = torch.float32, swiglu: bool = False) -> torch.Tensor:
    """x (M, K) float; blocks (N, row_bytes) -> y (M, N) of ``out_dtype``: the GEMV up to
    MAX_GEMV_ROWS rows (decode), else the GEMM with ``dot`` operands (``gemm``'s).
    ``kvslim.weights.quant_linear`` calls it for weights on the kernels' device, around its own
    reshapes, column order and bias, with out_dtype x's (rounded from float32 sums as torch's
    .to() would: round to nearest even). ``swiglu``: blocks are a fused [gate; up] projection
    and y (M, N / 2) = silu(gate) * up (``gemv``'s; after the GEMM, one launch more)."""
    if x.shape[0] <= MAX_GEMV_ROWS:
        return gemv(x, blocks, ggml_type, out_dtype=out_dtype, swiglu=swiglu)
    if not swiglu:
        return gemm(x, blocks, ggml_type, dot, out_dtype)
    gate, up = gemm(x, blocks, ggml_type, dot).chunk(2, dim=-1)
    return silu_mul(gate, up, out_dtype)
