"""The Triton kernel of ``rotation`` (imported only when one runs: importing kvslim needs no triton),
and the Hadamard butterfly the append kernel shares."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, sigmoid, stored_as


@triton.jit
def hadamard(y, ROT: tl.constexpr, LOG2_ROT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
             rot_scale):
    """H / sqrt(ROT) on every run of ROT values of y (BLOCK_M, BLOCK_D): rotation.hadamard_blocks'
    butterfly, pair (i, i ^ h) for h = 1, 2, 4, ... (the same sums, so the same bits), then the scale."""
    d = tl.broadcast_to(tl.arange(0, BLOCK_D)[None, :], (BLOCK_M, BLOCK_D))
    for s in tl.static_range(LOG2_ROT):
        partner = tl.gather(y, d ^ (1 << s), 1)
        y = tl.where((d & (1 << s)) == 0, y + partner, partner - y)
    return y * rot_scale


K_CHUNK = tl.constexpr(16)     # rows of the matrix a tl.dot takes (``times_matrix``; tl.dot's least K)


@triton.jit
def times_matrix(x_at, live, m_ptr, m_rows, m_cols, divisor, GROUP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, COLS: tl.constexpr, col0, DIVIDE: tl.constexpr = False,
                 STEP: tl.constexpr = K_CHUNK):
    """Groups of GROUP values at x_at (..., 1) pointers where ``live`` (any float type; with DIVIDE
    each divided by ``divisor``, correctly rounded, a tensor broadcasting to x's chunks: the turbo
    append's unit vectors) times columns col0 .. col0 + COLS of the (GROUP, GROUP) matrix at m_ptr
    (strides m_rows, m_cols) -> (ROWS, COLS) float32 (zero past GROUP): float32 products (tl.dot's
    ieee), STEP of the matrix's rows a step (K_CHUNK by default), x's matching columns (of BLOCK,
    GROUP padded) read for each. In one tl.dot the whole matrix sat in registers (64 KB at 128 x
    128): sm_90 (Triton 3.6) spilled 7,064 bytes a thread in the rotation's launch and 752 in the
    turbo append's, both on every decode step's path of a turbo cache; in steps of 16 rows, none.
    A slice of 16 columns fits in one step (STEP = BLOCK: every load issued before the product).
    Each column's products accumulate in k's order, whichever columns and steps a call takes."""
    j = col0 + tl.arange(0, COLS)
    y = tl.zeros((ROWS, COLS), tl.float32)
    for c in tl.static_range(BLOCK // STEP):
        xc, mc = matrix_step_operands(x_at, live, m_ptr, m_rows, m_cols, c * STEP + tl.arange(0, STEP), j, GROUP)
        y = matrix_step(xc, mc, y, divisor, ROWS, STEP, DIVIDE)
    return y


@triton.jit
def matrix_step_operands(x_at, live, m_ptr, m_rows, m_cols, k, j, GROUP: tl.constexpr):
    """One ``times_matrix`` step's loads: x's columns k (float32) and the matrix's rows k, columns
    j (zero padded past GROUP). The turbo append issues them itself, ahead of its norms."""
    xc = tl.load(x_at + k, mask=live & (k < GROUP), other=0.0).to(tl.float32)
    mc = tl.load(m_ptr + k[:, None] * m_rows + j[None, :] * m_cols,
                 mask=(k[:, None] < GROUP) & (j[None, :] < GROUP), other=0.0)
    return xc, mc


@triton.jit
def matrix_step(xc, mc, y, divisor, ROWS: tl.constexpr, STEP: tl.constexpr, DIVIDE: tl.constexpr):
    """y plus x's columns (each divided by ``divisor``, correctly rounded, with DIVIDE) times the
    matrix's rows, ``matrix_step_operands``' pair: float32 products (tl.dot's ieee)."""
    if DIVIDE:
        xc, d = tl.broadcast(xc, divisor)
        xc = tl.math.div_rn(xc, d)
    return tl.dot(tl.reshape(xc, (ROWS, STEP)), mc, y, input_precision="ieee")


@triton.jit
def rotate_rows(x_ptr, m_ptr, out_ptr, n_rows, n_inner, outer_stride, inner_stride, m_rows, m_cols, rot_scale,
                gate_ptr, gate_outer, gate_inner,
                D: tl.constexpr, BLOCK_M: tl.constexpr, HADAMARD: tl.constexpr, LOG2_ROT: tl.constexpr,
                GROUP: tl.constexpr, N_GROUPS: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                GATED: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr = False):
    """Rows r of x (D values each, any float type; row r at (r // n_inner) * outer_stride +
    (r % n_inner) * inner_stride) -> out (n_rows, D) float32, BLOCK_M rows a program. HADAMARD:
    H / sqrt(2^LOG2_ROT) on each run of 2^LOG2_ROT values (the butterfly, NB * BLOCK columns).
    Else each of the N_GROUPS groups of GROUP values (padded to BLOCK) times the (GROUP, GROUP)
    matrix at m_ptr read at strides (m_rows, m_cols): y = x M, float32 products (tl.dot's ieee),
    COLS of each group's columns a program (grid axis 1: BLOCK // COLS programs share a block of
    rows, each reading its slice of the matrix in one step; the butterfly: COLS = BLOCK).
    GATED: y times sigmoid of the gate (rows at strides gate_outer, gate_inner as x's), stored in
    out's type (gated attention's output gate: ``swiglu.sigmoid_mul``'s math)."""
    after_previous(PDL)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < n_rows
    row = (r // n_inner).to(tl.int64) * outer_stride + (r % n_inner).to(tl.int64) * inner_stride
    b = tl.arange(0, NB)[None, :, None]
    col0 = tl.program_id(1) * COLS                                   # this program's columns of each group
    i = (col0 + tl.arange(0, COLS))[None, None, :]
    inside = live[:, None, None] & (b < N_GROUPS) & (i < GROUP)
    if GATED:                           # loaded first: its wait shares the product's operands' (one round trip)
        gate_row = (r // n_inner).to(tl.int64) * gate_outer + (r % n_inner).to(tl.int64) * gate_inner
        gate = tl.load(gate_ptr + gate_row[:, None, None] + b * GROUP + i, mask=inside, other=0.0)
    if HADAMARD:
        x = tl.load(x_ptr + row[:, None, None] + b * GROUP + i, mask=inside, other=0.0).to(tl.float32)
        y = tl.reshape(hadamard(tl.reshape(x, (BLOCK_M, NB * BLOCK)), 1 << LOG2_ROT, LOG2_ROT, BLOCK_M, NB * BLOCK,
                                rot_scale), (BLOCK_M, NB, BLOCK))
    else:
        y = times_matrix(x_ptr + row[:, None, None] + b * GROUP, live[:, None, None] & (b < N_GROUPS), m_ptr,
                         m_rows, m_cols, 1.0, GROUP, BLOCK_M * NB, BLOCK, COLS, col0, STEP=BLOCK)
        y = tl.reshape(y, (BLOCK_M, NB, COLS))
    if GATED:
        y = sigmoid(gate.to(tl.float32)) * y
    tl.store(out_ptr + r.to(tl.int64)[:, None, None] * D + b * GROUP + i, stored_as(y, out_ptr), mask=inside)


INTERPRETED = not isinstance(rotate_rows, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
