"""The Triton kernel of ``kv_append`` (imported only when it runs: importing kvslim needs no triton).

One program per token and block of its KV heads' rows. It loads the rows as float32, takes
them into the format's code domain (llama.cpp's Hadamard as the same butterfly as
``rotation.hadamard_blocks``; TurboQuant's matrix as a tl.dot), quantizes each block as the
format's torch encoder does, writes the row's bytes at its pool row and its overflow flag. The
constexprs and tables come from the format's ``kernel_encoder`` (kvslim/formats/base.py), the
declaration kv_encode.c reads too.

Bit parity with the torch encoders: divisions and square roots are the correctly rounded
``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``sqrt`` on a GPU are approximate), and the
launcher turns off mul+add fusion (``x * id + 8.5`` rounds twice, as in torch).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous

from ._rotation_kernel import hadamard, matrix_step, matrix_step_operands, times_matrix

# The encoder kinds and float types, as kv_append.KINDS and FLOAT_TYPES number them (constexpr:
# a jitted function reads no other globals).
FLOAT, Q8_0, Q4_0, TURBO, GRID, IQ4_NL, Q4_1, Q5_0, Q5_1, GRID_SUB = (tl.constexpr(k) for k in range(10))
F32, F16, BF16 = (tl.constexpr(k) for k in range(3))
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _div(a, b):
    """a / b correctly rounded, as torch divides (Triton's ``/`` is approximate on a GPU); a, b broadcast."""
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def _store_u16(ptr, bits, mask):
    """Little-endian halves of 16-bit patterns (int32 tensor) at ptr, ptr + 1."""
    tl.store(ptr, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _f16_bits(v):
    """float32 -> its f16 (round to nearest even) bit pattern as int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _bf16_bits(v):
    """float32 -> its bf16 bit pattern, rounded to nearest even in integers as kv_encode.c's store_bf16
    (the interpreter's cast to bf16 truncates, so a cast would pass on a GPU and fail here)."""
    u = v.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    u = tl.where(nan, u | 0x00400000, u + 0x7FFF + ((u >> 16) & 1))
    return (u >> 16).to(tl.int32)


@triton.jit
def _signed_absmax(x, j, BLOCK: tl.constexpr):
    """(|max|, signed max) over the last axis of x (R, NB, BLOCK), the first one on ties (torch's argmax)."""
    a = tl.abs(x)
    amax = tl.max(a, 2)
    first = tl.min(tl.where(a == amax[:, :, None], j, BLOCK), 2)
    mx = tl.max(tl.where(j == first[:, :, None], x, float("-inf")), 2)    # max with -inf keeps a -0.0
    return amax, mx


@triton.jit
def _round_half_away(v):
    """C roundf as ggml.round_half_away, then C's cast (a non-finite value becomes 0) -> int32."""
    a = tl.abs(v)
    fl = tl.floor(a)
    r = fl + tl.where(a - fl >= 0.5, 1.0, 0.0)
    r = tl.where(v < 0, -r, r)
    return tl.where(a <= FLT_MAX, r, 0.0).to(tl.int32)


@triton.jit
def _count_below(v, table, N: tl.constexpr):
    """torch.bucketize(v, table[:N]): how many of the N ascending values are < v."""
    code = tl.zeros(v.shape, tl.int32)
    for k in tl.static_range(N):
        code += (v > tl.load(table + k)).to(tl.int32)
    return code


@triton.jit
def _iq4nl_nearest(al, grid):
    """ggml.iq4nl_nearest (llama.cpp's best_index_int8): the nearest of 16 grid values, upper on ties."""
    mu = tl.zeros(al.shape, tl.int32)
    for k in tl.static_range(16):
        mu += (tl.load(grid + k) <= al).to(tl.int32)
    mu = tl.minimum(tl.maximum(mu, 1), 15)
    lo, hi = tl.load(grid + mu - 1), tl.load(grid + mu)
    idx = tl.where((al - lo) < (hi - al), mu - 1, mu)
    idx = tl.where(al <= tl.load(grid), 0, idx)
    return tl.where(al >= tl.load(grid + 15), 15, idx)


@triton.jit
def _safe_inverse(d):
    return tl.where(d != 0, _div(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0, d, 1.0)), 0.0)


@triton.jit
def _iq4nl_scale(x, j, grid):
    """ggml._iq4nl_scale on blocks x (R, NB, 32): candidate 0 from d = max / -grid[0], then
    1/d = (t + grid[0]) / max for t = -7..7, each refit by weighted least squares (weights x^2), kept if strictly better.
    The sums are tree sums, not the reference's left-to-right loop: a near-tie may go the other way."""
    amax, mx = _signed_absmax(x, j, 32)
    live = amax >= 1e-15
    mx = tl.where(live, mx, 1.0)
    w = x * x
    g0 = tl.load(grid)                                                      # -127
    inv = _div(tl.full(mx.shape, 1.0, tl.float32), _div(mx, tl.full(mx.shape, -1.0, tl.float32) * g0))
    q = tl.load(grid + _iq4nl_nearest(x * inv[:, :, None], grid))
    wq = w * q
    d = _div(tl.sum(wq * x, 2), tl.sum(wq * q, 2))
    best = d * tl.sum(wq * x, 2)
    for k in range(1, 16):
        inv = _div(tl.full(mx.shape, k - 8, tl.float32) + g0, mx)
        q = tl.load(grid + _iq4nl_nearest(x * inv[:, :, None], grid))
        wq = w * q
        sx, s2 = tl.sum(wq * x, 2), tl.sum(wq * q, 2)
        better = (s2 > 0) & (sx * sx > best * s2)
        d_try = _div(sx, tl.where(s2 > 0, s2, 1.0))
        d = tl.where(better, d_try, d)
        best = tl.where(better, d_try * sx, best)
    return tl.where(live, d, 0.0)


@triton.jit
def _grid_scale(x, table, mids, tries, N_TRIES: tl.constexpr, N_CODES: tl.constexpr):
    """grid.search_scale on blocks x (R, NB, B): the best of N_TRIES candidate scales by explained
    energy (the first on ties), codes reassigned with it and the scale refit once more -> (d, codes)."""
    amax = tl.max(tl.abs(x), 2)
    gmax = tl.maximum(tl.abs(tl.load(table)), tl.abs(tl.load(table + N_CODES - 1)))
    d0 = tl.maximum(_div(amax, gmax), 1e-30)
    best_score = tl.full(amax.shape, float("-inf"), tl.float32)
    best_d = tl.zeros(amax.shape, tl.float32)
    for t in range(N_TRIES):
        cand = d0 * tl.load(tries + t)
        g = tl.load(table + _count_below(_div(x, cand[:, :, None]), mids, N_CODES - 1))
        sxg, sgg = tl.sum(g * x, 2), tl.maximum(tl.sum(g * g, 2), 1e-30)
        score = _div(sxg * sxg, sgg)
        better = score > best_score
        best_d = tl.where(better, _div(sxg, sgg), best_d)
        best_score = tl.where(better, score, best_score)
    div = tl.maximum(best_d, 1e-30)
    codes = _count_below(_div(x, div[:, :, None]), mids, N_CODES - 1)
    g = tl.load(table + codes)
    d = _div(tl.sum(g * x, 2), tl.maximum(tl.sum(g * g, 2), 1e-30))
    return tl.where(amax > 0, d, 0.0), codes


@triton.jit
def _store_packed(dst, codes, mask, BITS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr,
                  BLOCK: tl.constexpr):
    """codes (R, NB, BLOCK) of BITS bits at dst (R, NB) byte pointers: bitpack.pack_bits, eight codes
    to a little-endian word of BITS bytes. mask (R, NB, BLOCK // 8): the words to write."""
    i = tl.arange(0, 8)[None, None, None, :]
    word = tl.sum(tl.reshape(codes, (R, NB, BLOCK // 8, 8)) << (BITS * i), 3)     # disjoint bits: sum = or
    w = tl.arange(0, BLOCK // 8)[None, None, :]
    for m in tl.static_range(BITS):
        tl.store(dst[:, :, None] + w * BITS + m, ((word >> (8 * m)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _encode_float(y, out, mask, FLOAT_TYPE: tl.constexpr, BLOCK_D: tl.constexpr):
    """The row cast to f32 / f16 / bf16 (round to nearest even), little-endian."""
    d = tl.arange(0, BLOCK_D)[None, :]
    if FLOAT_TYPE == F32:
        bits = y.to(tl.int32, bitcast=True)
        for b in tl.static_range(4):
            tl.store(out + 4 * d + b, ((bits >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)
    else:
        if FLOAT_TYPE == F16:
            bits = _f16_bits(y)
        else:
            bits = _bf16_bits(y)
        _store_u16(out + 2 * d, bits, mask)


@triton.jit
def _encode_ggml(y, out, live, table, KIND: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr):
    """ggml's blocks of 32 (its reference quantizers) of y (BLOCK_M, NB, 32); live (BLOCK_M, NB):
    q8_0 [d][int8], q4_0 / iq4_nl [d][nibbles], q4_1 [d][min][nibbles], q5_0 [d][qh][nibbles],
    q5_1 [d][min][qh][nibbles] (qh: bit j of a little-endian u32 = bit 4 of code j)."""
    j = tl.arange(0, 32)[None, None, :]
    dst = out + tl.arange(0, NB)[None, :] * BLOCK_BYTES                    # (BLOCK_M, NB) block starts
    if KIND == Q8_0:
        amax, _ = _signed_absmax(y, j, 32)
        d = _div(amax, tl.full(amax.shape, 127.0, tl.float32))
        q = _round_half_away(y * _safe_inverse(d)[:, :, None])
        tl.store(dst[:, :, None] + 2 + j, (q & 0xFF).to(tl.uint8), mask=live[:, :, None])
    else:
        nibbles_at = 2
        if KIND == Q4_0:
            d, q = _symmetric(y, j, 8.0, 15)
        elif KIND == Q5_0:
            d, q = _symmetric(y, j, 16.0, 31)
        elif KIND == Q4_1 or KIND == Q5_1:
            lo = tl.min(y, 2)
            if KIND == Q4_1:
                d, q = _min_max(y, lo, 15)
            else:
                d, q = _min_max(y, lo, 31)
            _store_u16(dst + 2, _f16_bits(lo), live)
            nibbles_at = 4
        else:
            d = _iq4nl_scale(y, j, table)                                   # final codes with the f32 scale
            q = _iq4nl_nearest(y * _safe_inverse(d)[:, :, None], table)
        if KIND == Q5_0 or KIND == Q5_1:                                    # the 5th bits before the nibbles
            high = tl.reshape((q >> 4) & 1, (BLOCK_M, NB, 4, 8)) << tl.arange(0, 8)[None, None, None, :]
            tl.store(dst[:, :, None] + nibbles_at + tl.arange(0, 4)[None, None, :], tl.sum(high, 3).to(tl.uint8),
                     mask=live[:, :, None])
            nibbles_at += 4
        halves = tl.reshape(q & 0x0F, (BLOCK_M, NB, 2, 16)) << (4 * tl.arange(0, 2)[None, None, :, None])
        byte = tl.sum(halves, 2)                                            # code l | code l+16 << 4
        tl.store(dst[:, :, None] + nibbles_at + tl.arange(0, 16)[None, None, :], byte.to(tl.uint8),
                 mask=live[:, :, None])
    _store_u16(dst, _f16_bits(d), live)


@triton.jit
def _c_int_capped(xq, CAP: tl.constexpr):
    """min(CAP, (int) xq) as the C references cast: toward zero, a non-finite value to 0."""
    return tl.minimum(tl.where(tl.abs(xq) <= FLT_MAX, xq, 0.0).to(tl.int32), CAP)


@triton.jit
def _symmetric(y, j, HALF: tl.constexpr, CAP: tl.constexpr):
    """q4_0 / q5_0: d = the signed max / -HALF, codes (int)(x / d + HALF + 0.5) capped at CAP."""
    _, mx = _signed_absmax(y, j, 32)
    d = _div(mx, tl.full(mx.shape, -HALF, tl.float32))
    return d, _c_int_capped(y * _safe_inverse(d)[:, :, None] + (HALF + 0.5), CAP)


@triton.jit
def _min_max(y, lo, LEVELS: tl.constexpr):
    """q4_1 / q5_1: d = (max - min) / LEVELS, codes (int)((x - min) / d + 0.5) capped at LEVELS."""
    d = _div(tl.max(y, 2) - lo, tl.full(lo.shape, LEVELS, tl.float32))
    return d, _c_int_capped((y - lo[:, :, None]) * _safe_inverse(d)[:, :, None] + 0.5, LEVELS)


@triton.jit
def _encode_grid(y, out, live, table, mids, tries, N_TRIES: tl.constexpr, BLOCK_M: tl.constexpr,
                 NB: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """The nl grids' blocks of y (BLOCK_M, NB, BLOCK): [f16 d][codes packed]."""
    d, codes = _grid_scale(y, table, mids, tries, N_TRIES, 1 << BITS)
    dst = out + tl.arange(0, NB)[None, :] * BLOCK_BYTES
    _store_u16(dst, _f16_bits(d), live)
    _store_packed(dst + 2, codes, live[:, :, None] & (tl.arange(0, BLOCK // 8)[None, None, :] >= 0), BITS,
                  BLOCK_M, NB, BLOCK)


@triton.jit
def _encode_grid_sub(y, out, live, table, mids, tries, ladder, N_TRIES: tl.constexpr, BLOCK_M: tl.constexpr,
                     NB: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                     SUB: tl.constexpr):
    """The nls rows (grid.search_two_level) of y (BLOCK_M, NB, BLOCK): d starts as the largest of
    the SUB-value sub-blocks' own best scales, rounded to f16; then twice, each sub-block's rung
    of the 4-step ladder (least squared error, the first on ties) and its codes, and d refit by
    least squares, rounded to f16. [f16 d][2-bit rungs, little-endian][codes packed]."""
    S: tl.constexpr = BLOCK // SUB
    N_CODES: tl.constexpr = 1 << BITS
    d_sub, _ = _grid_scale(tl.reshape(y, (BLOCK_M, NB * S, SUB)), table, mids, tries, N_TRIES, N_CODES)
    d = tl.max(tl.reshape(d_sub, (BLOCK_M, NB, S)), 2).to(tl.float16).to(tl.float32)
    sub = tl.reshape(y, (BLOCK_M, NB, S, SUB))
    rung = tl.zeros((BLOCK_M, NB, S), tl.int32)
    codes = tl.zeros((BLOCK_M, NB, S, SUB), tl.int32)
    for _ in tl.static_range(2):
        best = tl.full((BLOCK_M, NB, S), float("inf"), tl.float32)
        for r in tl.static_range(4):
            cand = tl.maximum(d * tl.load(ladder + r), 1e-30)[:, :, None, None]
            c = _count_below(_div(sub, cand), mids, N_CODES - 1)
            e = sub - tl.load(table + c) * cand
            err = tl.sum(e * e, 3)
            better = err < best
            best = tl.where(better, err, best)
            rung = tl.where(better, r, rung)
            codes = tl.where(better[:, :, :, None], c, codes)
        g = tl.load(table + codes) * tl.load(ladder + rung)[:, :, :, None]
        d = _div(tl.sum(tl.sum(g * sub, 3), 2), tl.maximum(tl.sum(tl.sum(g * g, 3), 2), 1e-30))
        d = d.to(tl.float16).to(tl.float32)
    dst = out + tl.arange(0, NB)[None, :] * BLOCK_BYTES
    _store_u16(dst, _f16_bits(d), live)
    _store_u16(dst + 2, tl.sum(rung << (2 * tl.arange(0, S)[None, None, :]), 2), live)     # S = 8: 16 bits
    _store_packed(dst + 2 + S // 4, tl.reshape(codes, (BLOCK_M, NB, BLOCK)),
                  live[:, :, None] & (tl.arange(0, BLOCK // 8)[None, None, :] >= 0), BITS, BLOCK_M, NB, BLOCK)


@triton.jit
def _encode_turbo(x, x_at, out, live, rot_m, bounds, cents, limit, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                  NB: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                  ROT_STEP: tl.constexpr):
    """TurboQuant MSE per group of x (BLOCK_M, NB, BLOCK) (GROUP values, padded to BLOCK; read again
    at x_at (BLOCK_M, NB, 1) pointers for the product): the norm, the unit vector rotated by R
    (y = R u: fp32 products, ``times_matrix``), each value's bucket, scale norm / |centroids[codes]|.
    -> the row's overflow flag (a group norm non-finite or past limit)."""
    i = tl.arange(0, BLOCK)
    inside = i[None, None, :] < GROUP
    # R^T's element (k, j) is R[j, k]: rows at stride 1, columns at GROUP; ROT_STEP of its rows a
    # tl.dot step (kv_append.kernel_config: all of them at 16 rows)
    if ROT_STEP == BLOCK:
        # one step: the matrix and x's copy for the product loaded before the norm's sum, whose
        # barrier held them back a round trip (``times_matrix`` loads them where it multiplies)
        k = tl.arange(0, BLOCK)
        xr, m = matrix_step_operands(x_at, live[:, :, None], rot_m, 1, GROUP, k, k, GROUP)
        norm = tl.math.sqrt_rn(tl.sum(x * x, 2))
        y = matrix_step(xr, m, tl.zeros((BLOCK_M * NB, BLOCK), tl.float32), tl.maximum(norm, 1e-30)[:, :, None],
                        BLOCK_M * NB, BLOCK, True)
    else:
        norm = tl.math.sqrt_rn(tl.sum(x * x, 2))
        y = times_matrix(x_at, live[:, :, None], rot_m, 1, GROUP, tl.maximum(norm, 1e-30)[:, :, None], GROUP,
                         BLOCK_M * NB, BLOCK, BLOCK, 0, DIVIDE=True, STEP=ROT_STEP)
    codes = _count_below(tl.reshape(y, (BLOCK_M, NB, BLOCK)), bounds, (1 << BITS) - 1)
    c = tl.where(inside, tl.load(cents + codes), 0.0)
    scale = _div(norm, tl.math.sqrt_rn(tl.sum(c * c, 2)))
    dst = out + tl.arange(0, NB)[None, :] * BLOCK_BYTES
    _store_u16(dst, _f16_bits(scale), live)
    words = live[:, :, None] & (tl.arange(0, BLOCK // 8)[None, None, :] < GROUP // 8)
    _store_packed(dst + 2, codes, words, BITS, BLOCK_M, NB, BLOCK)
    return tl.max(tl.where(live & ~(norm <= limit), 1, 0), 1)


@triton.jit
def kv_append_rows(x_ptr, pool, table_ptr, slots_ptr, pos_ptr, flags_ptr, rot_m, bounds, cents, tries, ladder,
                   n_kv, pool_rows, row_bytes, table_stride, x_stride, limit, rot_scale,
                   x2_ptr, pool2, x2_stride,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   KIND: tl.constexpr, FLOAT_TYPE: tl.constexpr, ROT: tl.constexpr, LOG2_ROT: tl.constexpr,
                   GROUP: tl.constexpr, N_BLOCKS: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                   BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr, N_TRIES: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   ROT_STEP: tl.constexpr, PDL: tl.constexpr = False):
    """Token t = program_id(0)'s rows of x (its n_kv heads, HEAD_DIM each; heads contiguous, tokens
    x_stride apart: the K or V columns of a fused projection), BLOCK_M heads a program from head
    program_id(1) * BLOCK_M -> their packed bytes at each head's pool (n_kv, pool_rows, row_bytes)
    uint8, in the row the block table gives the token: page table[slots[t], positions[t] //
    PAGE_SIZE], offset positions[t] % PAGE_SIZE (the cache's ``_flat_index``, so no launch
    computes rows first); flags[slots[t]] = 1 where a row overflows (the cache's per-slot flags,
    raised, never lowered: writers of one slot write the same 1). A program's slot, position and
    page are the token's: three loads, once, where a block of rows from several tokens loaded
    them row by row (each thread every row's, one after another). Blocks: N_BLOCKS of GROUP
    values (NB and BLOCK: powers of two >= them). Programs (t, h, 1) encode a second side alike
    (the same encoder and tables), V's beside K's: its rows x2 (tokens x2_stride apart) into
    pool2, in the same launch."""
    after_previous(PDL)
    second = tl.program_id(2) == 1
    x_ptr = tl.where(second, x2_ptr, x_ptr)
    x_stride = tl.where(second, x2_stride, x_stride)
    pool = tl.where(second, pool2, pool)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_live = head < n_kv
    x_row = x_ptr + token * x_stride + head.to(tl.int64) * HEAD_DIM                # (BLOCK_M,) row starts in x
    slot = tl.load(slots_ptr + token).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    page = tl.load(table_ptr + slot * table_stride + pos // PAGE_SIZE).to(tl.int64)
    pool_row = page * PAGE_SIZE + pos % PAGE_SIZE
    out = pool + (head.to(tl.int64) * pool_rows + pool_row) * row_bytes            # (BLOCK_M,) row starts
    if KIND == TURBO:                                                       # groups need not be powers of two
        b = tl.arange(0, NB)[None, :, None]
        i = tl.arange(0, BLOCK)[None, None, :]
        m3 = r_live[:, None, None] & (b < N_BLOCKS) & (i < GROUP)
        x = tl.load(x_row[:, None, None] + b * GROUP + i, mask=m3, other=0.0)
        live = r_live[:, None] & (tl.arange(0, NB)[None, :] < N_BLOCKS)
        bad = _encode_turbo(x.to(tl.float32), x_row[:, None, None] + b * GROUP, out[:, None], live, rot_m, bounds,
                            cents, limit, GROUP, BLOCK_M, NB, BLOCK, BITS, BLOCK_BYTES, ROT_STEP)
    else:
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = r_live[:, None] & (d < HEAD_DIM)
        y = tl.load(x_row[:, None] + d, mask=mask, other=0.0).to(tl.float32)
        if ROT > 0:
            y = hadamard(y, ROT, LOG2_ROT, BLOCK_M, BLOCK_D, rot_scale)
        bad = tl.max(tl.where(mask & ~(tl.abs(y) <= limit), 1, 0), 1)     # NaN, inf or past the limit
        if KIND == FLOAT:
            _encode_float(y, out[:, None], mask, FLOAT_TYPE, BLOCK_D)
        else:
            y3 = tl.reshape(y, (BLOCK_M, NB, BLOCK))
            live = r_live[:, None] & (tl.arange(0, NB)[None, :] < N_BLOCKS)
            if KIND == GRID:
                _encode_grid(y3, out[:, None], live, cents, bounds, tries, N_TRIES, BLOCK_M, NB, BLOCK, BITS,
                             BLOCK_BYTES)
            elif KIND == GRID_SUB:
                _encode_grid_sub(y3, out[:, None], live, cents, bounds, tries, ladder, N_TRIES, BLOCK_M, NB, BLOCK,
                                 BITS, BLOCK_BYTES, 16)
            else:
                _encode_ggml(y3, out[:, None], live, cents, KIND, BLOCK_M, NB, BLOCK_BYTES)
    flagged = tl.max(tl.where(r_live & (bad != 0), 1, 0), 0)
    tl.store(flags_ptr + slot, flagged.to(tl.uint8), mask=flagged != 0)


INTERPRETED = not isinstance(kv_append_rows, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
