"""Decode attention with 4-bit codes decoded straight into tensor-core operands
(``paged_prefill.attend`` with KERNEL "mma"; imported only when it runs).

The tile kernel (``_paged_prefill_kernel``) decodes a block of keys in a layout of Triton's
choosing and hands the tile to ``tl.dot``, which stages it through shared memory behind
barriers every block. Triton's language cannot say where a value should live, and its compiler
does not move the decoding past that staging (checked in session 46: an elementwise-only
decoding, byte permutes included, was still decoded first and staged after). Gluon, Triton's
layout-explicit dialect, can: here each lane loads exactly the 2-byte units whose codes its
``mma`` operand registers hold, decodes them there (``_codes4``: 11 instructions for 4 values),
and the conversion to the operand layout is a relabelling, asserted at compile time
(``convert_layout(..., assert_trivial=True)``). No shared memory, no barrier in a step.

One warp a program, one program per (KV head, sequence, split of keys), as the other decode
kernels. With the GQA group's 8 query rows as the products' narrow side, the products are
transposed: scores^T (N keys, 8 rows) = K (N, D) q^T, and out^T (D, 8) += V^T (D, N) P^T.
- K as operand A: lane (g, r) (g = lane // 4, r = lane % 4) holds keys g and g + 8, and of each
  16 dimensions of a k-step the 4 at (2r, 2r + 1, 2r + 8, 2r + 9). Dimensions are relabelled so
  those 4 are one unit's codes: logical k = 16j + 8h + 2r + e is code 2h + e of unit 4j + r
  (physical dimension 16j + 4r + 2h + e). q^T takes the same relabelling when it is loaded.
- V^T as operand A: lane (g, r) holds dimensions g + 8i and, of each 16 keys, 2r, 2r + 1,
  2r + 8, 2r + 9. Logical dimension g + 8i is physical 16g + i (within a block of 128): a
  lane's 16 dimensions of a key are 4 consecutive units. The sums come out in that order and
  are stored back in the physical order.
- A block's f16 scale (turbo4's norm, one per 128 values) is not multiplied per value: scores
  are each block's products times its keys' K norms, and P^T is scaled by the V norms per block.

Formats: codes of 4 bits packed little-endian (turbo4's layout: [f16 norm][64 bytes] per 128
values) read through a 16-entry table, K and V, head_dim 128 or 256, up to 8 query rows.
``paged_prefill._mma_config`` refuses the rest by name.

Under Triton's interpreter (the CI), Gluon has no interpreter: the same function bodies run as
Triton kernels, with ``gl``'s layout calls read as no-ops (``_AS_TRITON``), ``mma_v2`` as
float32 products of the f16 operands, and the byte permutes as a table read. Layouts do not
change what a kernel computes, so the interpreter's parity covers the logic; the compiled form
is checked for its layout (no shared memory, trivial conversions) by an sm_90 compile, and for
its values on a lent GPU.
"""
from __future__ import annotations

import types

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.runtime.jit import JITFunction



@triton.jit
def _probe():
    pass


INTERPRETED = not isinstance(_probe, JITFunction)           # TRITON_INTERPRET=1 when kernels are decorated
BLOCK = gl.constexpr(128)   # values a block of the formats read here: one f16 scale each

# A unit's four codes -> their f16 table entries by byte permutes: ``prmt`` picks bytes of a
# register pair by 3-bit selectors, so each byte plane of the table ($5-$8 the entries' low bytes,
# $9-$12 their high bytes, 4 a word) is read in its lower and upper 8 entries by the code's low 3
# bits, and bit 3 picks between the two (selector n + 4); the planes are then interleaved into
# two f16 pairs. tests/test_triton_decode_mma.py runs this text's meaning over every unit.
PERMUTE_ASM = gl.constexpr("""
{
.reg .b32 sel, pick, a, b, lo, hi, pair0, pair1;
and.b32 sel, $4, 0x7777;
and.b32 pick, $4, 0x8888;
shr.u32 pick, pick, 1;
or.b32 pick, pick, 0x3210;
prmt.b32 a, $5, $6, sel;
prmt.b32 b, $7, $8, sel;
prmt.b32 lo, a, b, pick;
prmt.b32 a, $9, $10, sel;
prmt.b32 b, $11, $12, sel;
prmt.b32 hi, a, b, pick;
prmt.b32 pair0, lo, hi, 0x5140;
prmt.b32 pair1, lo, hi, 0x7362;
mov.b32 {$0, $1}, pair0;
mov.b32 {$2, $3}, pair1;
}
""")
COMPILED = gl.constexpr(not INTERPRETED)


def _plane_word(lut, plane: tl.constexpr, word: tl.constexpr):
    """Word ``word`` of a code table's byte plane ``plane`` (0: the f16 entries' low bytes, 1:
    their high bytes): entries 4 word .. 4 word + 3 of the float32 table at ``lut``, one a byte."""
    w = (gl.load(lut + 4 * word).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32) >> (8 * plane)) & 0xFF
    for b in gl.static_range(1, 4):
        bits = gl.load(lut + 4 * word + b).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
        w = w | (((bits >> (8 * plane)) & 0xFF) << (8 * b))
    return w


def _planes(lut):
    """The first 16 entries of a code table as f16 byte planes: ``PERMUTE_ASM``'s $5-$12."""
    return (_plane_word(lut, 0, 0), _plane_word(lut, 0, 1), _plane_word(lut, 0, 2), _plane_word(lut, 0, 3),
            _plane_word(lut, 1, 0), _plane_word(lut, 1, 1), _plane_word(lut, 1, 2), _plane_word(lut, 1, 3))


def _codes4(unit, lut, planes):
    """2-byte units (any shape; codes at bits 0, 4, 8, 12) -> their four codes' f16 table entries,
    joined (..., e, h): code 2h + e. Compiled: the byte permutes; interpreted: a table read."""
    if COMPILED:
        a, b, c, d = gl.inline_asm_elementwise(
            PERMUTE_ASM, "=h,=h,=h,=h,r,r,r,r,r,r,r,r,r",
            [unit.to(gl.uint32), planes[0], planes[1], planes[2], planes[3], planes[4], planes[5], planes[6],
             planes[7]], (gl.float16, gl.float16, gl.float16, gl.float16), True, 1)
    else:
        code = unit.to(gl.int32)
        a = gl.load(lut + (code & 15)).to(gl.float16)
        b = gl.load(lut + ((code >> 4) & 15)).to(gl.float16)
        c = gl.load(lut + ((code >> 8) & 15)).to(gl.float16)
        d = gl.load(lut + ((code >> 12) & 15)).to(gl.float16)
    return gl.join(gl.join(a, b), gl.join(c, d))


def _rows(table_at, t, end, PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr):
    """Key positions t -> their rows in a head's pool through the sequence's block-table row
    (``_codecs.pool_rows``'s reading; 0 past ``end``, never read)."""
    page = gl.load(table_at + t // PAGE_SIZE, mask=t < end, other=0)
    slot = page * PAGE_SIZE + t % PAGE_SIZE
    if WIDE:
        slot = slot.to(gl.int64)
    return slot


def _k_block(k_head, table_at, t, end, row_bytes, b: tl.constexpr, lut, planes, N: tl.constexpr,
             PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr, layout: tl.constexpr, operand: tl.constexpr):
    """Block b of N keys' K rows at positions t (N,) as operand A (N, 128) in the relabelled order
    (logical k = 16j + 8h + 2r + e: code 2h + e of unit 4j + r); masked keys' codes as 0."""
    row = k_head + _rows(table_at, t, end, PAGE_SIZE, WIDE) * row_bytes
    units = (row + b * (BLOCK // 2 + 2) + 2).to(gl.pointer_type(gl.uint16))
    u = gl.arange(0, BLOCK // 4, layout=gl.SliceLayout(0, layout))
    x = _codes4(gl.load(units[:, None] + u[None, :], mask=(t < end)[:, None], other=0), lut, planes)
    x = gl.reshape(gl.permute(gl.reshape(x, [N, BLOCK // 16, 4, 2, 2]), [0, 1, 4, 2, 3]), [N, BLOCK])
    return gl.convert_layout(x, operand, assert_trivial=COMPILED)


def _v_block(v_head, table_at, t, end, row_bytes, b: tl.constexpr, lut, planes, N: tl.constexpr,
             PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr, layout: tl.constexpr, operand: tl.constexpr):
    """Block b of N keys' V rows at positions t (N,) as operand A of V^T (128, N), logical
    dimension g + 8i being physical 16g + i (unit 4g + i // 4, code i % 4)."""
    row = v_head + _rows(table_at, t, end, PAGE_SIZE, WIDE) * row_bytes
    units = (row + b * (BLOCK // 2 + 2) + 2).to(gl.pointer_type(gl.uint16))
    u = gl.arange(0, BLOCK // 4, layout=gl.SliceLayout(1, layout))
    x = _codes4(gl.load(units[None, :] + u[:, None], mask=(t < end)[None, :], other=0), lut, planes)
    x = gl.reshape(gl.permute(gl.reshape(x, [8, 4, N, 2, 2]), [1, 4, 3, 0, 2]), [BLOCK, N])
    return gl.convert_layout(x, operand, assert_trivial=COMPILED)


def _norms(head, table_at, t, end, row_bytes, b: tl.constexpr, PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr):
    """Block b's f16 scale of the rows at positions t, float32; 0 past ``end``."""
    row = head + _rows(table_at, t, end, PAGE_SIZE, WIDE) * row_bytes + b * (BLOCK // 2 + 2)
    return gl.load(row.to(gl.pointer_type(gl.float16)), mask=t < end, other=0.0).to(gl.float32)


def _stored_as(value, ptr):
    """``_codecs.stored_as``: float32 in ptr's element type, bf16 rounded to nearest even by its bits."""
    if ptr.dtype.element_ty == gl.bfloat16:
        bits = value.to(gl.uint32, bitcast=True)
        top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        top = gl.where(value != value, 0x7FC0, top)
        out = top.to(gl.uint16).to(gl.bfloat16, bitcast=True)
    else:
        out = value.to(ptr.dtype.element_ty)
    return out


def paged_decode_mma(q_ptr, q_pos_ptr, k_pool, v_pool, table_ptr, lengths_ptr, k_lut, v_lut,
                     m_out, l_out, acc_out,
                     n_seq, n_rows, n_pages, k_row_bytes, v_row_bytes, table_stride,
                     n_splits, split_keys,
                     q_heads, q_seqs, q_rows, q_scale, slots_ptr, length_offset, o_heads, o_seqs, o_rows,
                     gate_ptr, g_heads, g_seqs, g_rows,
                     HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, N: tl.constexpr,
                     WIDE: tl.constexpr,
                     BY_SLOT: tl.constexpr = False, NORMALISE: tl.constexpr = False, GATED: tl.constexpr = False):
    """``paged_prefill_tile``'s decode launch with its arguments and outputs: the state of rows
    0..n_rows-1 (at most 8) of (KV head, sequence) over the keys of one split, N keys a step, or
    with NORMALISE (one split) the output itself (times sigmoid of the gate with GATED). BLOCK_M:
    the rows' side of the products, 8 (``paged_prefill.MMA_ROWS``)."""
    ROWS: gl.constexpr = BLOCK_M
    NB: gl.constexpr = HEAD_DIM // BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    k_units: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 1], [1, 0])     # (N keys, 32 units): operand A's lanes
    v_units: gl.constexpr = gl.BlockedLayout([4, 2], [8, 4], [1, 1], [1, 0])     # (32 units, N keys): V^T's lanes
    h = gl.program_id(0)
    s = gl.program_id(1)
    split = gl.program_id(2)
    length = gl.load(lengths_ptr + s).to(gl.int32) + length_offset
    if BY_SLOT:
        table_row = gl.load(slots_ptr + s).to(gl.int64)
    else:
        table_row = s.to(gl.int64)
    table_at = table_ptr + table_row * table_stride
    k_head = k_pool + h.to(gl.int64) * n_pages * PAGE_SIZE * k_row_bytes
    v_head = v_pool + h.to(gl.int64) * n_pages * PAGE_SIZE * v_row_bytes
    k_planes = _planes(k_lut)
    v_planes = _planes(v_lut)

    # q^T per block (128, ROWS), operand B, in K's relabelled order, scaled, f16
    kq = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, b_op))
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_op))
    dim = (kq // 16) * 16 + ((kq // 2) % 4) * 4 + ((kq // 8) % 2) * 2 + kq % 2
    q_at = q_ptr + h.to(gl.int64) * q_heads + s.to(gl.int64) * q_seqs + rq[None, :] * q_rows + dim[:, None]
    q_live = (rq < n_rows)[None, :] & (dim < BLOCK)[:, None]
    q0 = (gl.load(q_at, mask=q_live, other=0.0).to(gl.float32) * q_scale).to(gl.float16)
    q1 = q0
    if NB == 2:
        q1 = (gl.load(q_at + BLOCK, mask=q_live, other=0.0).to(gl.float32) * q_scale).to(gl.float16)

    begin = split * split_keys
    end = gl.minimum(begin + split_keys, length)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(0, mma))
    acc0 = gl.full([BLOCK, ROWS], 0.0, gl.float32, layout=mma)
    acc1 = acc0
    keys_k = gl.arange(0, N, layout=gl.SliceLayout(1, k_units))
    keys_v = gl.arange(0, N, layout=gl.SliceLayout(0, v_units))
    keys_s = gl.arange(0, N, layout=gl.SliceLayout(1, mma))
    for start in range(begin, end, N):
        zero = gl.full([N, ROWS], 0.0, gl.float32, layout=mma)
        t = start + keys_s
        k0 = _k_block(k_head, table_at, start + keys_k, end, k_row_bytes, 0, k_lut, k_planes, N, PAGE_SIZE, WIDE,
                      k_units, a_op)
        scores = mma_v2(k0, q0, zero) * _norms(k_head, table_at, t, end, k_row_bytes, 0, PAGE_SIZE, WIDE)[:, None]
        if NB == 2:
            k1 = _k_block(k_head, table_at, start + keys_k, end, k_row_bytes, 1, k_lut, k_planes, N, PAGE_SIZE,
                          WIDE, k_units, a_op)
            scores += mma_v2(k1, q1, zero) * _norms(k_head, table_at, t, end, k_row_bytes, 1, PAGE_SIZE,
                                                    WIDE)[:, None]
        scores = gl.where((t < end)[:, None], scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)          # a row without keys yet: exp(-inf) = 0
        p = gl.exp(scores - m_safe[None, :])
        corr = gl.exp(m_i - m_safe)
        l_i = l_i * corr + gl.sum(p, axis=0)
        m_i = m_new
        v0 = _v_block(v_head, table_at, start + keys_v, end, v_row_bytes, 0, v_lut, v_planes, N, PAGE_SIZE, WIDE,
                      v_units, a_op)
        p0 = p * _norms(v_head, table_at, t, end, v_row_bytes, 0, PAGE_SIZE, WIDE)[:, None]
        acc0 = mma_v2(v0, gl.convert_layout(p0.to(gl.float16), b_op), acc0 * corr[None, :])
        if NB == 2:
            v1 = _v_block(v_head, table_at, start + keys_v, end, v_row_bytes, 1, v_lut, v_planes, N, PAGE_SIZE,
                          WIDE, v_units, a_op)
            p1 = p * _norms(v_head, table_at, t, end, v_row_bytes, 1, PAGE_SIZE, WIDE)[:, None]
            acc1 = mma_v2(v1, gl.convert_layout(p1.to(gl.float16), b_op), acc1 * corr[None, :])

    # the sums' logical dimension d (block b) is physical b * 128 + 16 (d % 8) + d // 8
    d = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    d_out = (d % 8) * 16 + d // 8
    r_live = r < n_rows
    live = r_live[None, :] & (d_out < BLOCK)[:, None]
    if NORMALISE:
        o_at = acc_out + h.to(gl.int64) * o_heads + s.to(gl.int64) * o_seqs + r[None, :] * o_rows + d_out[:, None]
        g_at = gate_ptr + h.to(gl.int64) * g_heads + s.to(gl.int64) * g_seqs + r[None, :] * g_rows + d_out[:, None]
        out0 = acc0 / l_i[None, :]
        if GATED:
            out0 = 1.0 / (1.0 + gl.exp(-gl.load(g_at, mask=live, other=0.0).to(gl.float32))) * out0
        gl.store(o_at, _stored_as(out0, acc_out), mask=live)
        if NB == 2:
            out1 = acc1 / l_i[None, :]
            if GATED:
                out1 = 1.0 / (1.0 + gl.exp(-gl.load(g_at + BLOCK, mask=live, other=0.0).to(gl.float32))) * out1
            gl.store(o_at + BLOCK, _stored_as(out1, acc_out), mask=live)
    else:
        part = ((h.to(gl.int64) * n_seq + s) * n_splits + split) * n_rows + r     # (ROWS,) rows of this split
        gl.store(m_out + part, m_i, mask=r_live)
        gl.store(l_out + part, l_i, mask=r_live)
        at = acc_out + part[None, :] * HEAD_DIM + d_out[:, None]
        gl.store(at, acc0, mask=live)
        if NB == 2:
            gl.store(at + BLOCK, acc1, mask=live)


# ---- the same bodies as Triton kernels, for the interpreter --------------------------------

def _layout(*args, **kwargs):
    return None


def _products(a, b, acc):
    """``mma_v2``'s value: f16 operands' products exact in float32, summed in float32."""
    return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


class _AsTriton:
    """``gl`` read as triton.language: layouts are None and conversions keep their value; the rest
    is tl's, looked up at each use (the interpreter patches tl's functions while a kernel runs).
    Called from plain Python, not from a kernel's text, so sizes are wrapped as constexprs here."""
    NVMMADistributedLayout = DotOperandLayout = BlockedLayout = SliceLayout = staticmethod(_layout)

    @staticmethod
    def convert_layout(x, layout, assert_trivial=False):
        return x

    @staticmethod
    def arange(start, end, layout=None):
        return tl.arange(tl.constexpr(start), tl.constexpr(end))

    @staticmethod
    def full(shape, value, dtype, layout=None):
        return tl.full([tl.constexpr(n) for n in shape], value, dtype)

    @staticmethod
    def reshape(x, shape):
        return tl.reshape(x, [tl.constexpr(n) for n in shape])

    @staticmethod
    def permute(x, dims):
        return tl.permute(x, [tl.constexpr(n) for n in dims])

    def __getattr__(self, name):
        return getattr(tl, name)


_AS_TRITON = _AsTriton()

_BODIES = (_plane_word, _planes, _codes4, _rows, _k_block, _v_block, _norms, _stored_as, paged_decode_mma)


def _decorate():
    """Each body decorated for where it runs: Gluon's jit when compiled; under the interpreter,
    Triton's jit on a copy that reads ``gl`` as ``_AS_TRITON`` and ``mma_v2`` as ``_products``."""
    if not INTERPRETED:
        return {fn.__name__: gluon.jit(fn) for fn in _BODIES}
    scope = dict(globals(), gl=_AS_TRITON, mma_v2=_products, tl=tl)
    done = {}
    for fn in _BODIES:
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__doc__, copy.__module__, copy.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
        copy.__annotations__ = fn.__annotations__              # a new function has none: the constexprs' marks
        done[fn.__name__] = scope[fn.__name__] = triton.jit(copy)
    return done


globals().update(_decorate())
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
