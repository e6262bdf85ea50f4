"""The Triton kernels of ``quant_matmul`` (imported only when one runs: importing kvslim needs no triton).

W (N, K) stays its GGUF bytes: (N, row_bytes) uint8, one row of blocks per output feature, as
the file stores it. ``_dequantize_tile`` turns a (rows x columns) tile of it into float32 in
registers, each value addressing its own code, scale and min bytes (the layouts are those of
``block_linear.c`` and ``gguf.quants``; TYPE is the ggml type id). Types: Q8_0, Q4_0, Q2_K-Q6_K,
IQ4_XS, the grid i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, MXFP4 and NVFP4.
The i-quants' lattices (256-2048 entries of 4 or 8 values: too many for constexprs) come as a small
int8 tensor, ``grid_ptr`` (``quant_matmul.grid_table``; a 1-byte dummy for the other types), and
each value loads its own entry's byte. The kernels using it:

- ``quant_gemv`` (decode, M <= 16 rows of x): one program per (BLOCK_N outputs, split of K);
  products summed in float32 on the CUDA cores, no tensor cores (M is too small to fill them).
  Q8_0, Q4_0, Q6_K, Q4_K and Q5_K read their tile block by block (``_legacy_block_dot``,
  ``_q6_k_block_dot``, ``_k4_block_dot``: each byte and scale loaded once); the others the per-value
  tile. sm_90 cubins at M = 1 with a launch's alignment (``compile_sm90``), blockwise against
  per-value: Q4_0 10 loads / 408 instructions against 49 / 648, Q6_K 28 / 624 against 81 / 976,
  Q8_0 17 / 424 against 25 / 432 (Triton 3.9). Q4_K and Q5_K joined in session 33: Triton 3.9
  merges their per-value loads into 16-byte ones (9-10 loads), but the devices' Triton 3.6 does
  not (114-115 loads, 1,200-1,212 instructions a chunk at M = 1; blockwise Q4_K 67 and 659,
  Q5_K 12 and 262). At M = 1 the blockwise types keep each chunk's products per column and
  sum them once after K (TERMS).
  Every chunk is one ``_gemv_step``, which the experts' GEMV takes too (as a 1-row M).
- ``quant_gemm`` (prefill): one program per (BLOCK_M x BLOCK_N) tile of y; each BLOCK_K step
  dequantizes W's tile, casts it and x's tile to DOT_DTYPE and accumulates ``tl.dot`` in float32.
- ``quant_gemv_experts`` / ``quant_gemm_experts``: the same two for a mixture's routed experts,
  each (token, expert) pair's row times its expert's matrix, the expert found on the device
  (the grouped GEMM also takes experts stored as plain float matrices, TYPE = DENSE).

Triton decides at decoration time whether a kernel is interpreted (TRITON_INTERPRET=1) or
compiled; ``INTERPRETED`` and ``RUNNABLE`` record it, as in ``_paged_prefill_kernel``.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._add_norm_kernel import added_norm
from ._codecs import (after_previous, f16_aligned, f16_at, last_to_arrive, prefetch_rows, rearm, sigmoid, split_sums,
                      stored_as)
from ._moe_kernel import gated_sum

# ggml type ids (gguf.GGMLQuantizationType), the kernels' TYPE
Q4_0 = tl.constexpr(2)
Q8_0 = tl.constexpr(8)
Q2_K = tl.constexpr(10)
Q3_K = tl.constexpr(11)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)
IQ4_XS = tl.constexpr(23)
IQ2_XXS = tl.constexpr(16)
IQ2_XS = tl.constexpr(17)
IQ2_S = tl.constexpr(22)
IQ3_XXS = tl.constexpr(18)
IQ3_S = tl.constexpr(21)
IQ1_S = tl.constexpr(19)
IQ1_M = tl.constexpr(29)
MXFP4 = tl.constexpr(39)
NVFP4 = tl.constexpr(40)
# IQ4_NL's grid plus 128 as bytes, 8 to an int64 (low byte first): a value's grid entry is one
# shift and mask of a constant, not a table in memory
GRID_LO = tl.constexpr(0x76_6A_5D_4F_3F_2D_18_01)                  # 1, 24, 45, 63, 79, 93, 106, 118
GRID_HI = tl.constexpr(0xF1_D9_C5_B5_A6_99_8D_81 - (1 << 64))      # 129, 141, 153, 166, 181, 197, 217, 241
DENSE = tl.constexpr(-1)        # not a ggml type: plain float rows (the grouped GEMM of dense experts)

# dot name -> (operand dtype, tl.dot input_precision); products accumulate in float32 in all four
DOTS = {"ieee": (tl.float32, "ieee"), "tf32": (tl.float32, "tf32"),
        "fp16": (tl.float16, "ieee"), "bf16": (tl.bfloat16, "ieee")}


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _int8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min_k4(sb, g, mask):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block g (0-7) from the 12 bytes S at sb + 4.
    g < 4: S[g] & 63, S[g+4] & 63; else the low nibble or high nibble of S[g+4], with the top
    2 bits from S[g-4] (scale) or S[g] (min). Three loads serve both cases."""
    first = _byte(sb + 4 + g % 4, mask)              # S[g % 4]
    second = _byte(sb + 8 + g % 4, mask)             # S[g % 4 + 4]
    third = _byte(sb + 8 + g, mask)                  # S[g + 4] (== second for g < 4)
    scale = tl.where(g < 4, first & 63, (third & 0x0F) | ((first >> 6) << 4))
    min_ = tl.where(g < 4, second & 63, (third >> 4) | ((second >> 6) << 4))
    return scale.to(tl.float32), min_.to(tl.float32)


@triton.jit
def _legacy_values(row, c, mask, TYPE: tl.constexpr):
    """Q8_0 [d][32 int8] and Q4_0 [d][16 bytes: value j | value j+16 << 4]: d * q."""
    j = c % 32
    if TYPE == Q8_0:
        block = row + (c // 32) * 34
        q = _int8(block + 2 + j, mask)
    else:
        block = row + (c // 32) * 18
        q = ((_byte(block + 2 + j % 16, mask) >> (4 * (j // 16))) & 0x0F) - 8
    return f16_at(block, mask) * q.to(tl.float32)


@triton.jit
def _q6_k_values(row, c, mask):
    """[ql 128][qh 64][16 int8 scales][d], two halves of 128 values: in a half, value r takes
    the low or high nibble of ql[r % 64] (r < 64 or not) and bits 2(r // 32) of qh[r % 32]."""
    sb = row + (c // 256) * 210
    i = c % 256
    half, r = i // 128, i % 128
    low = (_byte(sb + 64 * half + r % 64, mask) >> (4 * (r // 64))) & 0x0F
    high = (_byte(sb + 128 + 32 * half + r % 32, mask) >> (2 * (r // 32))) & 0x03
    scale = f16_at(sb + 208, mask) * _int8(sb + 192 + i // 16, mask)      # one per 16 values
    return scale * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _k4_values(row, c, mask, TYPE: tl.constexpr):
    """Q4_K [d][dmin][12 scales][128 qs] and Q5_K (plus [qh 32] before qs): sub-block g of 32
    takes the low (even g) or high nibble of qs[32(g // 2) + l], Q5_K bit g of qh[l] on top;
    value = (d * scale) * q - dmin * min, in gguf.quants' order."""
    if TYPE == Q4_K:
        sb = row + (c // 256) * 144
        qs = sb + 16
    else:
        sb = row + (c // 256) * 176
        qs = sb + 48
    i = c % 256
    g, l = i // 32, i % 32
    q = (_byte(qs + 32 * (g // 2) + l, mask) >> (4 * (g % 2))) & 0x0F
    if TYPE == Q5_K:
        q = q | (((_byte(sb + 16 + l, mask) >> g) & 1) << 4)
    scale, min_ = _scale_min_k4(sb, g, mask)
    return (f16_at(sb, mask) * scale) * q.to(tl.float32) - f16_at(sb + 2, mask) * min_


@triton.jit
def _k2_values(row, c, mask, TYPE: tl.constexpr):
    """Q2_K [16 scale|min bytes][qs 64][d][dmin] and Q3_K [hmask 32][qs 64][12 scales][d]: in each
    half of 128, value r takes 2 bits (shift 2(r // 32)) of qs[32 half + r % 32]; Q3_K subtracts
    4 where bit (4 half + r // 32) of hmask[r % 32] is clear. One scale per 16 values: Q2_K's
    4-bit scale and min, (d * scale) * q - dmin * min; Q3_K's six bits less 32, (d * scale) * q."""
    if TYPE == Q2_K:
        sb = row + (c // 256) * 84
        qs = sb + 16
    else:
        sb = row + (c // 256) * 110
        qs = sb + 32
    i = c % 256
    half, r = i // 128, i % 128
    q = (_byte(qs + 32 * half + r % 32, mask) >> (2 * (r // 32))) & 3
    s = i // 16
    if TYPE == Q2_K:
        sc = _byte(sb + s, mask)
        return (f16_at(sb + 80, mask) * (sc & 0x0F).to(tl.float32)) * q.to(tl.float32) \
            - f16_at(sb + 82, mask) * (sc >> 4).to(tl.float32)
    bit = (_byte(sb + r % 32, mask) >> (4 * half + r // 32)) & 1
    q = q - 4 * (1 - bit)
    scale = ((_byte(sb + 96 + s % 8, mask) >> (4 * (s // 8))) & 0x0F) \
        | (((_byte(sb + 104 + s % 4, mask) >> (2 * (s // 4))) & 3) << 4)
    return (f16_at(sb + 108, mask) * (scale - 32).to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _iq4_xs_values(row, c, mask):
    """[d][scales_h 2][scales_l 4][qs 128]: sub-block g of 32 takes the low (l < 16) or high
    nibble of qs[16 g + l % 16] into IQ4_NL's grid; (d * (scale - 32)) * grid, the six-bit scale
    4 bits from scales_l[g // 2] (nibble g % 2) and 2 from scales_h (bits 2g)."""
    sb = row + (c // 256) * 136
    i = c % 256
    g, l = i // 32, i % 32
    n = ((_byte(sb + 8 + 16 * g + l % 16, mask) >> (4 * (l // 16))) & 0x0F).to(tl.int64)
    packed = tl.where(n < 8, GRID_LO, GRID_HI)
    grid = ((packed >> (8 * (n % 8))) & 0xFF) - 128
    high = ((_byte(sb + 2, mask) | (_byte(sb + 3, mask) << 8)) >> (2 * g)) & 3
    scale = ((_byte(sb + 4 + g // 2, mask) >> (4 * (g % 2))) & 0x0F) | (high << 4)
    return (f16_at(sb, mask) * (scale - 32).to(tl.float32)) * grid.to(tl.float32)


@triton.jit
def _grid_at(grid_ptr, idx, WIDTH: tl.constexpr, j, mask):
    """Value j of entry idx of an i-quant's lattice: int8, WIDTH values an entry, row-major."""
    return tl.load(grid_ptr + idx * WIDTH + j, mask=mask, other=0).to(tl.float32)


@triton.jit
def _ksign(bits, l):
    """Bit l (0-7) of ``native.lattices.ksigns()[bits]``: 7 stored sign bits, the eighth their parity
    (the quantizer keeps the count of minus signs even). Computed in registers, not a table."""
    parity = bits ^ (bits >> 4)
    parity = parity ^ (parity >> 2)
    parity = parity ^ (parity >> 1)
    return ((bits | ((parity & 1) << 7)) >> l) & 1


@triton.jit
def _xxs_word(word, sub, l, mask):
    """IQ2_XXS/IQ3_XXS: the little-endian 32-bit word at ``word`` holds a 7-bit sign index for
    each 8 values (sub 0-3 at bit 7 sub) and the 4-bit scale in bits 28-31. Returns value l's
    sign bit (``_ksign``) and the scale; the index's 7 bits come from the two bytes they span."""
    at = word + (7 * sub) // 8
    bits = ((_byte(at, mask) | (_byte(at + 1, mask) << 8)) >> ((7 * sub) % 8)) & 0x7F
    return _ksign(bits, l), _byte(word + 3, mask) >> 4


@triton.jit
def _iq2_values(row, c, mask, grid_ptr, TYPE: tl.constexpr):
    """IQ2_XXS [d][qs 64], IQ2_XS [d][qs 64][scales 8] and IQ2_S [d][qs 32][signs 32][qh 8][scales 8]:
    each 8 values (entry e = i // 8) one entry of an 8-value lattice, a sign per value and a 4-bit
    scale s; value = d * (0.5 + s) * 0.25 * grid * sign, gguf.quants' order (the sign exact).
    XXS: per 32 values 8 bytes, the 4 entries' indices then ``_xxs_word``'s word (s per 32).
    XS: per entry a 16-bit word, 9 bits of index and a 7-bit sign index; S: the index's 2 high
    bits in qh[e // 4] (bits 2(e % 4)), a sign byte per entry. XS, S: s a nibble per 16 values."""
    i = c % 256
    e, l = i // 8, i % 8
    if TYPE == IQ2_XXS:
        sb = row + (c // 256) * 66
        group = sb + 2 + 8 * (i // 32)
        idx = _byte(group + e % 4, mask)
        minus, s = _xxs_word(group + 4, e % 4, l, mask)
    else:
        if TYPE == IQ2_XS:
            sb = row + (c // 256) * 74
            high = _byte(sb + 3 + 2 * e, mask)
            idx = _byte(sb + 2 + 2 * e, mask) | ((high & 1) << 8)
            minus = _ksign(high >> 1, l)
            scales = sb + 66
        else:
            sb = row + (c // 256) * 82
            idx = _byte(sb + 2 + e, mask) | (((_byte(sb + 66 + e // 4, mask) >> (2 * (e % 4))) & 3) << 8)
            minus = (_byte(sb + 34 + e, mask) >> l) & 1
            scales = sb + 74
        s = (_byte(scales + i // 32, mask) >> (4 * (i // 16 % 2))) & 0x0F
    v = f16_at(sb, mask) * (0.5 + s.to(tl.float32)) * 0.25 * _grid_at(grid_ptr, idx, 8, l, mask)
    return tl.where(minus != 0, -v, v)


@triton.jit
def _iq3_values(row, c, mask, grid_ptr, TYPE: tl.constexpr):
    """IQ3_XXS [d][qs 64][scales 32] and IQ3_S [d][qs 64][qh 8][signs 32][scales 4]: each 4 values
    (entry e = i // 4) one entry of a 4-value lattice, index qs[e] (IQ3_S: bit e % 8 of qh[e // 8]
    as bit 8), a sign per value and a 4-bit scale s per 32. XXS: ``_xxs_word``'s word per 32
    values, d * (0.5 + s) * 0.5 * grid * sign; S: a sign bit per value, s a nibble of
    scales[i // 64], d * (1 + 2s) * grid * sign (gguf.quants' order)."""
    i = c % 256
    e = i // 4
    if TYPE == IQ3_XXS:
        sb = row + (c // 256) * 98
        idx = _byte(sb + 2 + e, mask)
        minus, s = _xxs_word(sb + 66 + 4 * (i // 32), i % 32 // 8, i % 8, mask)
        db = f16_at(sb, mask) * (0.5 + s.to(tl.float32)) * 0.5
    else:
        sb = row + (c // 256) * 110
        idx = _byte(sb + 2 + e, mask) | (((_byte(sb + 66 + e // 8, mask) >> (e % 8)) & 1) << 8)
        minus = (_byte(sb + 74 + i // 8, mask) >> (i % 8)) & 1
        s = (_byte(sb + 106 + i // 64, mask) >> (4 * (i // 32 % 2))) & 0x0F
        db = f16_at(sb, mask) * (1 + 2 * s).to(tl.float32)
    v = db * _grid_at(grid_ptr, idx, 4, i % 4, mask)
    return tl.where(minus != 0, -v, v)


@triton.jit
def _iq1_values(row, c, mask, grid_ptr, TYPE: tl.constexpr):
    """IQ1_S [d][qs 32][qh 16] and IQ1_M [qs 32][qh 16][scales 8]: each 8 values (entry e = i // 8)
    an 11-bit index, qs[e] and 3 high bits, into a ternary lattice shifted by +-1/8:
    value = (d * (2s + 1)) * (grid + delta). IQ1_S: per 32 values a 16-bit qh word, the high bits
    of its 4 entries at bits 3(e % 4), s in bits 12-14, delta's sign in bit 15. IQ1_M: a qh nibble
    per entry (high bits, then delta's sign); a 3-bit s per 16 values, four to a 16-bit scale
    word at bits 3k, whose top nibbles, in order, make the fp16 d (``iquants.iq1_m_d``)."""
    i = c % 256
    e = i // 8
    if TYPE == IQ1_S:
        sb = row + (c // 256) * 50
        qs = sb + 2
        word = _byte(sb + 34 + 2 * (i // 32), mask) | (_byte(sb + 35 + 2 * (i // 32), mask) << 8)
        high, s, minus = (word >> (3 * (e % 4))) & 7, (word >> 12) & 7, word >> 15
        d = f16_at(sb, mask)
    else:
        sb = row + (c // 256) * 56
        qs = sb
        nibble = (_byte(sb + 32 + e // 2, mask) >> (4 * (e % 2))) & 0x0F
        high, minus = nibble & 7, nibble >> 3
        t = i // 16
        word = _byte(sb + 48 + 2 * (t // 4), mask) | (_byte(sb + 49 + 2 * (t // 4), mask) << 8)
        s = (word >> (3 * (t % 4))) & 7
        top = sb + 49                                   # the high bytes of the four scale words
        bits = (_byte(top, mask) >> 4) | (_byte(top + 2, mask) & 0xF0) | ((_byte(top + 4, mask) & 0xF0) << 4) \
            | ((_byte(top + 6, mask) & 0xF0) << 8)
        d = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    idx = _byte(qs + e, mask) | (high << 8)
    delta = tl.where(minus != 0, -0.125, 0.125)
    return (d * (2 * s + 1).to(tl.float32)) * (_grid_at(grid_ptr, idx, 8, i % 8, mask) + delta)


@triton.jit
def _e2m1(code):
    """A 4-bit e2m1 code as float32, doubled as gguf.quants stores MXFP4's and NVFP4's: bit 3 the
    sign, then 2 exponent bits and a mantissa bit; m < 2: m, else (2 + mantissa) << (exponent - 1):
    0 1 2 3 4 6 8 12. Computed in registers, not a table."""
    m = code & 7
    magnitude = tl.where(m < 2, m, (2 | (m & 1)) << ((m >> 1) - 1))
    return tl.where(code >= 8, -magnitude, magnitude).to(tl.float32)


@triton.jit
def _mxfp4_values(row, c, mask):
    """[e][qs 16]: value j takes the low (j < 16) or high nibble of qs[j % 16], an ``_e2m1`` code;
    value = scale * code, the scale e8m0's 2^(e - 128) (the doubling's half) as float32 bits, a
    subnormal for e < 2 (``iquants.e8m0_half``)."""
    block = row + (c // 32) * 17
    j = c % 32
    code = (_byte(block + 1 + j % 16, mask) >> (4 * (j // 16))) & 0x0F
    e = _byte(block, mask)
    scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return scale * _e2m1(code)


@triton.jit
def _nvfp4_values(row, c, mask):
    """[scales 4][qs 32], 64 values: sub-block s = j // 16 has scale byte s and qs[8s..8s+7], its
    values 0-7 their low nibbles, 8-15 their high nibbles (``_e2m1`` codes); value = scale * code.
    The scale is an unsigned e4m3 byte halved (``iquants.ue4m3_half``): bias 7, so with its low 7
    bits b as float32 bits (b << 20) + (119 << 23); exponent 0: the subnormal man * 2^-10; bytes
    0 and 0x7F read as 0, bit 7 ignored otherwise (0xFF is 240), as gguf.quants reads them."""
    block = row + (c // 64) * 36
    j = c % 64
    s, t = j // 16, j % 16
    code = (_byte(block + 4 + 8 * s + t % 8, mask) >> (4 * (t // 8))) & 0x0F
    b = _byte(block + s, mask)
    normal = (((b & 0x7F) << 20) + (119 << 23)).to(tl.float32, bitcast=True)
    scale = tl.where(((b >> 3) & 0x0F) == 0, (b & 7).to(tl.float32) * 0.0009765625, normal)
    return tl.where(b == 0x7F, 0.0, scale) * _e2m1(code)


@triton.jit
def _dequantize_tile(w_ptr, grid_ptr, rows, cols, row_bytes, N, K, TYPE: tl.constexpr):
    """rows (BN,) output features, cols (BK,) input features -> (BN, BK) float32 values of W;
    0 outside (N, K), so padding adds 0 * 0, never NaN from stray bytes. grid_ptr: the
    i-quants' lattice (int8), unread by the other types."""
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    row = w_ptr + rows.to(tl.int64)[:, None] * row_bytes                # (BN, 1) byte pointers: W can pass 2 GiB
    c = cols[None, :]
    if TYPE == Q6_K:
        v = _q6_k_values(row, c, mask)
    elif TYPE == Q4_K or TYPE == Q5_K:
        v = _k4_values(row, c, mask, TYPE)
    elif TYPE == Q2_K or TYPE == Q3_K:
        v = _k2_values(row, c, mask, TYPE)
    elif TYPE == IQ4_XS:
        v = _iq4_xs_values(row, c, mask)
    elif TYPE == IQ2_XXS or TYPE == IQ2_XS or TYPE == IQ2_S:
        v = _iq2_values(row, c, mask, grid_ptr, TYPE)
    elif TYPE == IQ3_XXS or TYPE == IQ3_S:
        v = _iq3_values(row, c, mask, grid_ptr, TYPE)
    elif TYPE == IQ1_S or TYPE == IQ1_M:
        v = _iq1_values(row, c, mask, grid_ptr, TYPE)
    elif TYPE == MXFP4:
        v = _mxfp4_values(row, c, mask)
    elif TYPE == NVFP4:
        v = _nvfp4_values(row, c, mask)
    else:
        v = _legacy_values(row, c, mask, TYPE)
    return tl.where(mask, v, 0.0)


@triton.jit
def _summed(x, w):
    """x (BM, T) against w (BN, T): the (BM, BN) dot products, summed across the tile. At M = 1 the
    blockwise types keep their products unsummed instead (TERMS, ``_x_by_rows``) and the GEMV sums
    them once after its loop over K: a sum across a tile's threads is shuffles and shared memory,
    130 of Q4_0's 292 sm_90 instructions a chunk at M = 1 (Triton 3.9)."""
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _x_by_rows(x_at, x_ok, rows):
    """x's values at x_at (1, G, L) as a (BN, G, L) tile, one copy per weight row (repeats hit L1),
    for the TERMS products: they then take the weight codes' own layout (each thread a run of one
    row's bytes) and stay 3-D until one reshape. Multiplied as a (1, G, L) tile, whose layout
    gives each of 128 threads one column of every row, Triton 3.6 made every thread load every
    row's scales: Q4_K's sm_90 loop 67 global loads and 659 instructions a chunk, against 13
    and 203 (the 16-row shared-memory conversion gone too)."""
    return tl.load(x_at + 0 * rows[:, None, None], mask=x_ok, other=0.0).to(tl.float32)


@triton.jit
def _legacy_block_dot(x_ptr, w_ptr, m, M, rows, N, K, row_bytes, chunk,
                      TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      TERMS: tl.constexpr = False):
    """x[m, chunk's columns] . W[rows, the same] for Q8_0 or Q4_0, read block by block -> (BM, BN)
    float32 (TERMS: the (BN, BLOCK_K / 32) per-block dots, ``_x_by_rows``). The per-value tile
    (``_legacy_values``) loads each Q4_0 code byte twice and each block's f16 scale once per
    value, 32 times; here each byte is loaded once, the scale by one 2-byte load per block
    (blocks are 34 or 18 bytes: scales at even addresses), and a Q4_0 byte's two nibbles meet
    x's columns j and j + 16 of their block. K is whole blocks (``_check``).
    With TERMS a block's codes are dotted with x first and the sum scaled once, not each value
    (Q4_0's codes made floats by their bits, 2^23 + c less 2^23 + 8: no int-to-float
    conversions). sm_90, Triton 3.6, 1-row bf16 GEMV, a chunk's loop against scaling each
    value: Q4_0 146 instructions and 31 registers against 168 and 39, the SwiGLU pair 260 and
    47 against 304 and 72; Q8_0 138 and 32 against 144 and 40, the pair 237 and 56 against 239
    and 93. Untimed."""
    NB: tl.constexpr = BLOCK_K // 32
    SIZE: tl.constexpr = 34 if TYPE == Q8_0 else 18
    SPAN: tl.constexpr = 32 if TYPE == Q8_0 else 16                   # code bytes per block
    blk = chunk * NB + tl.arange(0, NB)                                 # (NB,) blocks of the row
    j = tl.arange(0, SPAN)
    ok = (rows < N)[:, None] & (blk < K // 32)[None, :]                 # (BN, NB)
    block = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + blk[None, :] * SIZE
    d = f16_aligned(block, ok)[:, :, None]                              # (BN, NB, 1)
    codes = tl.load(block[:, :, None] + 2 + j[None, None, :], mask=ok[:, :, None], other=0)   # (BN, NB, SPAN)
    x_ok = (m < M)[:, None, None] & (blk < K // 32)[None, :, None]
    x_at = x_ptr + m[:, None, None] * K + (blk[:, None] * 32 + j[None, :])[None, :, :]       # (BM, NB, SPAN)
    if TYPE == Q8_0:                    # if/else, not early returns: the compiler types every return
        if TERMS:
            q = codes.to(tl.int8, bitcast=True).to(tl.float32)
            out = tl.sum(_x_by_rows(x_at, x_ok, rows) * q, axis=2) * tl.reshape(d, (BLOCK_N, NB))
        else:
            w = codes.to(tl.int8, bitcast=True).to(tl.float32) * d                      # (BN, NB, SPAN)
            x = tl.reshape(tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32), (BLOCK_M, NB * SPAN))
            out = _summed(x, tl.reshape(w, (BLOCK_N, NB * SPAN)))
        return out
    c = codes.to(tl.int32)
    if TERMS:
        lo = ((c & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0         # values j: c - 8
        hi = ((c >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0          # values j + 16
        dots = tl.sum(_x_by_rows(x_at, x_ok, rows) * lo + _x_by_rows(x_at + 16, x_ok, rows) * hi, axis=2)
        out = dots * tl.reshape(d, (BLOCK_N, NB))
    else:
        lo = ((c & 0x0F) - 8).to(tl.float32) * d                                           # values j
        hi = ((c >> 4) - 8).to(tl.float32) * d                                             # values j + 16
        x = tl.reshape(tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32), (BLOCK_M, NB * SPAN))
        x_hi = tl.reshape(tl.load(x_at + 16, mask=x_ok, other=0.0).to(tl.float32), (BLOCK_M, NB * SPAN))
        lo, hi = tl.reshape(lo, (BLOCK_N, NB * SPAN)), tl.reshape(hi, (BLOCK_N, NB * SPAN))
        out = tl.sum(x[:, None, :] * lo[None, :, :] + x_hi[:, None, :] * hi[None, :, :], axis=2)
    return out


@triton.jit
def _q6_k_block_dot(x_ptr, w_ptr, m, M, rows, N, K, row_bytes, chunk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TERMS: tl.constexpr = False):
    """``_legacy_block_dot`` for Q6_K, by halves of 128 values (``_q6_k_values``' layout): in half
    h, bytes ql[64h + l], ql[64h + 32 + l] and qh[32h + l] (l < 32) hold the values l, l + 32,
    l + 64 and l + 96: low nibbles then high nibbles, qh's bit pairs 0-1, 2-3, 4-5, 6-7. Three
    byte loads for four values; each int8 scale (one per 16 values) loaded once per half, each d
    once. K is whole super-blocks (``_check``). TERMS: the (BN, BLOCK_K / 4) products (``_x_by_rows``)."""
    NH: tl.constexpr = BLOCK_K // 128
    hh = chunk * NH + tl.arange(0, NH)                                  # (NH,) halves of the row
    h = (hh % 2)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    ok = (rows < N)[:, None] & (hh < K // 128)[None, :]                 # (BN, NH)
    sb = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + (hh // 2)[None, :] * 210
    d = f16_aligned(sb + 208, ok)[:, :, None]                           # (BN, NH, 1)
    sb3, ok3 = sb[:, :, None], ok[:, :, None]
    ql_a, ql_b = _byte(sb3 + 64 * h + l, ok3), _byte(sb3 + 64 * h + 32 + l, ok3)       # (BN, NH, 32)
    qh = _byte(sb3 + 128 + 32 * h + l, ok3)
    x_ok = (m < M)[:, None, None] & (hh < K // 128)[None, :, None]
    x_at = x_ptr + m[:, None, None] * K + hh[None, :, None] * 128 + l                   # (BM, NH, 32)
    if TERMS:
        acc = tl.zeros([BLOCK_N, NH, 32], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.static_range(4):                                        # values l + 32k
        low = (ql_a if k % 2 == 0 else ql_b) >> (4 * (k // 2))
        q = (low & 0x0F) | (((qh >> (2 * k)) & 3) << 4)
        scales = sb3 + 192 + 8 * h + 2 * k                              # one per 16 values: l < 16, l >= 16
        scale = tl.where(l < 16, _int8(scales, ok3), _int8(scales + 1, ok3))
        w = (d * scale) * (q - 32).to(tl.float32)                       # (BN, NH, 32)
        if TERMS:
            acc += _x_by_rows(x_at + 32 * k, x_ok, rows) * w
        else:
            x = tl.reshape(tl.load(x_at + 32 * k, mask=x_ok, other=0.0).to(tl.float32), (BLOCK_M, NH * 32))
            acc += _summed(x, tl.reshape(w, (BLOCK_N, NH * 32)))
    if TERMS:
        acc = tl.reshape(acc, (BLOCK_N, NH * 32))
    return acc


@triton.jit
def _k4_block_dot(x_ptr, w_ptr, m, M, rows, N, K, row_bytes, chunk, TYPE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TERMS: tl.constexpr = False):
    """``_legacy_block_dot`` for Q4_K and Q5_K, by groups of 64 values (``_k4_values``' layout): in
    group p of a super-block, byte qs[32p + l] holds value 64p + l (low nibble, sub-block 2p) and
    64p + 32 + l (high nibble, sub-block 2p + 1); Q5_K's fifth bits are bits 2p and 2p + 1 of
    qh[l]. Each code byte is loaded once, the sub-blocks' scales and mins and the super-block's
    d and dmin once per group, where the per-value tile loads them for every value (under
    Triton 3.6, the devices', 114 loads a chunk for Q4_K; 3.9 merges them into 9). K is whole
    super-blocks (``_check``). TERMS: the (BN, BLOCK_K / 2) products."""
    SIZE: tl.constexpr = 144 if TYPE == Q4_K else 176
    QS: tl.constexpr = 16 if TYPE == Q4_K else 48                      # Q5_K: qh's 32 bytes first
    NP: tl.constexpr = BLOCK_K // 64
    pp = chunk * NP + tl.arange(0, NP)                                  # (NP,) groups of the row
    p = (pp % 4)[None, :]
    l = tl.arange(0, 32)[None, None, :]
    ok = (rows < N)[:, None] & (pp < K // 64)[None, :]                  # (BN, NP)
    sb = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + (pp // 4)[None, :] * SIZE
    scale_lo, min_lo = _scale_min_k4(sb, 2 * p, ok)
    scale_hi, min_hi = _scale_min_k4(sb, 2 * p + 1, ok)
    d, dmin = f16_aligned(sb, ok), f16_aligned(sb + 2, ok)
    codes = _byte(sb[:, :, None] + QS + 32 * p[:, :, None] + l, ok[:, :, None])          # (BN, NP, 32)
    q_lo, q_hi = codes & 0x0F, codes >> 4
    if TYPE == Q5_K:
        qh = _byte(sb[:, :, None] + 16 + l, ok[:, :, None]) >> (2 * p[:, :, None])
        q_lo, q_hi = q_lo | ((qh & 1) << 4), q_hi | ((qh & 2) << 3)
    lo = (d * scale_lo)[:, :, None] * q_lo.to(tl.float32) - (dmin * min_lo)[:, :, None]       # (BN, NP, 32)
    hi = (d * scale_hi)[:, :, None] * q_hi.to(tl.float32) - (dmin * min_hi)[:, :, None]
    x_ok = (m < M)[:, None, None] & (pp < K // 64)[None, :, None]
    x_at = x_ptr + m[:, None, None] * K + pp[None, :, None] * 64 + l                    # (BM, NP, 32)
    if TERMS:
        out = tl.reshape(_x_by_rows(x_at, x_ok, rows) * lo + _x_by_rows(x_at + 32, x_ok, rows) * hi,
                         (BLOCK_N, NP * 32))
    else:
        x = tl.reshape(tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32), (BLOCK_M, NP * 32))
        x_hi = tl.reshape(tl.load(x_at + 32, mask=x_ok, other=0.0).to(tl.float32), (BLOCK_M, NP * 32))
        lo, hi = tl.reshape(lo, (BLOCK_N, NP * 32)), tl.reshape(hi, (BLOCK_N, NP * 32))
        out = tl.sum(x[:, None, :] * lo[None, :, :] + x_hi[:, None, :] * hi[None, :, :], axis=2)
    return out


@triton.jit
def _dp4a(a, b, c, DP4A: tl.constexpr):
    """c + the dot of a's and b's four signed bytes (int32 words): one ``dp4a`` instruction on a
    GPU (DP4A); under the interpreter, which runs no PTX, the same sum by shifts."""
    if DP4A:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        out = c
        for k in tl.static_range(4):
            out += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
    return out


@triton.jit
def _max_nan(a, b):
    """max that keeps a NaN (``tl.max`` drops it, as the GPU's FMNMX does)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _q8_x(x_ptr, chunk, K, NB: tl.constexpr):
    """x's NB blocks of 32 of this chunk rounded to 8 bits as ``weights.activations.quantize_q8``
    rounds them (q = round-half-even(x 127 / max |x|), d = max |x| / 127; an all-zero block d = 0;
    a block with a NaN d = NaN, with an infinity d = inf, so that the products are not finite
    either, as the float GEMV's and the reference's) -> words (NB, 8) int32, four q each in
    order, d (NB,) and the sums of q by 16 values (NB, 2)."""
    blk = chunk * NB + tl.arange(0, NB)
    x = tl.load(x_ptr + blk[:, None] * 32 + tl.arange(0, 32)[None, :], mask=(blk < K // 32)[:, None],
                other=0.0).to(tl.float32)                                                  # (NB, 32)
    amax = tl.reduce(tl.abs(x), 1, _max_nan)                                                 # NaN if any is
    live = amax > 0                                                                          # (NaN > 0 is false)
    top = tl.full(amax.shape, 127.0, tl.float32)
    iscale = tl.where(live, tl.math.div_rn(top, tl.where(live, amax, 1.0)), 0.0)
    q = ((x * iscale[:, None] + 12582912.0) - 12582912.0).to(tl.int32)      # + 1.5 2^23: rounds half to even
    byte = tl.arange(0, 4)
    words = tl.sum(tl.reshape(q & 0xFF, (NB, 8, 4)) << (byte * 8)[None, None, :], axis=2)        # (NB, 8)
    return words, tl.math.div_rn(amax, top), tl.sum(tl.reshape(q, (NB, 2, 16)), axis=2)


@triton.jit
def _halves(t, A: tl.constexpr, B: tl.constexpr):
    """t (A, 2 B) -> its first and second B columns, each (A, B)."""
    return tl.split(tl.permute(tl.reshape(t, (A, 2, B)), (0, 2, 1)))


@triton.jit
def _words16(ptr, mask):
    """int32 words at the even byte addresses ptr (A, B, C), each from two 2-byte loads."""
    halves = tl.load(ptr.to(tl.pointer_type(tl.int16))[:, :, :, None] + tl.arange(0, 2)[None, None, None, :],
                     mask=mask[:, :, :, None], other=0)
    lo16, hi16 = tl.split(halves)
    return (lo16.to(tl.int32) & 0xFFFF) | (hi16.to(tl.int32) << 16)


@triton.jit
def _q8_q4_0_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, BLOCK_N: tl.constexpr, NB: tl.constexpr,
                 DP4A: tl.constexpr):
    """Q4_0 rows' blocks of this chunk against x rounded to 8 bits (``_q8_x``) -> (BN, NB) float32:
    d_w dx (codes . q - 8 sum q), each block's dot in integers, 8 values by two ``dp4a`` (the
    low nibbles of four code bytes against x's values j..j+3, the high ones against j+16..j+19;
    the four bytes read as one word from two 2-byte loads: a block is 18 bytes, its codes at
    even addresses)."""
    xlo, xhi = _halves(xw, NB, 4)                                                             # (NB, 4) each
    blk = chunk * NB + tl.arange(0, NB)
    ok = (rows < N)[:, None] & (blk < K // 32)[None, :]
    block = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + blk[None, :] * 18
    d = f16_aligned(block, ok)                                                                 # (BN, NB)
    words = _words16(block[:, :, None] + 2 + 4 * tl.arange(0, 4)[None, None, :], ok[:, :, None])   # (BN, NB, 4)
    dots = _dp4a(words & 0x0F0F0F0F, xlo[None, :, :], tl.zeros(words.shape, tl.int32), DP4A)
    dots = _dp4a((words >> 4) & 0x0F0F0F0F, xhi[None, :, :], dots, DP4A)
    return d * dx[None, :] * (tl.sum(dots, axis=2) - 8 * tl.sum(sx, axis=1)[None, :]).to(tl.float32)


@triton.jit
def _q8_q4_k_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, BLOCK_N: tl.constexpr, NP: tl.constexpr,
                 DP4A: tl.constexpr):
    """Q4_K rows' groups of 64 of this chunk (``_k4_block_dot``'s layout: byte 32p + l of a
    super-block holds value 64p + l in its low nibble, sub-block 2p, and 64p + 32 + l in its high
    one, sub-block 2p + 1) against x rounded to 8 bits (``_q8_x``, a scale per sub-block) ->
    (BN, NP) float32: per sub-block s, dx_s (d scale_s (codes_s . q_s) - dmin min_s sum q_s),
    the dots in integers by ``dp4a`` on the codes' words (super-blocks are 144 bytes, the codes
    at 16: whole aligned words)."""
    pp = chunk * NP + tl.arange(0, NP)                                                        # (NP,) groups
    p = (pp % 4)[None, :]
    ok = (rows < N)[:, None] & (pp < K // 64)[None, :]                                       # (BN, NP)
    sb = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + (pp // 4)[None, :] * 144
    scale_lo, min_lo = _scale_min_k4(sb, 2 * p, ok)
    scale_hi, min_hi = _scale_min_k4(sb, 2 * p + 1, ok)
    d, dmin = f16_aligned(sb, ok), f16_aligned(sb + 2, ok)
    words = tl.load((sb + 16 + 32 * p).to(tl.pointer_type(tl.int32))[:, :, None] + tl.arange(0, 8)[None, None, :],
                    mask=ok[:, :, None], other=0)                                               # (BN, NP, 8)
    xlo, xhi = _halves(tl.reshape(xw, (NP, 16)), NP, 8)                                        # sub-blocks 2p, 2p + 1
    dx_lo, dx_hi = tl.split(tl.reshape(dx, (NP, 2)))
    sx_lo, sx_hi = tl.split(tl.reshape(tl.sum(sx, axis=1), (NP, 2)))
    zero = tl.zeros(words.shape, tl.int32)
    dot_lo = tl.sum(_dp4a(words & 0x0F0F0F0F, xlo[None, :, :], zero, DP4A), axis=2).to(tl.float32)
    dot_hi = tl.sum(_dp4a((words >> 4) & 0x0F0F0F0F, xhi[None, :, :], zero, DP4A), axis=2).to(tl.float32)
    return (dx_lo[None, :] * (d * scale_lo * dot_lo - dmin * min_lo * sx_lo[None, :].to(tl.float32))
            + dx_hi[None, :] * (d * scale_hi * dot_hi - dmin * min_hi * sx_hi[None, :].to(tl.float32)))


@triton.jit
def _q8_q6_k_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, BLOCK_N: tl.constexpr, NH: tl.constexpr,
                 DP4A: tl.constexpr):
    """Q6_K rows' halves of 128 values of this chunk (``_q6_k_block_dot``'s layout: in half h,
    bytes ql[64h + l], ql[64h + 32 + l] and qh[32h + l] hold values l + 32k, k = 0-3: low nibbles,
    then high nibbles, qh's bit pairs 2k) against x rounded to 8 bits (``_q8_x``) -> (BN, NH)
    float32: per 16 values j (one int8 scale each), d dx_k scale_j (codes_j . q_j - 32 sum q_j),
    each code word made from four bytes of ql and four of qh (6-bit codes, byte by byte) and
    dotted by ``dp4a`` (super-blocks are 210 bytes: words from two 2-byte loads)."""
    hh = chunk * NH + tl.arange(0, NH)                                                        # (NH,) halves
    h = (hh % 2)[None, :, None]
    ok = (rows < N)[:, None] & (hh < K // 128)[None, :]                                      # (BN, NH)
    sb = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + (hh // 2)[None, :] * 210
    sb3, ok3 = sb[:, :, None], ok[:, :, None]
    d = f16_aligned(sb + 208, ok)                                                              # (BN, NH)
    word = 4 * tl.arange(0, 8)[None, None, :]
    ql_a = _words16(sb3 + 64 * h + word, ok3)                                               # (BN, NH, 8)
    ql_b = _words16(sb3 + 64 * h + 32 + word, ok3)
    qh = _words16(sb3 + 128 + 32 * h + word, ok3)
    group = tl.arange(0, 4)[None, :, None]
    xw3, dx2, sx3 = tl.reshape(xw, (NH, 4, 8)), tl.reshape(dx, (NH, 4)), tl.reshape(sx, (NH, 4, 2))
    j = tl.arange(0, 2)[None, None, :]
    total = tl.zeros([BLOCK_N, NH], tl.float32)
    for k in tl.static_range(4):                                                               # values l + 32k
        low = (ql_a if k % 2 == 0 else ql_b) >> (4 * (k // 2))
        codes = (low & 0x0F0F0F0F) | (((qh >> (2 * k)) & 0x03030303) << 4)
        x_k = tl.sum(tl.where(group == k, xw3, 0), axis=1)                                     # (NH, 8)
        dots = _dp4a(codes, x_k[None, :, :], tl.zeros(codes.shape, tl.int32), DP4A)
        dots = tl.sum(tl.reshape(dots, (BLOCK_N, NH, 2, 4)), axis=3)                           # (BN, NH, 2) by 16
        sx_k = tl.sum(tl.where(group == k, sx3, 0), axis=1)                                     # (NH, 2)
        dx_k = tl.sum(tl.where(tl.arange(0, 4)[None, :] == k, dx2, 0.0), axis=1)                # (NH,)
        scale = _int8(sb3 + 192 + 8 * h + 2 * k + j, ok3)                                       # (BN, NH, 2)
        total += d * dx_k[None, :] * tl.sum(scale * (dots - 32 * sx_k[None, :, :]).to(tl.float32), axis=2)
    return total


@triton.jit
def _q8_chunk(x_ptr, w_ptr, rows, N, K, row_bytes, chunk, TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, DP4A: tl.constexpr):
    """One chunk of a 1-row GEMV on 8-bit activations, x rounded here -> ``_q8_dot``'s terms."""
    xw, dx, sx = _q8_x(x_ptr, chunk, K, BLOCK_K // 32)
    return _q8_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, TYPE, BLOCK_N, BLOCK_K, DP4A)


@triton.jit
def _q8_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DP4A: tl.constexpr):
    """``_q8_q4_0_dot``, ``_q8_q4_k_dot`` or ``_q8_q6_k_dot`` by TYPE: (BN, a term per block of 32,
    group of 64 or half of 128: ``quant_matmul.q8_config``'s TERMS)."""
    if TYPE == Q4_0:
        out = _q8_q4_0_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, BLOCK_N, BLOCK_K // 32, DP4A)
    elif TYPE == Q4_K:
        out = _q8_q4_k_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, BLOCK_N, BLOCK_K // 64, DP4A)
    else:
        out = _q8_q6_k_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, BLOCK_N, BLOCK_K // 128, DP4A)
    return out



@triton.jit
def _gemv_step(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, chunk, TYPE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
               TERMS: tl.constexpr = 0):
    """One BLOCK_K chunk of x[m] . W[rows] -> (BM, BN) float32: Q8_0, Q4_0, Q6_K, Q4_K and Q5_K
    block by block where BLOCKWISE, every other type (or all, BLOCKWISE False) through the
    per-value tile.
    TERMS > 0 (BLOCK_M = 1, the blockwise types): the (BN, TERMS) products instead, unsummed
    (``_x_by_rows``; TERMS is ``quant_matmul.terms_width``)."""
    if BLOCKWISE and (TYPE == Q8_0 or TYPE == Q4_0):
        out = _legacy_block_dot(x_ptr, w_ptr, m, M, rows, N, K, row_bytes, chunk, TYPE, BLOCK_M, BLOCK_N, BLOCK_K,
                                TERMS > 0)
    elif BLOCKWISE and TYPE == Q6_K:
        out = _q6_k_block_dot(x_ptr, w_ptr, m, M, rows, N, K, row_bytes, chunk, BLOCK_M, BLOCK_N, BLOCK_K, TERMS > 0)
    elif BLOCKWISE and (TYPE == Q4_K or TYPE == Q5_K):
        out = _k4_block_dot(x_ptr, w_ptr, m, M, rows, N, K, row_bytes, chunk, TYPE, BLOCK_M, BLOCK_N, BLOCK_K,
                            TERMS > 0)
    else:
        cols = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _dequantize_tile(w_ptr, grid_ptr, rows, cols, row_bytes, N, K, TYPE)           # (BN, BK)
        if BLOCK_M == 1:                # a vector: sm_90 cubins 336 instructions, not 464 (Q4_K)
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)              # (BK,)
            out = tl.sum(w * x[None, :], axis=1)[None, :]
        else:
            x = tl.load(x_ptr + m[:, None] * K + cols[None, :], mask=(m < M)[:, None] & (cols < K)[None, :],
                        other=0.0).to(tl.float32)                                       # (BM, BK)
            out = tl.sum(x[:, None, :] * w[None, :, :], axis=2)                        # (BM, BN)
    return out


@triton.jit
def _gemv_chunks(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, first, last, TYPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKWISE: tl.constexpr,
                 TERMS: tl.constexpr, Q8: tl.constexpr = 0):
    """x[m] . W[rows] over chunks [first, last) of BLOCK_K columns -> (BM, BN) float32, each
    chunk a ``_gemv_step``; with TERMS > 0 (BM = 1) the products kept per column across the
    chunks and summed once at the end. Q8 (Q4_0, Q4_K or Q6_K, BM = 1; 2: dp4a instructions,
    1: their interpreted twin): x rounded to 8 bits a chunk at a time and the products in
    integers (``_q8_chunk``)."""
    if Q8 > 0:             # TERMS: a term per block of 32 (Q4_0), group of 64 (Q4_K), half of 128 (Q6_K)
        terms = tl.zeros([BLOCK_N, TERMS], tl.float32)
        for chunk in range(first, last):
            terms += _q8_chunk(x_ptr, w_ptr, rows, N, K, row_bytes, chunk, TYPE, BLOCK_N, BLOCK_K, Q8 == 2)
        acc = tl.sum(terms, axis=1)[None, :]
    elif TERMS > 0:
        terms = tl.zeros([BLOCK_N, TERMS], tl.float32)
        for chunk in range(first, last):
            terms += _gemv_step(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, chunk,
                                TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS)
        acc = tl.sum(terms, axis=1)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for chunk in range(first, last):
            acc += _gemv_step(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, chunk,
                              TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE)
    return acc


@triton.jit
def _gemv_pair_chunks(x_ptr, w_ptr, up_bytes, grid_ptr, m, M, rows, N, K, row_bytes, first, last,
                      TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCKWISE: tl.constexpr, TERMS: tl.constexpr, Q8: tl.constexpr = 0):
    """``_gemv_chunks`` of rows and of the rows up_bytes further (a fused [gate; up] matrix's
    halves) in one loop: each chunk's two steps are issued together, so a program keeps both
    tiles' bytes in flight, as the two programs of the unfused GEMV did. -> (gate, up).
    Q8 as ``_gemv_chunks``' (x rounded once a chunk for both halves)."""
    if Q8 > 0:
        gate = tl.zeros([BLOCK_N, TERMS], tl.float32)
        up = tl.zeros([BLOCK_N, TERMS], tl.float32)
        for chunk in range(first, last):
            xw, dx, sx = _q8_x(x_ptr, chunk, K, BLOCK_K // 32)
            gate += _q8_dot(w_ptr, rows, N, K, row_bytes, chunk, xw, dx, sx, TYPE, BLOCK_N, BLOCK_K, Q8 == 2)
            up += _q8_dot(w_ptr + up_bytes, rows, N, K, row_bytes, chunk, xw, dx, sx, TYPE, BLOCK_N, BLOCK_K, Q8 == 2)
        gate_sum, up_sum = tl.sum(gate, axis=1)[None, :], tl.sum(up, axis=1)[None, :]
    elif TERMS > 0:
        gate = tl.zeros([BLOCK_N, TERMS], tl.float32)
        up = tl.zeros([BLOCK_N, TERMS], tl.float32)
        for chunk in range(first, last):
            gate += _gemv_step(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, chunk,
                               TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS)
            up += _gemv_step(x_ptr, w_ptr + up_bytes, grid_ptr, m, M, rows, N, K, row_bytes, chunk,
                             TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS)
        gate_sum, up_sum = tl.sum(gate, axis=1)[None, :], tl.sum(up, axis=1)[None, :]
    else:
        gate_sum = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up_sum = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for chunk in range(first, last):
            gate_sum += _gemv_step(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, chunk,
                                   TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE)
            up_sum += _gemv_step(x_ptr, w_ptr + up_bytes, grid_ptr, m, M, rows, N, K, row_bytes, chunk,
                                 TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE)
    return gate_sum, up_sum


@triton.jit
def _prefetch_tile(w_ptr, up_bytes, rows, N, K, row_bytes, first, last, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                   ON: tl.constexpr):
    """``prefetch_rows`` of a GEMV program's weights: rows ``rows`` (< N) over chunks [first, last)
    of BLOCK_K columns, and with SWIGLU the up rows up_bytes further. A chunk's bytes are a row's
    by proportion, BLOCK_K row_bytes / K: whole for the GEMVs' 128 and 256 columns, as every type's
    super-block halves into whole bytes (so no format's block size is restated here)."""
    if ON:
        chunk_bytes = BLOCK_K * row_bytes // K
        start = first * chunk_bytes
        stop = tl.minimum(last * chunk_bytes, row_bytes)
        prefetch_rows(w_ptr, rows, row_bytes, start, stop, rows < N)
        if SWIGLU:
            prefetch_rows(w_ptr + up_bytes, rows, row_bytes, start, stop, rows < N)


@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in float32, as ``_swiglu_kernel.act_mul`` computes it (the same bits)."""
    return gate * sigmoid(gate) * up


@triton.jit
def quant_gemv(x_ptr, w_ptr, grid_ptr, y_ptr, parts_ptr, count_ptr, M, N, K, row_bytes, chunks_per_split, up_bytes,
               res_ptr, norm_ptr, sum_ptr, normed_ptr, norm_eps, res_stride, row_count_ptr,
               TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCKWISE: tl.constexpr = True, TERMS: tl.constexpr = 0, SWIGLU: tl.constexpr = False,
               LAST_SUMS: tl.constexpr = False, Q8: tl.constexpr = 0, ADD_NORM: tl.constexpr = False,
               BLOCK_H: tl.constexpr = 1, L2_PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (tile of BLOCK_N outputs, split s): the sums x[m, K_s] . W[n, K_s] for its chunks
    K_s of BLOCK_K columns. x (M, K) contiguous. One split: y (M, N) of any float type, the float32
    sums rounded once as they are stored. Several: each program stores its float32 partial in
    parts (splits, M, N) and then either
    - LAST_SUMS: the tile's last program to finish (``_last_split_sums``) adds the tile's
      partials in split order and stores y, in this launch; or
    - not: y_ptr is ignored and ``sum_splits`` adds them in a second launch (the same order,
      the same bits).
    BLOCKWISE False: every type through the per-value tile (the blockwise reads' twin, for
    timings). TERMS > 0 (M = 1): products kept per column across the chunks, summed once
    (``_gemv_chunks``; Q8: x rounded to 8 bits, Q4_0). SWIGLU (one split, or LAST_SUMS): W (2N, K) is a fused [gate; up]
    projection and y[m, n] = silu(x . W[n]) * (x . W[N + n]), both rows in one program, rounded
    once; up_bytes: N * row_bytes, where the up rows start; parts (splits, M, 2N), the up sums
    N after the gate's. ADD_NORM (one split, or LAST_SUMS; not SWIGLU): y is a residual's delta,
    and the last program to store a tile of it adds and norms every row (``_last_row_add_norms``:
    ``add_norm``'s launch, folded). L2_PREFETCH: the program's weights asked of L2 first
    (``_prefetch_tile``), before the PDL wait: no launch of a decode step writes them."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    first = split * chunks_per_split
    last = tl.minimum(first + chunks_per_split, tl.cdiv(K, BLOCK_K))
    _prefetch_tile(w_ptr, up_bytes, rows, N, K, row_bytes, first, last, BLOCK_K, SWIGLU, L2_PREFETCH)
    after_previous(PDL)
    m = tl.arange(0, BLOCK_M)
    if SWIGLU:
        acc, up = _gemv_pair_chunks(x_ptr, w_ptr, up_bytes, grid_ptr, m, M, rows, N, K, row_bytes, first, last,
                                    TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS, Q8)
    else:
        acc = _gemv_chunks(x_ptr, w_ptr, grid_ptr, m, M, rows, N, K, row_bytes, first, last,
                           TYPE, BLOCK_M, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS, Q8)
        up = acc
    live = (m < M)[:, None] & (rows < N)[None, :]
    if LAST_SUMS:
        if _last_split_sums(parts_ptr, count_ptr, y_ptr, acc, up, m, rows, live, M, N, SWIGLU) and ADD_NORM:
            _last_row_add_norms(y_ptr, res_ptr, norm_ptr, sum_ptr, normed_ptr, row_count_ptr, M, N, norm_eps,
                                res_stride, BLOCK_H)
    elif tl.num_programs(1) > 1:
        tl.store(parts_ptr + (split * M + m[:, None]) * N + rows[None, :], acc, mask=live)
    else:
        if SWIGLU:
            acc = _silu_mul(acc, up)
        tl.store(y_ptr + m[:, None] * N + rows[None, :], stored_as(acc, y_ptr), mask=live)
        if ADD_NORM:
            _last_row_add_norms(y_ptr, res_ptr, norm_ptr, sum_ptr, normed_ptr, row_count_ptr, M, N, norm_eps,
                                res_stride, BLOCK_H)


@triton.jit
def _last_row_add_norms(y_ptr, res_ptr, norm_ptr, sum_ptr, normed_ptr, counter, M, N, eps, res_stride,
                        BLOCK_H: tl.constexpr):
    """The residual add and norm after a GEMV, by the last of its tiles to store y, not by a
    launch of its own (``add_norm.add_rms_norm``: 80 a 35B-A3B decode step, one after each
    mixer's output projection and each mixture's down projection): each program that stored a
    tile of y (M, N) counts itself; the last reads y back (from L2) and for each row m stores
    res[m] + y[m] in sum's type and its norm with weight ``norm_ptr``
    (``_add_norm_kernel.added_norm``: that launch's bits), then sets the counter back to 0. The
    expert GEMV calls it per token (M = 1, the token's row and counter)."""
    if last_to_arrive(counter, tl.num_programs(0)):
        for m in range(0, M):
            added_norm(res_ptr + m * res_stride, y_ptr + m * N, norm_ptr, sum_ptr + m * N, normed_ptr + m * N, N,
                       eps, BLOCK_H, ".cg")
        rearm(counter)


@triton.jit
def _last_split_sums(parts_ptr, count_ptr, y_ptr, acc, up, m, rows, live, M, N, SWIGLU: tl.constexpr):
    """A split GEMV's partials summed by the tile's last program, not by one more launch (a
    35B-A3B decode step's split GEMVs launched 120 ``sum_splits``): each program stores its
    partial (and up's), counts itself in the tile's counter, and the one that counts last adds
    the tile's partials in split order (``sum_splits``' order: the same bits whichever program
    it is), stores y rounded once and sets the counter back to 0 for the next launch
    (``last_to_arrive``, ``rearm``: one int32 per tile). Returns whether this program was it."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    width = 2 * N if SWIGLU else N
    at = (split * M + m[:, None]) * width + rows[None, :]
    tl.store(parts_ptr + at, acc, mask=live)
    if SWIGLU:
        tl.store(parts_ptr + at + N, up, mask=live)
    last = last_to_arrive(count_ptr + tile, n_splits)
    if last:
        total, up_total = split_sums(parts_ptr + m[:, None] * width + rows[None, :], M * width, n_splits, live, N,
                                     SWIGLU)
        if SWIGLU:
            total = _silu_mul(total, up_total)
        tl.store(y_ptr + m[:, None] * N + rows[None, :], stored_as(total, y_ptr), mask=live)
        rearm(count_ptr + tile)
    return last


@triton.jit
def quant_gemm(x_ptr, w_ptr, grid_ptr, y_ptr, M, N, K, row_bytes,
               TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Program (M tile, N tile): y = x @ W^T over all of K. M tiles vary fastest, so programs
    running together share W's tile (its bytes read once from DRAM, then from L2). y (M, N) of
    any float type: the float32 sums rounded once as they are stored."""
    after_previous(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = x_ptr + m.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols[None, :], mask=(m < M)[:, None] & (cols < K)[None, :], other=0.0)
        acc = _weight_product(acc, x, w_ptr, grid_ptr, rows, start, row_bytes, N, K, TYPE, BLOCK_K, DOT_DTYPE,
                              PRECISION)
    out = y_ptr + m.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, stored_as(acc, y_ptr), mask=(m < M)[:, None] & (rows < N)[None, :])


@triton.jit
def quant_gemv_experts(x_ptr, w_ptr, grid_ptr, ids_ptr, scale_ptr, y_ptr, N, K, row_bytes, expert_bytes,
                       pairs_per_row, up_bytes, parts_ptr, count_ptr, shared_ptr, gate_ptr, gate_stride, shared_w_ptr,
                       res_ptr, norm_ptr, sum_ptr, normed_ptr, norm_eps, res_stride, row_count_ptr,
                       TYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TERMS: tl.constexpr,
                       SCALED: tl.constexpr = False, BLOCKWISE: tl.constexpr = True, SWIGLU: tl.constexpr = False,
                       TOP_K: tl.constexpr = 0, Q8: tl.constexpr = 0, SHARED: tl.constexpr = 0,
                       ADD_NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 1, L2_PREFETCH: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """Program (tile of BLOCK_N outputs, pair p): y[p, n] = x[p] . W[ids[p], n] over all of K,
    the expert's matrix found from its id (int32 or int64) in device memory (no host round trip
    to learn which experts a token chose). x (P / pairs_per_row, K) contiguous: pair p reads row
    p // pairs_per_row (a token's row for its top_k pairs, not a copy per pair); W (E, N,
    row_bytes); y (P, N) float32, times scale[p] (a routing weight, any float type) where
    SCALED. TERMS as ``quant_gemv``'s. SWIGLU: each expert's matrix is (2N, K), [gate; up], and
    y[p, n] = silu(gate . x) * (up . x), of y's type (rounded once); up_bytes (N * row_bytes):
    where an expert's up rows start. TOP_K > 0: a mixture's combine in this launch
    (``_last_pair_combines``): parts (P, N) float32 takes the pairs' products and y (P / TOP_K,
    N) each token's ``gated_sum`` with shared (P / TOP_K, N) and gate (rows gate_stride apart).
    Q8 as ``quant_gemv``'s. SHARED > 0: a mixture's shared expert as one more pair of each token
    (``_pair_matrix``): SHARED pairs a token, its SHARED - 1 routed ones (ids and scales (P /
    SHARED (SHARED - 1),)) then the shared expert's (matrix (N, row_bytes) at shared_w_ptr,
    scaled by sigmoid(gate[t]) where SCALED); the combine (TOP_K = SHARED) then sums the pairs
    alone. ADD_NORM (with TOP_K): each token's combined row is a residual's delta, added and
    normed by the last of its tiles (``_last_token_add_norm``: ``add_norm``'s launch, folded).
    L2_PREFETCH: the program's rows of its expert asked of L2 once its id is read (after the PDL
    wait: the router's launch writes the ids)."""
    after_previous(PDL)
    tile = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    routed, w_expert = _pair_matrix(p, ids_ptr, w_ptr, shared_w_ptr, expert_bytes, SHARED)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    _prefetch_tile(w_expert, up_bytes, rows, N, K, row_bytes, 0, tl.cdiv(K, BLOCK_K), BLOCK_K, SWIGLU, L2_PREFETCH)
    x_row = x_ptr + (p // pairs_per_row) * K
    if SWIGLU:                                                          # a 1-row M
        gate, up = _gemv_pair_chunks(x_row, w_expert, up_bytes, grid_ptr, tl.arange(0, 1), 1, rows, N, K, row_bytes,
                                     0, tl.cdiv(K, BLOCK_K), TYPE, 1, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS, Q8)
        y = _silu_mul(tl.sum(gate, axis=0), tl.sum(up, axis=0))
    else:
        acc = _gemv_chunks(x_row, w_expert, grid_ptr, tl.arange(0, 1), 1, rows, N, K, row_bytes,
                           0, tl.cdiv(K, BLOCK_K), TYPE, 1, BLOCK_N, BLOCK_K, BLOCKWISE, TERMS, Q8)
        y = tl.sum(acc, axis=0)
    if SCALED:
        y = y * _pair_scale(p, routed, scale_ptr, gate_ptr, gate_stride, SHARED)
    if TOP_K > 0:
        if _last_pair_combines(parts_ptr, count_ptr, shared_ptr, gate_ptr, y_ptr, y, p, rows, N, gate_stride, TOP_K,
                               SHARED == 0) and ADD_NORM:
            t = p // TOP_K                                              # token t's row: its own counter
            _last_row_add_norms(y_ptr + t * N, res_ptr + t * res_stride, norm_ptr, sum_ptr + t * N,
                                normed_ptr + t * N, row_count_ptr + t, 1, N, norm_eps, res_stride, BLOCK_H)
    else:
        tl.store(y_ptr + p * N + rows, stored_as(y, y_ptr), mask=rows < N)


@triton.jit
def _pair_matrix(p, ids_ptr, w_ptr, shared_w_ptr, expert_bytes, SHARED: tl.constexpr):
    """Pair p's (index into the routing's ids and weights, matrix). SHARED > 0: token p //
    SHARED's pairs are its SHARED - 1 routed experts, then its shared expert (matrix at
    shared_w_ptr; its index, clamped to the token's last routed pair, is read and not used):
    the shared expert's two GEMVs a layer join the routed experts' launches instead of taking
    two of their own (80 a 35B-A3B decode step)."""
    if SHARED > 0:
        k = p % SHARED
        routed = p // SHARED * (SHARED - 1) + tl.minimum(k, SHARED - 2)
        w_routed = w_ptr + tl.load(ids_ptr + routed).to(tl.int64) * expert_bytes
        return routed, tl.where(k == SHARED - 1, shared_w_ptr, w_routed)
    return p, w_ptr + tl.load(ids_ptr + p).to(tl.int64) * expert_bytes


@triton.jit
def _pair_scale(p, routed, scale_ptr, gate_ptr, gate_stride, SHARED: tl.constexpr):
    """Pair p's routing weight in float32; with SHARED, the shared expert's pair takes
    sigmoid of its token's gate logit (``gated_sum``'s factor, here applied to its float32
    product rather than to its output rounded to the activations' type)."""
    scale = tl.load(scale_ptr + routed).to(tl.float32)
    if SHARED > 0:
        gate = sigmoid(tl.load(gate_ptr + p // SHARED * gate_stride).to(tl.float32))
        scale = tl.where(p % SHARED == SHARED - 1, gate, scale)
    return scale


@triton.jit
def _last_pair_combines(parts_ptr, count_ptr, shared_ptr, gate_ptr, out_ptr, y, p, rows, N, gate_stride,
                        TOP_K: tl.constexpr, GATED: tl.constexpr = True):
    """A mixture's combine by the last of a token's TOP_K pair programs for a tile, not by a
    launch of its own (``moe.combine``: 40 a 35B-A3B decode step): each stores its pair's float32
    product in parts and counts itself in the (token, tile) counter; the one that counts last
    stores the token's ``gated_sum`` (the pairs in order of k: the same bits as ``combine``)
    rounded once, and sets the counter back to 0 (``last_to_arrive``, ``rearm``); returns
    whether this program was it. GATED False: the shared expert is one of the pairs
    (``_pair_matrix``), the sum the pairs' alone."""
    t = p // TOP_K
    live = rows < N
    tl.store(parts_ptr + p * N + rows, y, mask=live)
    counter = count_ptr + t * tl.num_programs(0) + tl.program_id(0)
    last = last_to_arrive(counter, TOP_K)
    if last:
        total = gated_sum(parts_ptr, shared_ptr, gate_ptr, t, rows, N, live, gate_stride, TOP_K, ".cg", GATED)
        tl.store(out_ptr + t * N + rows, stored_as(total, out_ptr), mask=live)
        rearm(counter)
    return last


@triton.jit
def _weight_product(acc, x, w_ptr, grid_ptr, rows, start, row_bytes, N, K, TYPE: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc (BM, BN) plus x (BM, BK) times W's tile of ``rows`` and columns start.. transposed: the
    GEMMs' step (TYPE = DENSE: W's float rows, the grouped GEMM's dense experts). Q4_0 with
    half-type products, a block a step and at most 32 rows of x (the grouped experts' 16-slot
    tiles, short prompts): ``_q4_0_block_product``. Else W's values dequantized
    (``_dequantize_tile``) or read as stored, rounded to the products' type, one tl.dot: with more
    rows the dequantized tile is shared by them, and scaling the (BM, BN) products each step
    costs more than it saves (sm_90, bf16, 4 warps: 16 rows 353 -> 249 instructions a step, 32
    rows 377 -> 273; in session 42's first form 64 rows 422 -> 421 with 80 -> 172 registers and
    128 rows, 8 warps, 240 -> 331).
    Q4_K the same way (its min term as a second product against ones, or as a sum of x across
    the tile's threads) took 428 or 462 instructions a step against the dequantized tile's 372."""
    if TYPE == Q4_0 and BLOCK_K == 32 and x.shape[0] <= 32 and DOT_DTYPE != tl.float32:
        acc += _q4_0_block_product(x.to(DOT_DTYPE), w_ptr, rows, start, row_bytes, N, DOT_DTYPE, PRECISION)
    else:
        cols = start + tl.arange(0, BLOCK_K)
        if TYPE == DENSE:                                   # float rows read as stored (row_bytes: elements)
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * row_bytes + cols[None, :],
                        mask=(rows < N)[:, None] & (cols < K)[None, :], other=0.0)
        else:
            w = _dequantize_tile(w_ptr, grid_ptr, rows, cols, row_bytes, N, K, TYPE)                # (BN, BK)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _q4_0_block_product(x, w_ptr, rows, start, row_bytes, N, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """x (BM, 32) in the products' half type against the Q4_0 block of columns start..start + 31
    of W's rows (BN,) -> (BM, BN) float32: the codes' c - 8 exactly in the half type (by
    their bits: 128 + c in bf16, 1024 + c in f16, less 136 or 1032), one tensor-core product,
    then each row's scale d in float32. W's values are never d (c - 8) rounded to the half type,
    as the dequantized tile's were: the products are exact, the sums float32's. The codes come
    two bytes a load, four to a unit, in the unit's order; x's columns are permuted to match
    (a sum's terms in another order). sm_90 SASS of the grouped experts' GEMM (Triton 3.6, bf16,
    16 x 64 x 32): 350 -> 249 instructions a step, 122 -> 90 registers (280 and 104 with a byte
    load per value); the dequantized tile took an int-to-float conversion, a product and a
    rounding per value, and went to shared memory a value at a time."""
    ok = rows < N
    block = w_ptr + rows.to(tl.int64) * row_bytes + (start // 32) * 18                 # (BN,) block starts
    units = tl.load((block + 2).to(tl.pointer_type(tl.uint16))[:, None] + tl.arange(0, 8)[None, :],
                    mask=ok[:, None], other=0).to(tl.int32)                             # (BN, 8): bytes 2w, 2w + 1
    q = tl.reshape((units[:, None, :] >> (4 * tl.arange(0, 4)[None, :, None])) & 0x0F, (units.shape[0], 32))
    # column p * 8 + w holds value 2w + 16 (p % 2) + p // 2; x's columns j = 16 h + 2 w + l go to (2 l + h) * 8 + w
    x = tl.reshape(tl.permute(tl.reshape(x, (x.shape[0], 2, 8, 2)), (0, 3, 1, 2)), (x.shape[0], 32))
    if DOT_DTYPE == tl.bfloat16:
        w = (q | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True) - 136.0
    else:
        w = (q | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True) - 1032.0
    d = f16_at(block, ok)                                                                # (BN,)
    return tl.dot(x, tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION) * d[None, :]


@triton.jit
def quant_gemm_experts(x_ptr, w_ptr, grid_ptr, pairs_ptr, tile_expert_ptr, scale_ptr, y_ptr,
                       N, K, row_bytes, expert_bytes, n_experts, pairs_per_row,
                       TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """Program (M tile t, N tile): the grouped GEMM of a mixture's prompt. The (token, expert)
    pairs come sorted by expert, each expert's run padded to whole tiles (``quant_matmul.route``),
    so tile t holds pairs of one expert, tile_expert[t]: y[p] = x[p] @ W[e]^T for the pairs p of
    the tile (pairs[slot], -1 in padding). Tiles past the last expert's (tile_expert = n_experts:
    the grid is sized without asking the host how many there are) return at once.
    x (P / pairs_per_row, K) contiguous (``quant_gemv_experts``'); W (E, N, row_bytes) GGUF blocks, or with TYPE = DENSE (E, N, K) floats
    read as stored (row_bytes = K and expert_bytes = N K then count elements); y (P, N) float32,
    row p times scale[p] where SCALED (``quant_gemv_experts``')."""
    after_previous(PDL)
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e >= n_experts:
        return
    p = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = p >= 0
    x_row = x_ptr + (tl.where(valid, p, 0) // pairs_per_row).to(tl.int64)[:, None] * K
    w_expert = w_ptr + e.to(tl.int64) * expert_bytes
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + cols[None, :], mask=valid[:, None] & (cols < K)[None, :], other=0.0)
        acc = _weight_product(acc, x, w_expert, grid_ptr, rows, start, row_bytes, N, K, TYPE, BLOCK_K, DOT_DTYPE,
                              PRECISION)
    if SCALED:
        acc = acc * tl.load(scale_ptr + tl.where(valid, p, 0)).to(tl.float32)[:, None]
    out = y_ptr + tl.where(valid, p, 0).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, acc, mask=valid[:, None] & (rows < N)[None, :])


@triton.jit
def quant_rows(ids_ptr, w_ptr, grid_ptr, out_ptr, V, K, row_bytes, TYPE: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr = False):
    """Program (token i, block of BLOCK_K columns): row ids[i] of W (V, row_bytes), dequantized
    and rounded once to out's type into out (T, K): an embedding lookup in one launch (the
    torch decoders' gather, unpacking and casts were eight a decode step). An id outside [0, V)
    gives zeros (the callers check ids against the vocabulary first)."""
    after_previous(PDL)
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row = tl.load(ids_ptr + i + tl.arange(0, 1))                        # (1,): a tile of one row
    row = tl.where((row >= 0) & (row < V), row, V)                      # outside W: zeros, never stray bytes
    values = _dequantize_tile(w_ptr, grid_ptr, row, cols, row_bytes, V, K, TYPE)
    tl.store(out_ptr + i * K + cols[None, :], stored_as(values, out_ptr), mask=(cols < K)[None, :])


@triton.jit
def sum_splits(parts_ptr, y_ptr, n_splits, size, half, BLOCK: tl.constexpr, SWIGLU: tl.constexpr = False,
               PDL: tl.constexpr = False):
    """y (size,) = the sum of parts (n_splits, size) float32 over the splits, in order, rounded
    once to y's type: a split GEMV's partial sums in one launch (torch's sum and cast were two).
    SWIGLU: parts (n_splits, M, 2 half) of a fused [gate; up] projection and y (M, half) =
    silu(gate) * up of the sums: y's size elements, each summing its two columns."""
    after_previous(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < size
    if SWIGLU:
        at = (i // half) * 2 * half + i % half                         # gate's column; up's is half later
        stride = 2 * size
    else:
        at = i
        stride = size
    total, up = split_sums(parts_ptr + at, stride, n_splits, live, half, SWIGLU)     # up to 8 splits a wave
    if SWIGLU:
        total = _silu_mul(total, up)
    tl.store(y_ptr + i, stored_as(total, y_ptr), mask=live)


INTERPRETED = not isinstance(quant_gemv, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
