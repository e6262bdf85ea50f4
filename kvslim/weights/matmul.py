"""x @ W.T with W kept as ggml blocks.

``quant_linear`` (the fast path) hands activations on a GPU to the Triton kernels
(``kvslim.gpu.quant_matmul``: a GEMV for decode rows, a dequantize-tile GEMM for prompts), and
on the CPU a few activation rows (decode) to the C kernel
``kvslim::block_linear`` (every type kvslim keeps packed, and f16/bf16 rows), which unpacks
each block in registers; otherwise (more rows, or no compiler) it dequantizes a
step of W's rows at a time with the torch decoders and multiplies it, so the extra memory is one step of float32 rows (plus the
decoder's temporaries of that order) whatever the matrix size. ``reference_linear``
expands the whole matrix with ``gguf.quants`` first: slow and memory-hungry, obviously
right; the parity tests hold the two together.

Why this path and this step (benchmarks/weights.py, one thread, CPU shared with another
job; spreads of 10-30% between runs):
- Keeping the dequantized matrix (dense f32) is the fastest (decode of a 100M-weight
  model: 23 ms of matmuls per token against 42-68 ms) but holds 4 bytes per weight, the
  memory this feature exists to save.
- torch's packed int4 kernel maps Q4_0 exactly (scale d, zero 0) only with float32 or
  float16 scales and activations, and there it is slower still (169 ms per decoded token,
  and 2.6 s for 512 tokens through one 8192x256 matrix); it is fast only in bfloat16,
  where the scales and activations round (relative error 4e-3).
- Steps: glibc hands freed blocks of a few MiB back to the OS and the next step faults
  them in again. Decoding the 100M-weight Q8_0 model at 4 MiB steps took 115,000 page
  faults and 0.28 s per token (3.6 t/s); at 256 KiB steps, no faults and 17 t/s (1 MiB:
  some faults, 18 t/s; 128 KiB: 12 t/s, per-step overhead). Prefill is alike at all
  steps (~330 t/s), so the step is set for decode and stays out of glibc's way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import gpu
from ..gpu import quant_matmul as gpu_weights
from ..native import block_linear as native
from .tensor import QuantTensor

STEP_BYTES = 256 << 10        # float32 bytes of dequantized rows per step
# ...and at least this many multiply-adds per step's matmul. A mixture's prompt gives each
# expert a few dozen tokens: in steps of 256 KiB (32 rows of 2048) the bundled-size steps made
# 14,000 torch.mm calls of ~37 us for one 256-token chunk of a Qwen3.6-35B-A3B-shaped model
# (4 layers, Q4_K_M), 60% of its prompt time; with this floor 1.6x the prompt speed. A dense
# prompt's steps (hundreds of tokens) stay as they were.
STEP_MACS = 1 << 25


def rows_per_step(w: QuantTensor, n_tokens: int = 1) -> int:
    """W's rows dequantized at once for ``n_tokens`` activation rows."""
    return max(1, STEP_BYTES // (4 * w.cols), -(-STEP_MACS // (max(1, n_tokens) * w.cols)))


def quant_linear(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for a 2-d quantized W (out, in); x (..., in) float."""
    flat = x.reshape(-1, x.shape[-1])
    if w.input_index is not None:
        flat = flat.index_select(1, w.input_index)                  # into the file's column order
    out = _in_kernel(flat, w)
    if out is not None:
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], w.shape[0])
    rows = w.shape[0]
    out = flat.new_empty(flat.shape[0], rows)
    step = rows_per_step(w, flat.shape[0])
    for start in range(0, rows, step):
        torch.mm(flat, _decoded(w, w.data[start:start + step]).to(flat.dtype).T, out=out[:, start:start + step])
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], rows)


def _decoded(w: QuantTensor, blocks: torch.Tensor) -> torch.Tensor:
    """A step of W's rows as float32: the C dequantizer on the CPU (each value written once,
    3-9x torch's decoders; gguf's exact values), else the torch decoders."""
    if native.dequantizes(w.wtype.name, blocks):
        return native.dequantize_rows(blocks, w.wtype.name, w.cols)
    return w.decode(blocks)


def _in_kernel(flat: torch.Tensor, w: QuantTensor) -> torch.Tensor | None:
    """flat @ W.T with W's blocks unpacked in registers: the Triton kernels on a GPU (when they are
    on), the C kernel for a few rows on the CPU; None where neither serves."""
    if w.data.dim() != 2:
        return None
    if _triton_serves(flat, w):
        return gpu_weights.matmul(flat, w.data, w.wtype.ggml_type, out_dtype=flat.dtype)
    if native.supports(w.wtype.name, flat):                         # decode: a few rows
        return torch.ops.kvslim.block_linear(flat, w.data, w.wtype.name)
    return None


def quant_linear_add_norm(x: torch.Tensor, w: QuantTensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm of residual + x @ W.T, residual + x @ W.T) with the add and norm in the GEMV's
    launch (``quant_matmul.gemv``'s ``add_norm``: ``add_norm.add_rms_norm``'s bits) for a decode
    batch's rows on the GPU kernels; None where that does not serve (the caller adds and norms).
    The residual's shape and type are the caller's to match (``models.layers.AddNorm.kernel_args``)."""
    if (w.input_index is not None or w.data.dim() != 2 or x.dim() != 2 or x.shape[0] > gpu_weights.MAX_GEMV_ROWS
            or not _triton_serves(x, w)):
        return None
    return gpu_weights.gemv(x, w.data, w.wtype.ggml_type, out_dtype=x.dtype, add_norm=(residual, norm_weight, eps))


def _triton_serves(x: torch.Tensor, w: QuantTensor) -> bool:
    """Whether the GPU kernels are on and take W's type on x's device."""
    return gpu.TRITON and gpu_weights.supports(w.wtype.ggml_type) and gpu_weights.runs_on(x)


def reference_linear(x: torch.Tensor, w: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The whole W through ``gguf.quants.dequantize``, then F.linear."""
    return F.linear(x, w.reference_dequantize().to(x.dtype), bias)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense weight, ``quant_linear`` for a quantized one."""
    if isinstance(w, QuantTensor):
        return quant_linear(x, w, bias)
    return F.linear(x, w, bias)


def embedding_rows(ids: torch.Tensor, w: QuantTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` of a quantized (vocab, hidden) matrix in ``dtype``: only those rows' blocks are
    decoded (where the GPU kernels run, in one launch, ``quant_matmul.rows``)."""
    if w.input_index is None and w.data.dim() == 2 and _triton_serves(w.data, w):
        return gpu_weights.rows(ids, w.data, w.wtype.ggml_type, w.cols, dtype)
    rows = w.data.index_select(0, ids.reshape(-1))
    values = w.decode(rows)
    if w.input_index is not None:
        values = values.index_select(-1, torch.argsort(w.input_index))
    return values.reshape(*ids.shape, w.cols).to(dtype)
