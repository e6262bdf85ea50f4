"""Decode attention with packed codes decoded straight into tensor-core operands
(``paged_prefill.attend`` with KERNEL "mma"; imported only when it runs).

The tile kernel (``_paged_prefill_kernel``) decodes a block of keys in a layout of Triton's
choosing and hands the tile to ``tl.dot``, which stages it through shared memory behind
barriers every block. Triton's language cannot say where a value should live, and its compiler
does not move the decoding past that staging (checked in session 46: an elementwise-only
decoding, byte permutes included, was still decoded first and staged after). Gluon, Triton's
layout-explicit dialect, can: here each lane loads exactly the 2-byte units whose codes its
``mma`` operand registers hold, decodes them there (``_group``: byte permutes, about 3
instructions a value), and the conversion to the operand layout is a relabelling, asserted at
compile time (``convert_layout(..., assert_trivial=True)``). No shared memory, no barrier in a
step.

One warp a program, one program per (KV head, sequence, split of keys), as the other decode
kernels. With the GQA group's 8 query rows as the products' narrow side, the products are
transposed: scores^T (N keys, 8 rows) = K (N, D) q^T, and out^T (D, 8) += V^T (D, N) P^T.
- Codes come in groups of 16 (4 units of 4-bit codes, 3 of 3-bit, 2 of 2-bit), 8 a block of 128.
- K as operand A: lane (g, r) (g = lane // 4, r = lane % 4) holds keys g and g + 8, and of each
  16 dimensions of a k-step the 4 at (2r, 2r + 1, 2r + 8, 2r + 9), 32 of a block. Dimensions are
  relabelled so those 32 are groups 2r and 2r + 1: logical k = 16j + 8h + 2r + e is code
  32r + 4j + 2h + e. q^T takes the same relabelling when it is loaded.
- V^T as operand A: lane (g, r) holds dimensions g + 8i and, of each 16 keys, 2r, 2r + 1,
  2r + 8, 2r + 9. Logical dimension g + 8i is physical 16g + i (within a block of 128): a
  lane's 16 dimensions of a key are group g. The sums come out in that order and are stored
  back in the physical order.
- A block's f16 scale (the turbo formats' norm, one per 128 values) is not multiplied per value:
  scores are each block's products times its keys' K norms, and P^T is scaled by the V norms
  per block.

Formats, K and V each: codes of 4, 3 or 2 bits packed little-endian after a block's f16 norm
(turbo4, turbo3 and turbo2: [f16][16 x BITS bytes] per 128 values) read through a table; q8_0
([f16 scale][32 int8] per 32 values: a lane of K holds one whole block of a key, and the scale
is multiplied per value); q4_0 and iq4_nl ([f16 scale][16 bytes of nibbles] per 32 values, byte i
= code i | code i + 16 << 4: K's relabelling follows the nibbles, a lane's k-step j being unit j
of its block, and the scale is multiplied per value); f16 rows. head_dim 128 or 256, up to 8
query rows.
``paged_prefill._mma_config`` refuses the rest by name.

Under Triton's interpreter (the CI), Gluon has no interpreter: the same function bodies run as
Triton kernels, with ``gl``'s layout calls read as no-ops (``_AsTriton``), ``mma_v2`` as
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

from ._codecs import gated, pool_rows, prefetch_l2, prefetch_lines, sequence_pages, stored_as


@triton.jit
def _probe():
    pass


INTERPRETED = not isinstance(_probe, JITFunction)           # TRITON_INTERPRET=1 when kernels are decorated
BLOCK = gl.constexpr(128)   # values a block of the formats read here: one f16 scale each
# L2_AHEAD's prefetch (``_l2_rows``): lines a pool row may span (f16 rows at head_dim 256: 512 bytes,
# 5 lines unaligned)
L2_LINES = gl.constexpr(8)

# A unit's four 4-bit codes -> their f16 table entries by byte permutes: ``prmt`` picks bytes of
# a register pair by 3-bit selectors, so each byte plane of the table ($5-$8 the entries' low
# bytes, $9-$12 their high bytes, 4 a word) is read in its lower and upper 8 entries by the code's
# low 3 bits, and bit 3 picks between the two (selector n + 4); the planes are then interleaved
# into two f16 pairs. tests/test_triton_decode_mma.py runs these texts' meaning over every unit.
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


def _narrow_asm(bits: int) -> str:
    """A group of 16 codes of 3 or 2 bits (3 or 2 units, $16..; little-endian, code c at bit bits * c)
    -> their 16 f16 entries ($0-$15) of an 8-entry table ($16 + units ..: low-byte words, then
    high-byte words, 2 each). Four codes at a time: their bits spread to a nibble each in two
    steps (fields of bits, 2 bits, then one apart), then one ``prmt`` a byte plane, interleaved."""
    units = bits                            # 16 codes x bits = bits 2-byte units
    lo, hi = f"${16 + units}, ${17 + units}", f"${18 + units}, ${19 + units}"
    lines = ["{", ".reg .b32 w0, w1, x, a, b, s, lo, hi, pair;", "prmt.b32 w0, $16, $17, 0x5410;"]
    if bits == 3:                           # bits 16..47, for the codes past bit 31
        lines.append("prmt.b32 w1, $17, $18, 0x5410;")
    width = 4 * bits                        # a chunk of 4 codes
    first, second = (0x3F, 0x0707) if bits == 3 else (0x0F, 0x0303)
    for k in range(4):
        start = width * k
        word, shift = ("w0", start) if start + width <= 32 else ("w1", start - 16)
        lines += [f"shr.u32 x, {word}, {shift};",
                  f"and.b32 a, x, {first:#x};", f"shl.b32 b, x, {8 - 2 * bits};",
                  f"and.b32 b, b, {first << 8:#x};", "or.b32 s, a, b;",
                  f"and.b32 a, s, {second:#x};", f"shl.b32 b, s, {4 - bits};",
                  f"and.b32 b, b, {second << 4:#x};", "or.b32 s, a, b;",
                  f"prmt.b32 lo, {lo}, s;", f"prmt.b32 hi, {hi}, s;",
                  "prmt.b32 pair, lo, hi, 0x5140;", f"mov.b32 {{${4 * k}, ${4 * k + 1}}}, pair;",
                  "prmt.b32 pair, lo, hi, 0x7362;", f"mov.b32 {{${4 * k + 2}, ${4 * k + 3}}}, pair;"]
    return "\n".join(lines + ["}"])


THREE_ASM = gl.constexpr(_narrow_asm(3))
TWO_ASM = gl.constexpr(_narrow_asm(2))
COMPILED = gl.constexpr(not INTERPRETED)
H16 = gl.constexpr((gl.float16,) * 16)
OUT16 = gl.constexpr(",".join(["=h"] * 16))


def _plane_word(lut, plane: tl.constexpr, word: tl.constexpr):
    """Word ``word`` of a code table's byte plane ``plane`` (0: the f16 entries' low bytes, 1:
    their high bytes): entries 4 word .. 4 word + 3 of the float32 table at ``lut``, one a byte."""
    w = (gl.load(lut + 4 * word).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32) >> (8 * plane)) & 0xFF
    for b in gl.static_range(1, 4):
        bits = gl.load(lut + 4 * word + b).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
        w = w | (((bits >> (8 * plane)) & 0xFF) << (8 * b))
    return w


def _planes(lut):
    """The first 16 entries of a code table as f16 byte planes: ``PERMUTE_ASM``'s $5-$12. Built
    here, once a program, not on the host: loaded words went to uniform registers, and every
    asm call then copied them (sm_90, turbo4/turbo4: 1,586 instructions a step of 16 keys and
    197 registers, against 1,363 and 172)."""
    return (_plane_word(lut, 0, 0), _plane_word(lut, 0, 1), _plane_word(lut, 0, 2), _plane_word(lut, 0, 3),
            _plane_word(lut, 1, 0), _plane_word(lut, 1, 1), _plane_word(lut, 1, 2), _plane_word(lut, 1, 3))


def _unit4(unit, lut, planes):
    """A 2-byte unit's four 4-bit codes (bits 0, 4, 8, 12) -> their f16 table entries. Compiled:
    the byte permutes; interpreted: a table read."""
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
    return a, b, c, d


def _code(u0, u1, u2, c: tl.constexpr, BITS: tl.constexpr):
    """Code c of a group of 16 from its units (the interpreter's reading, as ``_codecs._cut_codes``)."""
    if BITS == 3:
        if c < 10:
            code = ((u0.to(gl.int32) | (u1.to(gl.int32) << 16)) >> (3 * c)) & 7
        else:
            code = ((u1.to(gl.int32) | (u2.to(gl.int32) << 16)) >> (3 * c - 16)) & 7
    else:                                   # 2 bits: 8 codes a unit
        if c < 8:
            code = (u0.to(gl.int32) >> (2 * c)) & 3
        else:
            code = (u1.to(gl.int32) >> (2 * c - 16)) & 3
    return code


def _join16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """16 tensors of one shape -> one (..., 2, 2, 2, 2): value c = 8 b3 + 4 b2 + 2 b1 + b0 at
    [..., b0, b1, b2, b3] (each join's new axis goes last)."""
    e0 = gl.join(gl.join(gl.join(a0, a1), gl.join(a2, a3)), gl.join(gl.join(a4, a5), gl.join(a6, a7)))
    e1 = gl.join(gl.join(gl.join(a8, a9), gl.join(a10, a11)), gl.join(gl.join(a12, a13), gl.join(a14, a15)))
    return gl.join(e0, e1)


def _group(u0, u1, u2, u3, lut, planes, BITS: tl.constexpr, scale=None):
    """A group of 16 codes (its units u0.. of any one shape: 4 for 4-bit codes, 3 for 3-bit, 2 for
    2-bit) -> their 16 f16 table entries (times ``scale`` in f16, of the units' shape, where
    given: the nibble formats' block scales), joined by ``_join16``: value c is code c of the
    group (for 4-bit units, unit c // 4's nibble c % 4)."""
    if BITS == 4:
        a0, a1, a2, a3 = _unit4(u0, lut, planes)
        a4, a5, a6, a7 = _unit4(u1, lut, planes)
        a8, a9, a10, a11 = _unit4(u2, lut, planes)
        a12, a13, a14, a15 = _unit4(u3, lut, planes)
    elif COMPILED:
        if BITS == 3:
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = gl.inline_asm_elementwise(
                THREE_ASM, OUT16 + ",r,r,r,r,r,r,r",
                [u0.to(gl.uint32), u1.to(gl.uint32), u2.to(gl.uint32), planes[0], planes[1], planes[4], planes[5]],
                H16, True, 1)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15 = gl.inline_asm_elementwise(
                TWO_ASM, OUT16 + ",r,r,r,r,r,r",
                [u0.to(gl.uint32), u1.to(gl.uint32), planes[0], planes[1], planes[4], planes[5]], H16, True, 1)
    else:
        a0 = gl.load(lut + _code(u0, u1, u2, 0, BITS)).to(gl.float16)
        a1 = gl.load(lut + _code(u0, u1, u2, 1, BITS)).to(gl.float16)
        a2 = gl.load(lut + _code(u0, u1, u2, 2, BITS)).to(gl.float16)
        a3 = gl.load(lut + _code(u0, u1, u2, 3, BITS)).to(gl.float16)
        a4 = gl.load(lut + _code(u0, u1, u2, 4, BITS)).to(gl.float16)
        a5 = gl.load(lut + _code(u0, u1, u2, 5, BITS)).to(gl.float16)
        a6 = gl.load(lut + _code(u0, u1, u2, 6, BITS)).to(gl.float16)
        a7 = gl.load(lut + _code(u0, u1, u2, 7, BITS)).to(gl.float16)
        a8 = gl.load(lut + _code(u0, u1, u2, 8, BITS)).to(gl.float16)
        a9 = gl.load(lut + _code(u0, u1, u2, 9, BITS)).to(gl.float16)
        a10 = gl.load(lut + _code(u0, u1, u2, 10, BITS)).to(gl.float16)
        a11 = gl.load(lut + _code(u0, u1, u2, 11, BITS)).to(gl.float16)
        a12 = gl.load(lut + _code(u0, u1, u2, 12, BITS)).to(gl.float16)
        a13 = gl.load(lut + _code(u0, u1, u2, 13, BITS)).to(gl.float16)
        a14 = gl.load(lut + _code(u0, u1, u2, 14, BITS)).to(gl.float16)
        a15 = gl.load(lut + _code(u0, u1, u2, 15, BITS)).to(gl.float16)
    if scale is not None:       # f16 products of entry and scale, as the tile kernel's f16 operands
        a0, a1, a2, a3, a4, a5, a6, a7 = a0 * scale, a1 * scale, a2 * scale, a3 * scale, a4 * scale, a5 * scale, \
            a6 * scale, a7 * scale
        a8, a9, a10, a11, a12, a13, a14, a15 = a8 * scale, a9 * scale, a10 * scale, a11 * scale, a12 * scale, \
            a13 * scale, a14 * scale, a15 * scale
    return _join16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)


def _units(row, b: tl.constexpr, g, live, BITS: tl.constexpr, BYTES: tl.constexpr):
    """The 2-byte units of groups g (any shape; group g holds codes 16g .. 16g + 15) of block b
    (BYTES each, an f16 first) of the rows at byte pointers ``row`` (g's shape), 0 where not
    ``live``: u0 .. u3, the last ones repeated where a group has fewer (BITS of them)."""
    at = (row + b * BYTES + 2).to(gl.pointer_type(gl.uint16)) + g * BITS
    u0 = gl.load(at, mask=live, other=0)
    u1 = gl.load(at + 1, mask=live, other=0)
    u2 = u1
    u3 = u1
    if BITS >= 3:
        u2 = gl.load(at + 2, mask=live, other=0)
        u3 = u2
    if BITS == 4:
        u3 = gl.load(at + 3, mask=live, other=0)
    return (u0, u1, u2, u3)


# q8_0: a 2-byte unit's two int8 codes ($2) -> their values times the block's f16 scale ($3, in both
# halves), rounded once to f16 as the tile kernel's f16 products take them: the bytes made
# unsigned (+128) and set under f16 1024's exponent (1024 + v is exact: f16's step is 1 there),
# 1152 subtracted (exact), then one f16 multiply a value (.rn: never fused into anything else).
Q8_ASM = gl.constexpr("""
{
.reg .b32 t, k;
mov.b32 k, 0x64646464;
prmt.b32 t, $2, k, 0x5140;
xor.b32 t, t, 0x00800080;
mov.b32 k, 0x64806480;
sub.rn.f16x2 t, t, k;
mul.rn.f16x2 t, t, $3;
mov.b32 {$0, $1}, t;
}
""")


def _q8_pair(unit, scale2, scale):
    """A unit's two int8 codes times the f16 scale -> two f16 values (scale2: the scale's bits in
    both halves of a u32, for the asm; scale: as f16, for the interpreter)."""
    if COMPILED:
        lo, hi = gl.inline_asm_elementwise(Q8_ASM, "=h,=h,r,r", [unit.to(gl.uint32), scale2], (gl.float16, gl.float16),
                                           True, 1)
    else:
        u = unit.to(gl.int32)
        lo = (((u & 0xFF) ^ 0x80) - 128).to(gl.float16) * scale
        hi = ((((u >> 8) & 0xFF) ^ 0x80) - 128).to(gl.float16) * scale
    return lo, hi


def _q8_units(row, b: tl.constexpr, g, live, BYTES: tl.constexpr):
    """q8_0 rows: group g (codes 16g .. 16g + 15 of block b of 128: half of q8_0 block 4b + g // 2,
    BYTES each) at byte pointers ``row`` (g's shape), 0 where not ``live`` -> its block's f16
    scale and its 8 units (two codes each)."""
    block = row + (4 * b + g // 2) * BYTES
    scale = gl.load(block.to(gl.pointer_type(gl.float16)), mask=live, other=0.0)
    at = (block + 2 + 16 * (g % 2)).to(gl.pointer_type(gl.uint16))
    return (scale, gl.load(at, mask=live, other=0), gl.load(at + 1, mask=live, other=0),
            gl.load(at + 2, mask=live, other=0), gl.load(at + 3, mask=live, other=0),
            gl.load(at + 4, mask=live, other=0), gl.load(at + 5, mask=live, other=0),
            gl.load(at + 6, mask=live, other=0), gl.load(at + 7, mask=live, other=0))


def _q8_group(raw):
    """``_q8_units``' scale and units -> the group's 16 values times the scale, joined as ``_group``
    joins."""
    scale = raw[0]
    bits = scale.to(gl.uint16, bitcast=True).to(gl.uint32)
    scale2 = bits | (bits << 16)
    a0, a1 = _q8_pair(raw[1], scale2, scale)
    a2, a3 = _q8_pair(raw[2], scale2, scale)
    a4, a5 = _q8_pair(raw[3], scale2, scale)
    a6, a7 = _q8_pair(raw[4], scale2, scale)
    a8, a9 = _q8_pair(raw[5], scale2, scale)
    a10, a11 = _q8_pair(raw[6], scale2, scale)
    a12, a13 = _q8_pair(raw[7], scale2, scale)
    a14, a15 = _q8_pair(raw[8], scale2, scale)
    return _join16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)


def _nibble_units(row, b: tl.constexpr, g, live, BYTES: tl.constexpr):
    """q4_0 and iq4_nl rows ([f16 scale][16 bytes] per 32 values, byte i = code i | code i + 16 << 4):
    group g of block b of 128 is half of block 4b + g // 2, its units 4 (g % 2) .. + 3 (codes
    2w, 2w + 16, 2w + 1, 2w + 17 in unit w's nibbles). -> u0 .. u3 and the block's f16 scale."""
    block = row + (4 * b + g // 2) * BYTES
    scale = gl.load(block.to(gl.pointer_type(gl.float16)), mask=live, other=0.0)
    at = (block + 2).to(gl.pointer_type(gl.uint16)) + 4 * (g % 2)
    return (gl.load(at, mask=live, other=0), gl.load(at + 1, mask=live, other=0), gl.load(at + 2, mask=live, other=0),
            gl.load(at + 3, mask=live, other=0), scale)


def _load_groups(row, b: tl.constexpr, g, live, BITS: tl.constexpr, BYTES: tl.constexpr, NIBBLES: tl.constexpr):
    """The loads of groups g of block b of 128 values of the rows at ``row`` (broadcast to g's
    shape), 0 where not ``live``: a tuple of what ``_decode_groups`` takes (q8_0: the scale and 8
    units; q4_0 and iq4_nl: 4 units and the scale; packed codes: 4 units, the last repeated where
    a group has fewer). Apart from the decoding, so that a step may issue all its loads first."""
    if BITS == 8:
        raw = _q8_units(row, b, g, live, BYTES)
    elif NIBBLES:
        raw = _nibble_units(row, b, g, live, BYTES)
    else:
        raw = _units(row, b, g, live, BITS, BYTES)
    return raw


def _decode_groups(raw, lut, planes, BITS: tl.constexpr, NIBBLES: tl.constexpr):
    """``_load_groups``' loads decoded in the lanes that hold them -> joined 16 values a group
    (``_join16``)."""
    if BITS == 8:
        x = _q8_group(raw)
    elif NIBBLES:
        x = _group(raw[0], raw[1], raw[2], raw[3], lut, planes, BITS, raw[4])
    else:
        x = _group(raw[0], raw[1], raw[2], raw[3], lut, planes, BITS)
    return x


def _k_load(k_head, slot, t, end, row_bytes, b: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
            BYTES: tl.constexpr, NIBBLES: tl.constexpr, layout: tl.constexpr):
    """The loads of block b of N keys' K rows (positions t (N,), rows ``slot`` of the head's pool:
    ``_codecs.pool_rows``), masked keys' as 0, in the lanes whose operand registers take them
    (``_k_operand``): f16 rows a lane's 32 values of a key as they lie (16-byte loads), packed
    rows the units of groups 2r and 2r + 1 in lane r (``layout``)."""
    if BITS == 16:
        rows: gl.constexpr = gl.BlockedLayout([1, 2, 16], [8, 4, 1], [1, 1, 1], [2, 1, 0])   # (N, 8 groups, 16)
        t = gl.convert_layout(t, gl.SliceLayout(1, gl.SliceLayout(2, rows)), assert_trivial=COMPILED)
        slot = gl.convert_layout(slot, gl.SliceLayout(1, gl.SliceLayout(2, rows)), assert_trivial=COMPILED)
        row = (k_head + slot * row_bytes + b * BLOCK * BYTES).to(gl.pointer_type(gl.float16))
        g = gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, rows)))
        c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, rows)))
        raw = (gl.load(row[:, None, None] + (16 * g)[None, :, None] + c[None, None, :],
                       mask=(t < end)[:, None, None] & (g < 8)[None, :, None] & (c < 16)[None, None, :], other=0.0),)
    else:
        g = gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(0, layout))
        raw = _load_groups((k_head + slot * row_bytes)[:, None], b, g[None, :], (t < end)[:, None] & (g < 8)[None, :],
                           BITS, BYTES, NIBBLES)
    return raw


def _k_operand(raw, lut, planes, N: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr, operand: tl.constexpr):
    """``_k_load``'s loads as operand A (N, 128), relabelled: lane r holds codes 32r .. 32r + 31 of
    a key (groups 2r and 2r + 1), logical k = 16j + 8h + 2r + e being code 32r + 4j + 2h + e."""
    if BITS == 16:
        x = gl.permute(gl.reshape(raw[0], [N, 4, 2, 2, 2, 2, 2]), [0, 2, 3, 4, 5, 1, 6])  # [n, gg, b3, b2, b1, r, b0]
    else:
        x = _decode_groups(raw, lut, planes, BITS, NIBBLES)             # [n, 2r + gg, b0, b1, b2, b3]
        x = gl.permute(gl.reshape(x, [N, 4, 2, 2, 2, 2, 2]), [0, 2, 6, 5, 4, 1, 3])   # [n, gg, b3, b2, b1, r, b0]
    return gl.convert_layout(gl.reshape(x, [N, BLOCK]), operand, assert_trivial=COMPILED)


def _v_load(v_head, slot, t, end, row_bytes, b: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
            BYTES: tl.constexpr, NIBBLES: tl.constexpr, layout: tl.constexpr):
    """The loads of block b of N keys' V rows (positions t (N,), rows ``slot``), masked keys' as 0,
    in the lanes of ``_v_operand``: lane g (of 8) group g's 16 codes of its keys."""
    if BITS == 16:
        rows: gl.constexpr = gl.BlockedLayout([1, 2, 16], [8, 4, 1], [1, 1, 1], [2, 1, 0])   # (8 groups, N, 16)
        t = gl.convert_layout(t, gl.SliceLayout(0, gl.SliceLayout(2, rows)), assert_trivial=COMPILED)
        slot = gl.convert_layout(slot, gl.SliceLayout(0, gl.SliceLayout(2, rows)), assert_trivial=COMPILED)
        row = (v_head + slot * row_bytes + b * BLOCK * BYTES).to(gl.pointer_type(gl.float16))
        g = gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, rows)))
        c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, rows)))
        raw = (gl.load(row[None, :, None] + (16 * g)[:, None, None] + c[None, None, :],
                       mask=(t < end)[None, :, None] & (g < 8)[:, None, None] & (c < 16)[None, None, :], other=0.0),)
    else:
        g = gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(1, layout))
        raw = _load_groups((v_head + slot * row_bytes)[None, :], b, g[:, None], (t < end)[None, :] & (g < 8)[:, None],
                           BITS, BYTES, NIBBLES)
    return raw


def _v_operand(raw, lut, planes, N: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr, operand: tl.constexpr):
    """``_v_load``'s loads as operand A of V^T (128, N), relabelled: logical dimension g + 8i is
    physical 16g + i."""
    if BITS == 16:
        x = gl.permute(gl.reshape(raw[0], [BLOCK // 16, N, 2, 2, 2, 2]), [2, 3, 4, 5, 0, 1])   # [b3, b2, b1, b0, g, n]
    else:
        x = _decode_groups(raw, lut, planes, BITS, NIBBLES)             # [g, n, b0, b1, b2, b3]
        x = gl.permute(x, [5, 4, 3, 2, 0, 1])                           # [b3, b2, b1, b0, g, n]
    return gl.convert_layout(gl.reshape(x, [BLOCK, N]), operand, assert_trivial=COMPILED)


def _norm(head, slot, t, end, row_bytes, b: tl.constexpr, BITS: tl.constexpr, BYTES: tl.constexpr,
          NIBBLES: tl.constexpr):
    """Block b's f16 norms of the rows ``slot`` at positions t (0 past ``end``) for the turbo formats,
    whose one norm a block of 128 is folded after the products (``_normed``); 0 for the rest (f16
    rows have none, and q8_0's and the nibble formats' scales, one a block of 32, are multiplied
    per value), which ``_normed`` does not read."""
    norm = 0
    if BITS <= 4 and not NIBBLES:
        norm = gl.load((head + slot * row_bytes + b * BYTES).to(gl.pointer_type(gl.float16)), mask=t < end, other=0.0)
    return norm


def _normed(x, norm, BITS: tl.constexpr, NIBBLES: tl.constexpr):
    """x (N keys, ROWS) times ``_norm``'s norms where the format has them; else x as it is."""
    if BITS <= 4 and not NIBBLES:
        x = x * norm.to(gl.float32)[:, None]
    return x


def _block_reads(head, slot, slot_s, tt, t, end, row_bytes, b: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
                 BYTES: tl.constexpr, NIBBLES: tl.constexpr, layout: tl.constexpr, IS_K: tl.constexpr):
    """Block b's loads of a step's keys on one side, K (``IS_K``) or V, and its norms (``_norm``).
    tt: the keys' positions in ``layout``'s slice, t in the scores' (the norms'); slot and slot_s
    their pool rows."""
    if IS_K:
        raw = _k_load(head, slot, tt, end, row_bytes, b, N, BITS, BYTES, NIBBLES, layout)
    else:
        raw = _v_load(head, slot, tt, end, row_bytes, b, N, BITS, BYTES, NIBBLES, layout)
    return raw, _norm(head, slot_s, t, end, row_bytes, b, BITS, BYTES, NIBBLES)


def _reads(head, slot, slot_s, tt, t, end, row_bytes, NB: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr,
           BYTES: tl.constexpr, NIBBLES: tl.constexpr, layout: tl.constexpr, IS_K: tl.constexpr):
    """A step's loads of one side, every block's (``_block_reads``): block 0's loads and norms,
    then block 1's, which are block 0's where the head has one block."""
    r0, n0 = _block_reads(head, slot, slot_s, tt, t, end, row_bytes, 0, N, BITS, BYTES, NIBBLES, layout, IS_K)
    r1 = r0
    n1 = n0
    if NB == 2:
        r1, n1 = _block_reads(head, slot, slot_s, tt, t, end, row_bytes, 1, N, BITS, BYTES, NIBBLES, layout, IS_K)
    return r0, n0, r1, n1


def _scores(raw, norm, q, zero, lut, planes, N: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr,
            operand: tl.constexpr):
    """One block's scores^T (N keys, ROWS) from its K loads and norms: K q^T, times the norms."""
    return _normed(mma_v2(_k_operand(raw, lut, planes, N, BITS, NIBBLES, operand), q, zero), norm, BITS, NIBBLES)


def _weighted(raw, norm, p, corr, acc, lut, planes, N: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr,
              operand: tl.constexpr, b_operand: tl.constexpr):
    """One block's out^T (128, ROWS) rescaled by ``corr`` plus V^T P^T, P^T times the block's norms."""
    v = _v_operand(raw, lut, planes, N, BITS, NIBBLES, operand)
    pt = gl.convert_layout(_normed(p, norm, BITS, NIBBLES).to(gl.float16), b_operand)
    return mma_v2(v, pt, acc * corr[None, :])


def _l2_rows(head, slot, live, row_bytes, layout: tl.constexpr):
    """Ask L2 for the pool rows ``slot`` (keys, in ``layout``'s rows) of a head at byte pointer
    ``head``, row_bytes each, where ``live``: a (keys, L2_LINES) tile of addresses
    (``_codecs.prefetch_lines``, the GEMVs' prefetch's: every line of each row, which need not be
    line-aligned: turbo4's rows are 132 bytes). Waits for nothing. Under the interpreter, which
    runs no PTX, nothing."""
    if COMPILED:
        line = gl.arange(0, L2_LINES, layout=gl.SliceLayout(0, layout))
        prefetch_l2(head, *prefetch_lines(slot, row_bytes, 0, row_bytes, line, live))


def paged_decode_mma(q_ptr, q_pos_ptr, k_pool, v_pool, table_ptr, lengths_ptr, k_lut, v_lut,
                     m_out, l_out, acc_out,
                     n_seq, n_rows, n_pages, k_row_bytes, v_row_bytes, table_stride,
                     n_splits, split_keys,
                     q_heads, q_seqs, q_rows, q_scale, slots_ptr, length_offset, o_heads, o_seqs, o_rows,
                     gate_ptr, g_heads, g_seqs, g_rows,
                     HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, N: tl.constexpr,
                     WIDE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_BYTES: tl.constexpr,
                     V_BYTES: tl.constexpr,
                     K_NIBBLES: tl.constexpr = False, V_NIBBLES: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                     EARLY: tl.constexpr = 0, L2_AHEAD: tl.constexpr = 0,
                     BY_SLOT: tl.constexpr = False, NORMALISE: tl.constexpr = False, GATED: tl.constexpr = False):
    """``paged_prefill_tile``'s decode launch with its arguments and outputs: the state of rows
    0..n_rows-1 (at most 8) of (KV head, sequence) over the keys of one split, N keys a step, or
    with NORMALISE (one split) the output itself (times sigmoid of the gate with GATED). BLOCK_M:
    the rows' side of the products, 8 (``paged_prefill.MMA_ROWS``). PREFETCH 1: each step's pool
    rows read from the block table a step ahead (turbo4/turbo4: 172 -> 210 registers); 0 (the
    default), at use. EARLY 1: every load of a step (K's and V's codes and norms) issued before any
    decoding; 0 (the default), each block's where it is decoded, which sm_90 SASS shows as several
    bursts of loads a step, each waited on (K's blocks, V's after the scores). EARLY 1 with
    PREFETCH 1 waits on memory once a step, for 251 registers (turbo4/turbo4). L2_AHEAD D > 0: each
    step asks L2 for the K and V rows of the step D on (``_l2_rows``), from table entries read a
    step before, so that a step's own loads wait on L2, not DRAM, with about D steps of the
    program's bytes in flight (0, the default: none). The same bits whatever the setting."""
    ROWS: gl.constexpr = BLOCK_M
    NB: gl.constexpr = HEAD_DIM // BLOCK
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # K's (N keys, 8 groups) and V's (8 groups, N keys): lane // 4 takes dim 0, lane % 4 a pair of dim 1,
    # which is where operand A's fragments hold K's keys and groups and V^T's groups and keys
    groups: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0])
    h = gl.program_id(0)
    s = gl.program_id(1)
    split = gl.program_id(2)
    length, table_at, k_head, v_head = sequence_pages(lengths_ptr, slots_ptr, table_ptr, k_pool, v_pool, h, s,
                                                      length_offset, table_stride, n_pages, k_row_bytes,
                                                      v_row_bytes, PAGE_SIZE, BY_SLOT)
    k_planes = _planes(k_lut)           # once a program; unused by f16 and q8_0 rows (no table)
    v_planes = _planes(v_lut)

    # q^T per block (128, ROWS), operand B, in K's relabelled order, scaled, f16
    kq = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, b_op))
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, b_op))
    if K_NIBBLES:           # lane r's k-step j: unit j of block r, its nibbles codes 2j, 2j + 16, 2j + 1, 2j + 17
        dim = ((kq // 2) % 4) * 32 + (kq // 16) * 2 + (kq // 8) % 2 + (kq % 2) * 16
    else:                   # _k_block's relabelling: code 32r + 4j + 2h + e
        dim = ((kq // 2) % 4) * 32 + (kq // 16) * 4 + ((kq // 8) % 2) * 2 + kq % 2
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
    keys_k = gl.arange(0, N, layout=gl.SliceLayout(1, groups))
    keys_v = gl.arange(0, N, layout=gl.SliceLayout(0, groups))
    keys_s = gl.arange(0, N, layout=gl.SliceLayout(1, mma))
    ahead: gl.constexpr = gl.BlockedLayout([1, L2_LINES // 2], [16, 2], [1, 1], [1, 0])   # (keys, lines): a warp
    keys_p = gl.arange(0, N, layout=gl.SliceLayout(1, ahead))
    slot_p = keys_p
    if L2_AHEAD:            # the rows L2_AHEAD steps on from the first, their table entries before the loop
        slot_p = pool_rows(table_at, begin + L2_AHEAD * N + keys_p, end, PAGE_SIZE, WIDE)
    if PREFETCH:            # the first step's pool rows, before the loop
        slot_k = pool_rows(table_at, begin + keys_k, end, PAGE_SIZE, WIDE)
        slot_v = pool_rows(table_at, begin + keys_v, end, PAGE_SIZE, WIDE)
        slot_s = pool_rows(table_at, begin + keys_s, end, PAGE_SIZE, WIDE)
    for start in range(begin, end, N):
        zero = gl.full([N, ROWS], 0.0, gl.float32, layout=mma)
        t = start + keys_s
        if L2_AHEAD:        # step + L2_AHEAD's rows to L2 (their entries were read a step ago), the next one's entries
            t_p = start + L2_AHEAD * N + keys_p
            _l2_rows(k_head, slot_p, t_p < end, k_row_bytes, ahead)
            _l2_rows(v_head, slot_p, t_p < end, v_row_bytes, ahead)
            slot_p = pool_rows(table_at, t_p + N, end, PAGE_SIZE, WIDE)
        if PREFETCH:        # this step's rows were read a step ago; the next step's table entries go out now,
            sk = slot_k     # so that a step's K/V loads wait on one load, not on a table load first
            sv = slot_v
            ss = slot_s
            slot_k = pool_rows(table_at, start + N + keys_k, end, PAGE_SIZE, WIDE)
            slot_v = pool_rows(table_at, start + N + keys_v, end, PAGE_SIZE, WIDE)
            slot_s = pool_rows(table_at, start + N + keys_s, end, PAGE_SIZE, WIDE)
        else:
            sk = pool_rows(table_at, start + keys_k, end, PAGE_SIZE, WIDE)
            sv = pool_rows(table_at, start + keys_v, end, PAGE_SIZE, WIDE)
            ss = pool_rows(table_at, t, end, PAGE_SIZE, WIDE)
        tk = start + keys_k
        tv = start + keys_v
        if EARLY:           # every load of the step before any decoding: one wait on memory a step
            rk0, nk0, rk1, nk1 = _reads(k_head, sk, ss, tk, t, end, k_row_bytes, NB, N, K_BITS, K_BYTES, K_NIBBLES,
                                        groups, True)
            rv0, nv0, rv1, nv1 = _reads(v_head, sv, ss, tv, t, end, v_row_bytes, NB, N, V_BITS, V_BYTES, V_NIBBLES,
                                        groups, False)
        else:               # each block's loads where it is decoded: 172 registers, not 251 (turbo4/turbo4)
            rk0, nk0 = _block_reads(k_head, sk, ss, tk, t, end, k_row_bytes, 0, N, K_BITS, K_BYTES, K_NIBBLES, groups,
                                    True)
        scores = _scores(rk0, nk0, q0, zero, k_lut, k_planes, N, K_BITS, K_NIBBLES, a_op)
        if NB == 2:
            if not EARLY:
                rk1, nk1 = _block_reads(k_head, sk, ss, tk, t, end, k_row_bytes, 1, N, K_BITS, K_BYTES, K_NIBBLES,
                                        groups, True)
            scores += _scores(rk1, nk1, q1, zero, k_lut, k_planes, N, K_BITS, K_NIBBLES, a_op)
        scores = gl.where((t < end)[:, None], scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)          # a row without keys yet: exp(-inf) = 0
        p = gl.exp(scores - m_safe[None, :])
        corr = gl.exp(m_i - m_safe)
        l_i = l_i * corr + gl.sum(p, axis=0)
        m_i = m_new
        if not EARLY:
            rv0, nv0 = _block_reads(v_head, sv, ss, tv, t, end, v_row_bytes, 0, N, V_BITS, V_BYTES, V_NIBBLES, groups,
                                    False)
        acc0 = _weighted(rv0, nv0, p, corr, acc0, v_lut, v_planes, N, V_BITS, V_NIBBLES, a_op, b_op)
        if NB == 2:
            if not EARLY:
                rv1, nv1 = _block_reads(v_head, sv, ss, tv, t, end, v_row_bytes, 1, N, V_BITS, V_BYTES, V_NIBBLES,
                                        groups, False)
            acc1 = _weighted(rv1, nv1, p, corr, acc1, v_lut, v_planes, N, V_BITS, V_NIBBLES, a_op, b_op)

    # the sums' logical dimension d (block b) is physical b * 128 + 16 (d % 8) + d // 8
    d = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    if V_NIBBLES:           # logical g + 8i: group g's value i, unit 4 (g % 2) + i // 4's nibble i % 4 of block g // 2
        i = d // 8
        d_out = ((d % 8) // 2) * 32 + ((d % 8) % 2) * 8 + (i // 4) * 2 + (i % 4) // 2 + ((i % 4) % 2) * 16
    else:
        d_out = (d % 8) * 16 + d // 8
    r_live = r < n_rows
    live = r_live[None, :] & (d_out < BLOCK)[:, None]
    if NORMALISE:
        o_at = acc_out + h.to(gl.int64) * o_heads + s.to(gl.int64) * o_seqs + r[None, :] * o_rows + d_out[:, None]
        g_at = gate_ptr + h.to(gl.int64) * g_heads + s.to(gl.int64) * g_seqs + r[None, :] * g_rows + d_out[:, None]
        gl.store(o_at, stored_as(gated(acc0 / l_i[None, :], g_at, live, GATED), acc_out), mask=live)
        if NB == 2:
            out1 = gated(acc1 / l_i[None, :], g_at + BLOCK, live, GATED)
            gl.store(o_at + BLOCK, stored_as(out1, acc_out), mask=live)
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

_BODIES = (_plane_word, _planes, _unit4, _code, _join16, _group, _units, _nibble_units, _q8_pair, _q8_units,
           _q8_group, _load_groups, _decode_groups, _k_load, _k_operand, _v_load, _v_operand, _norm, _normed,
           _block_reads, _reads, _scores, _weighted, _l2_rows, paged_decode_mma)


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
