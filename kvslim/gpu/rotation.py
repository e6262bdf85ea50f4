"""Row rotations in one Triton launch: the K/V formats' code domains on the GPU.

A quantized K or V format that rotates its rows moves a decode step's queries into its code
domain and the attention output back, once per attention layer. The torch forms launched, per
call, 3 kernels a butterfly round for llama.cpp's Hadamard rotation (q8_0, q4_0, iq4_nl: 8
rounds at head_dim 256, so 25 launches for q with its cast) and a cast and a matmul for
TurboQuant's. ``hadamard`` (the same butterfly, so the same bits as
``formats.rotation.hadamard_blocks_torch``) and ``rotate`` (each group times a matrix, float32
products) read any float type where it lies and write float32 in one launch;
``to_code_domain`` / ``from_code_domain`` take them for a format that declares its rotation
(``KVFormat.code_rotation``), else the format's own torch form. tests/test_gpu_rotation.py
holds them to the torch forms under Triton's interpreter.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import gpu                      # gpu.TRITON read at each call: benchmarks flip it in-process
from . import FP_FUSION, kernels, pdl, pow2
from .swiglu import gated

BLOCK_M = 16            # rows a program: tl.dot's smallest M for the matrix form
# The matrix form's columns a program (tl.dot's smallest N). A decode step's 16 query rows of a
# 128 x 128 turbo rotation were one program on one SM, reading the 64 KB matrix 16 rows at a
# time and waiting on each read in turn: 8 round trips to memory (sm_90 SASS, Triton 3.6:
# ``gpu.load_waves``), in each attention layer of each step. Split by columns they are 8
# programs, each with its 8 KB slice and the rows' x in one tl.dot, all its loads (the gate's
# too) issued before the first is read: one round trip.
MATRIX_COLS = 16
# warps a program: the butterfly's 4; the matrix form's 8 (43 registers, 760 instructions a
# thread at head_dim 256; at 2 warps 242 registers, and the gated form spilled)
WARPS = {True: 4, False: 8}


def _kernel():
    return kernels("_rotation_kernel")                  # imports triton: only when a kernel runs


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel can run on x's device here (``kvslim.gpu.runs_on``)."""
    return gpu.serves("_rotation_kernel", x.device)


def to_code_domain(fmt, x: torch.Tensor) -> torch.Tensor:
    """``fmt.to_code_domain`` of x (..., D) of any float type, float32 where the format rotates: in
    one launch where it declares its rotation (``code_rotation``) and the kernel serves x."""
    rotation = _declared(fmt, x)
    return fmt.to_code_domain(x.float()) if rotation is None else _rotated(x, rotation, inverse=False)


def from_code_domain(fmt, y: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """``fmt.from_code_domain`` of y (..., D), as ``to_code_domain``. ``gate``: gated attention's
    gate (y's shape, any float type, rows at any strides): the result times sigmoid(gate), in
    the gate's type, in the same launch (else ``swiglu.gated``'s)."""
    rotation = _declared(fmt, y)
    if rotation is None:
        out = fmt.from_code_domain(y)
        return out if gate is None else gated(out, gate)
    return _rotated(y, rotation, inverse=True, gate=gate)


def _rotated(x: torch.Tensor, rotation, inverse: bool, gate: torch.Tensor | None = None) -> torch.Tensor:
    """x through a declared rotation (``CodeRotation``), or back through it: the Hadamard is its
    own inverse; a matrix R rotates by x R^T and back by y R."""
    if rotation.matrix is None:
        return _launch(x, None, rotation.size, _scale(rotation.size), rotation.size.bit_length() - 1, gate)
    matrix = rotation.matrix if inverse else rotation.matrix.T
    return _launch(x, _checked(x, matrix), rotation.size, 1.0, gate=gate)


def _declared(fmt, x: torch.Tensor):
    """The format's declared rotation where the kernel takes x for it, else None: the kernels are
    on (``kvslim.gpu.TRITON``) and run on x's device, outside autograd (the kernel has no
    backward) and outside a graph torch.compile traces (inductor fuses the torch forms there)."""
    if not (gpu.TRITON and fmt.transformed and x.is_floating_point() and runs_on(x)
            and not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling()):
        return None
    return fmt.code_rotation(x.shape[-1], x.device)


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """H / sqrt(n) on every run of n values (a power of two dividing D) of x (..., D) of any
    float type -> float32 (..., D): ``hadamard_blocks_torch``'s rounds, in one launch."""
    if n < 2 or n & (n - 1) or x.shape[-1] % n:
        raise ValueError(f"runs of a power of two n >= 2 dividing the rows expected, got n={n} for {tuple(x.shape)}")
    return _launch(x, None, n, _scale(n), hadamard_rounds=n.bit_length() - 1)


@lru_cache(maxsize=None)
def _scale(n: int) -> float:
    """n ** -0.5 as torch's ``y * n ** -0.5`` rounds it (float32), worked out on the CPU whatever the
    default device (a CUDA scalar's float() would sync, and break a CUDA graph's capture), once."""
    return float(torch.tensor(n ** -0.5, dtype=torch.float32, device="cpu"))


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Each run of g values of x (..., D) of any float type times ``matrix`` (g, g) float32 (any
    strides: pass R.T to rotate by R) -> float32 (..., D), float32 products: the torch form
    ``(x.float().reshape(..., D // g, g) @ matrix).reshape(x.shape)`` in one launch."""
    return _launch(x, _checked(x, matrix), matrix.shape[0], 1.0)


def _checked(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    g = matrix.shape[0]
    if matrix.shape != (g, g) or matrix.dtype != torch.float32 or g < 16 or x.shape[-1] % g \
            or matrix.device != x.device:
        raise ValueError(f"a float32 (g, g) matrix on x's device, g >= 16 dividing the rows, expected, got "
                         f"{tuple(matrix.shape)} {matrix.dtype} on {matrix.device} for {tuple(x.shape)} on {x.device}")
    return matrix


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as (outer, inner, D) rows at two strides (a view of a projection's heads reads in
    place), else a contiguous copy."""
    if not x.is_floating_point():
        raise ValueError(f"a float tensor expected, got {x.dtype}")
    rows = x.reshape(-1, 1, x.shape[-1]) if x.dim() < 3 else x.flatten(0, -3)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, matrix: torch.Tensor | None, group: int, scale: float,
            hadamard_rounds: int = 0, gate: torch.Tensor | None = None) -> torch.Tensor:
    """One ``rotate_rows`` launch over x's rows -> float32, or with ``gate`` (x's shape) the rows
    times sigmoid(gate) in the gate's type."""
    rows, dim = _rows(x), x.shape[-1]
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"a gate of the rows' shape {tuple(x.shape)} expected, got {tuple(gate.shape)}")
    gates = rows if gate is None else _rows(gate)                       # the plain rotation: a stand-in
    outer, inner = rows.shape[:2]
    out = torch.empty(x.shape, dtype=torch.float32 if gate is None else gate.dtype, device=x.device)
    n_rows = outer * inner
    if n_rows and dim:
        m, m_strides = (out, (0, 0)) if matrix is None else (matrix, matrix.stride())   # the butterfly: a stand-in
        config = launch_config(dim, group, hadamard_rounds if matrix is None else None, gate is not None)
        _kernel().rotate_rows[(-(-n_rows // BLOCK_M), config["BLOCK"] // config["COLS"])](
            rows, m, out, n_rows, inner, rows.stride(0), rows.stride(1), *m_strides, scale,
            gates, gates.stride(0), gates.stride(1), **config, **FP_FUSION, **pdl(out.device))
    return out


def launch_config(dim: int, group: int, hadamard_rounds: int | None, gated: bool) -> dict:
    """``rotate_rows``' constexprs and warps for rows of ``dim`` in groups of ``group``: the
    butterfly of 2^hadamard_rounds, or (None) the matrix form, MATRIX_COLS of a group's columns a
    program (the butterfly needs every column)."""
    block, n_groups = pow2(group), dim // group
    hadamard = hadamard_rounds is not None
    return dict(D=dim, BLOCK_M=BLOCK_M, HADAMARD=hadamard, LOG2_ROT=hadamard_rounds or 0, GROUP=group,
                N_GROUPS=n_groups, NB=pow2(n_groups), BLOCK=block, GATED=gated,
                COLS=block if hadamard else min(MATRIX_COLS, block), num_warps=WARPS[hadamard])
