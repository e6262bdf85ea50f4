"""Packed-row decoding shared by the Triton attention kernels (decode and prefill), and what
every kernel shares: the rounding of float32 results to a stored half type, and the sigmoid.

Each format's row layout reaches these functions as constexprs read from ``codec_fields``
(``kvslim/native/paged_attention.py``, the C kernel's description of each format); nothing
here restates a format. Imported only when a kernel runs: importing kvslim needs no triton.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# The codec kinds, as kvslim/native/paged_attention.py numbers them.
F32, F16, BF16, Q8, NIBBLE, PACKED = range(6)
LADDER_AT = tl.constexpr(32)        # where the rungs' factors follow the code values in ``lut``


@triton.jit
def stored_as(value, ptr):
    """float32 values in ``ptr``'s element type, rounded to nearest even as torch's .to() rounds
    them. bf16 by its bits: a GPU's conversion rounds so, but Triton's interpreter truncates,
    and the tests run there; NaN stays NaN (rounding its bits could carry into inf)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        top = tl.where(value != value, 0x7FC0, top)
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return value.to(ptr.dtype.element_ty)


@triton.jit
def sigmoid(x):
    """1 / (1 + e^-x) in float32: every kernel's sigmoid, and its silu as x * sigmoid(x), one
    expression, so a fused kernel gives the bits of the kernel it replaces."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def after_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch (``kvslim.gpu.pdl``), a kernel's first statement: wait
    until the launch before this one has finished and its writes are visible (griddepcontrol.wait),
    then let the next launch start (its own wait holds it). Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# A row's 128-byte lines a prefetch pass covers (``prefetch_rows``): one (rows, 16) tile of addresses,
# a line a thread for an 8-row tile of 4 warps; longer row spans take more passes.
PREFETCH_LINES = tl.constexpr(16)
LINE_BYTES = tl.constexpr(128)


@triton.jit
def prefetch_lines(rows, row_bytes, start, stop, line, live):
    """Byte offsets (rows, lines) of lines ``line`` (a vector, made by the caller in its layout: the
    Gluon decode kernel's too) of bytes [start, stop) of each row (row r's bytes at r * row_bytes),
    and where they are wanted: address start + 128 l for l = 0 .. ceil((stop - start) / 128), the
    last clamped to stop - 1, so that the lines they fall in are every line of the span (start
    need not be line-aligned) and no address leaves it. In rows' integer type: 64-bit rows where
    rows * row_bytes may pass 2 GB."""
    at = tl.minimum(start + line * LINE_BYTES, stop - 1)
    wanted = live[:, None] & (line <= tl.cdiv(stop - start, LINE_BYTES))[None, :] & (start < stop)
    return rows[:, None] * row_bytes + at[None, :], wanted


@triton.jit
def prefetch_rows(base, rows, row_bytes, start, stop, live):
    """Ask L2 for bytes [start, stop) of each live row at base (``prefetch_lines``' lines), every
    line at once and waiting for none: a GEMV program's weights for its chunks, which its loop then
    reads from L2 one chunk a round trip instead of from DRAM (a decode GEMV program has 4-8
    chunks and few programs an SM: in flight at a time, one chunk's bytes a program). Only bytes
    no launch of the step writes may be prefetched before ``after_previous``. PTX: never under the
    interpreter (its callers' switch, off there)."""
    line = tl.arange(0, PREFETCH_LINES)
    wide = rows.to(tl.int64)                        # (an lm_head's 248K rows of 1,680 bytes: 417 MB)
    prefetch_l2(base, *prefetch_lines(wide, row_bytes, start, stop, line, live))     # a decode GEMV's spans: one pass
    for first_line in range(PREFETCH_LINES, tl.cdiv(stop - start, LINE_BYTES) + 1, PREFETCH_LINES):
        prefetch_l2(base, *prefetch_lines(wide, row_bytes, start, stop, first_line + line, live))


@triton.jit
def prefetch_l2(base, at, wanted):
    """PTX's prefetch.global.L2 of base + at where wanted (no address is formed where not)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [base + at, wanted.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def last_to_arrive(counter_ptr, expected):
    """Whether this program is the last of ``expected`` to count itself in the int32 at
    counter_ptr: how a launch finds the program that sums the others' stored results (a split
    GEMV's partials, a token's pair products, a head's columns) without a launch of its own.
    Ordering: the barrier puts every thread's stores before the one thread's acq_rel atomic at
    GPU scope (a release that covers what the block's threads wrote); the last program's
    acquire then comes before its loads, which must read L2 (``cache_modifier=".cg"``), not a
    stale L1 line. The counter must be 0 before the launch, and the last program sets it back
    (``rearm``): counters (``kvslim.gpu.counters``) belong to one stream's launches."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == expected - 1


# Splits whose partials a last program loads at once, then adds in order (a decode GEMV or router
# has 1 to 8: ``quant_matmul.split_count``). Loaded and added one by one, each split was a round
# trip to L2 on the launch's tail.
SPLITS_AT_ONCE = tl.constexpr(8)


@triton.jit
def split_sums(ptr, stride, n_splits, mask, up, PAIR: tl.constexpr = False):
    """The last program's sums of the other programs' float32 partials: sum over s < n_splits
    of ptr[s * stride], in split order (``sum_splits``' order: the same bits whichever program
    sums), read from L2 (``last_to_arrive``); with PAIR, also of ptr[s * stride + up] (a SwiGLU
    pair's up half), in the same loads' wave. A split past the last adds 0.0, which leaves the
    bits as they were: a sum from +0.0 is never -0.0, and x + 0.0 = x for any other x."""
    total = tl.zeros(mask.shape, tl.float32)
    up_total = tl.zeros(mask.shape, tl.float32)
    for first in range(0, n_splits, SPLITS_AT_ONCE):
        for i in tl.static_range(SPLITS_AT_ONCE):       # (the interpreter makes a mask & a scalar int32: broadcast)
            ok = mask & (tl.zeros(mask.shape, tl.int32) + first + i < n_splits)
            total += tl.load(ptr + (first + i) * stride, mask=ok, other=0.0, cache_modifier=".cg")
            if PAIR:
                up_total += tl.load(ptr + (first + i) * stride + up, mask=ok, other=0.0, cache_modifier=".cg")
    return total, up_total


@triton.jit
def rearm(counter_ptr):
    """The last program's counter back to 0 for the next launch (``last_to_arrive``)."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def f16_at(ptr, mask):
    """Two little-endian bytes at ptr -> float32 (an f16 bit pattern), for any byte address."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f16_aligned(ptr, mask):
    """The f16 at an even byte address ptr -> float32: one 2-byte load, not two byte loads and a
    shift, and contiguous runs of them vectorise. The KV layouts' f16 fields are all at even
    offsets of rows of even size (``paged_prefill._fields`` refuses any other)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _float_values(row, d, mask, KIND: tl.constexpr):
    """Float rows: value d of each row. row (N, 1) byte pointers, d (1, BLOCK_D)."""
    if KIND == 1:                                                       # F16: typed before d is added,
        x = tl.load(row.to(tl.pointer_type(tl.float16)) + d, mask=mask, other=0.0).to(tl.float32)  # so d's run vectorises
    elif KIND == 2:                                                     # BF16: the high half of an f32
        lo = tl.load(row + 2 * d, mask=mask, other=0).to(tl.uint32)
        hi = tl.load(row + 2 * d + 1, mask=mask, other=0).to(tl.uint32)
        x = ((lo << 16) | (hi << 24)).to(tl.float32, bitcast=True)
    else:                                                               # F32
        p = row + 4 * d
        w = tl.load(p, mask=mask, other=0).to(tl.uint32)
        for b in tl.static_range(1, 4):
            w = w | (tl.load(p + b, mask=mask, other=0).to(tl.uint32) << (8 * b))
        x = w.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _block_code(q, j, mask, KIND: tl.constexpr, BITS: tl.constexpr, BLOCK_VALUES: tl.constexpr):
    """The code of value j of a block whose codes start at q (byte pointers, one per value)."""
    if KIND == 4:                                                       # NIBBLE: byte i = code i | code i+n/2 << 4
        byte = tl.load(q + j % (BLOCK_VALUES // 2), mask=mask, other=0).to(tl.int32)
        code = (byte >> (4 * (j // (BLOCK_VALUES // 2)))) & 0x0F
    elif 8 % BITS == 0:                                                 # PACKED 1/2/4/8-bit: never across a byte
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.load(q + j // per_byte, mask=mask, other=0).to(tl.int32)
        code = (byte >> (BITS * (j % per_byte))) & ((1 << BITS) - 1)
    else:                                                               # PACKED: 8 codes per BITS bytes, little-endian
        bit = BITS * (j % 8)
        first = (j // 8) * BITS + bit // 8
        last_of_word = (j // 8) * BITS + (BITS - 1)     # a code may run into the next byte, never past its word
        lo = tl.load(q + first, mask=mask, other=0).to(tl.int32)
        hi = tl.load(q + tl.minimum(first + 1, last_of_word), mask=mask, other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)
    return code


@triton.jit
def _pick(lut, code, AT: tl.constexpr, BITS: tl.constexpr):
    """lut[AT + (code mod 2^BITS)]: a binary tree of selects on code's bits, one select per entry
    (the table's entries are scalars, loaded once)."""
    if BITS == 0:
        x = tl.load(lut + AT) + tl.zeros(code.shape, tl.float32)
    else:
        HALF: tl.constexpr = 1 << (BITS - 1)
        top = (code & HALF) != 0
        x = tl.where(top, _pick(lut, code, AT + HALF, BITS - 1), _pick(lut, code, AT, BITS - 1))
    return x


@triton.jit
def _lookup(lut, code, BITS: tl.constexpr, LOOKUP: tl.constexpr):
    """lut[code] for a tile of codes of up to BITS bits, read as LOOKUP says (numbered as
    ``paged_prefill.GATHER, SELECT, TREE, MIRROR, AFFINE, TABLE``, chosen there per format from its
    table's values). GATHER: a load per value (it holds a
    64-bit address per value); SELECT: a compare and a select per table entry; TREE: a select per
    entry (``_pick``); MIRROR, for tables with lut[2^BITS - 1 - c] = -lut[c] (Lloyd-Max tables
    of symmetric distributions): the tree of the lower half, then the sign; AFFINE, for tables
    with lut[c] = lut[0] + c (lut[1] - lut[0]) exactly (q4_0's c - 8): a convert and an FMA;
    TABLE: the table loaded once as a tensor and gathered from (``tl.gather``: warp shuffles or
    shared memory, as the compiler lowers it), no 64-bit address per value."""
    if LOOKUP == 1 and BITS <= 4:
        x = tl.zeros(code.shape, tl.float32)
        for i in tl.static_range(1 << BITS):
            x = tl.where(code == i, tl.load(lut + i), x)
    elif LOOKUP == 2 and BITS <= 4:
        x = _pick(lut, code, 0, BITS)
    elif LOOKUP == 3 and BITS <= 4:
        LAST: tl.constexpr = (1 << BITS) - 1
        upper = code > (LAST >> 1)
        y = _pick(lut, tl.where(upper, LAST - code, code), 0, BITS - 1)
        x = tl.where(upper, -y, y)
    elif LOOKUP == 4:
        first = tl.load(lut)
        x = code.to(tl.float32) * (tl.load(lut + 1) - first) + first
    elif LOOKUP == 5:
        ENTRIES: tl.constexpr = 1 << BITS
        table = tl.load(lut + tl.arange(0, ENTRIES))
        if len(code.shape) == 2:                    # tl.gather takes a source of the index's rank
            src = tl.broadcast_to(table[None, :], (code.shape[0], ENTRIES))
            x = tl.gather(src, code, 1)
        else:
            src = tl.broadcast_to(table[None, None, :], (code.shape[0], code.shape[1], ENTRIES))
            x = tl.gather(src, code, 2)
    else:
        x = tl.load(lut + code)
    return x


@triton.jit
def columns(BLOCK_D: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, BLOCK_VALUES: tl.constexpr,
            BLOCK_BYTES: tl.constexpr, HEADER_BYTES: tl.constexpr, PHASES: tl.constexpr,
            ADJACENT: tl.constexpr = True):
    """The value each column of ``decode_tile``'s tile holds, (BLOCK_D,): column e itself, or with
    PHASES, code p of the row's group g of 2-byte units (one unit; three for 3-bit codes, 16 codes
    in 6 bytes) at column g * PHASES + p (ADJACENT: a group's codes side by side), else at
    p * W + g (W = BLOCK_D / PHASES: W columns apart)."""
    e = tl.arange(0, BLOCK_D)
    if PHASES > 1:
        GROUPS: tl.constexpr = (BLOCK_BYTES - HEADER_BYTES) * 8 // (BITS * PHASES)   # per block
        W: tl.constexpr = BLOCK_D // PHASES
        if ADJACENT:
            p = e % PHASES
            g = e // PHASES
        else:
            p = e // W
            g = e % W
        w = g % GROUPS
        if KIND == 4:                                                   # NIBBLE: unit w = bytes 2w, 2w + 1
            j = 2 * w + p // 2 + (BLOCK_VALUES // 2) * (p % 2)
        else:                                                           # PACKED: codes PHASES w + p
            j = PHASES * w + p
        e = (g // GROUPS) * BLOCK_VALUES + j
    return e


@triton.jit
def _cut_codes(u0, u1, u2, p, BITS: tl.constexpr):
    """Code p (1, PHASES, 1) of each group from its 2-byte units as ``fetch_units`` read them
    ((N, W) or (N, 1, W)) -> (N, PHASES, W) int32. A group is one unit (u0), or three for 3-bit
    codes: 16 codes in a little-endian 48-bit run, cut from two overlapping 32-bit words (units
    0-1 and 1-2), so no code crosses the word it is cut from."""
    if BITS == 3:                                                       # always (N, W) units
        low = (u0.to(tl.int32) | (u1.to(tl.int32) << 16))[:, None, :]     # bits 0-31: codes 0-9
        high = (u1.to(tl.int32) | (u2.to(tl.int32) << 16))[:, None, :]    # bits 16-47: codes 10-15
        code = tl.where(p < 10, low >> tl.minimum(3 * p, 27), high >> tl.maximum(3 * p - 16, 0)) & 7
    else:
        if len(u0.shape) == 2:
            u0 = u0[:, None, :]
        code = (u0.to(tl.int32) >> (BITS * p)) & ((1 << BITS) - 1)
    return code


@triton.jit
def fetch_units(row, valid, BLOCK_D: tl.constexpr, BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                HEADER_BYTES: tl.constexpr, OFFSET_AT: tl.constexpr, PHASES: tl.constexpr, HALF: tl.constexpr = False):
    """The loads of a tile of codes read in groups of 2-byte units (4-, 3-, 2- and 1-bit codes
    that fill their block's bytes), nothing computed from them, so that a caller may issue them
    a block of keys ahead of their use (PREFETCH 2). row (N, 1) byte pointers. Returns each
    group's units u0, u1, u2 ((N, W), three for 3-bit codes, else u0 three times; (N, 1, W) with
    HALF but for 3-bit codes), the block's f16 scale and its f16 offset (OFFSET_AT on; else the
    scale again), of the units' shape; a masked key's load as 0. Loaded (N, 1, W), the units and
    scales come in the layout the (N, PHASES, W) tile is cut in, where (N, W) loads were
    converted to it through shared memory. sm_90, decode's launch with f16 products: q4_0/q4_0
    642 -> 542 instructions a block and 128 -> 111 registers, q4_1/turbo3 649 -> 563, the others
    within 1%. Not for 3-bit codes (turbo3 492 -> 515) nor float32 products (q8_0/turbo4 80 ->
    94 registers, 3 -> 2 programs per SM)."""
    UNITS: tl.constexpr = BITS * PHASES // 16                           # 2-byte units per group
    GROUPS: tl.constexpr = (BLOCK_BYTES - HEADER_BYTES) // (2 * UNITS)   # groups per block
    W: tl.constexpr = BLOCK_D // PHASES
    if BITS == 3 or not HALF:
        g = tl.arange(0, W)[None, :]
        mask = valid[:, None] & (g < W)                                 # valid, broadcast to (N, W)
        block = row + (g // GROUPS) * BLOCK_BYTES
    else:                   # loaded in the (keys, phases, groups) tile's own layout: no conversion after
        g = tl.arange(0, W)[None, None, :]
        mask = valid[:, None, None] & (g < W)                           # (N, 1, W)
        block = row[:, :, None] + (g // GROUPS) * BLOCK_BYTES
    first = (block + HEADER_BYTES).to(tl.pointer_type(tl.uint16)) + UNITS * (g % GROUPS)
    u0 = tl.load(first, mask=mask, other=0)
    if BITS == 3:
        u1 = tl.load(first + 1, mask=mask, other=0)
        u2 = tl.load(first + 2, mask=mask, other=0)
    else:
        u1 = u0
        u2 = u0
    scale = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0)
    if OFFSET_AT > 0:
        offset = tl.load((block + OFFSET_AT).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0)
    else:
        offset = scale
    return u0, u1, u2, scale, offset


@triton.jit
def unit_values(u0, u1, u2, scale, offset, lut, BLOCK_D: tl.constexpr, BITS: tl.constexpr,
                OFFSET_AT: tl.constexpr, LOOKUP: tl.constexpr, PHASES: tl.constexpr, HALF: tl.constexpr = False,
                ADJACENT: tl.constexpr = True):
    """``fetch_units``'s loads -> the (N, BLOCK_D) tile, its columns in ``columns``'s order:
    PHASES codes cut from each group. A masked key's codes and scale loaded as 0, so its values
    are 0 with no select per value (turbo4/turbo4 609 -> 569 instructions a block).
    The codes are cut and looked up as (N, PHASES, W) (a TABLE's entries across a warp's lanes);
    ADJACENT, the default, then lays each group's codes side by side, (N, W, PHASES): a lane's
    values of one unit go to the products' shared-memory tile in one store, not PHASES stores of
    2 bytes (sm_90, Triton 3.6, decode's launch with f16 products: turbo4/turbo4 543 -> 503
    instructions a block of 16 keys at 8 warps, 1,597 -> 1,457 and 254 -> 187 registers at 2).
    HALF (the products take f16 operands): the codes' values (a TABLE's entries, or AFFINE's
    integer steps) and the scales multiplied in f16, the tile f16 (a table entry rounded to f16
    first, within the operands' own rounding; integer entries are exact, so q4_0 and iq4_nl keep
    the float32 product's bits).
    sm_90 SASS of decode's launch (Triton 3.6, 16 keys, 8 warps): turbo4/turbo4 569 -> 542
    instructions a block of keys and 168 -> 109 registers (two programs per SM, not one),
    q4_0/q4_0 707 -> 642 and 212 -> 128; the float32 values, products and conversions to f16
    kept float32 tiles live."""
    code = _cut_codes(u0, u1, u2, tl.arange(0, PHASES)[None, :, None], BITS)
    if len(scale.shape) == 2:                                           # (N, W) loads
        scale = scale[:, None, :]
        offset = offset[:, None, :]
    if HALF and OFFSET_AT == 0 and (LOOKUP == 4 or LOOKUP == 5):       # AFFINE or TABLE, in f16
        if LOOKUP == 4:                                                 # integer steps: exact in f16
            base = tl.load(lut).to(tl.float16)
            value = code.to(tl.float16) * (tl.load(lut + 1).to(tl.float16) - base) + base
        else:
            ENTRIES: tl.constexpr = 1 << BITS
            table = tl.load(lut + tl.arange(0, ENTRIES)).to(tl.float16)
            value = tl.gather(tl.broadcast_to(table[None, None, :], (code.shape[0], code.shape[1], ENTRIES)), code, 2)
        x = scale * value
    else:
        x = scale.to(tl.float32) * _lookup(lut, code, BITS, LOOKUP)
    if OFFSET_AT > 0:
        x = x + offset.to(tl.float32)
    if ADJACENT:
        x = tl.permute(x, (0, 2, 1))
    return tl.reshape(x, (x.shape[0], BLOCK_D))


@triton.jit
def _f16_rows(row, valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """f16 rows at row (N, 1) byte pointers as they lie, (N, BLOCK_D) f16; zeros where a key is
    not valid or past HEAD_DIM."""
    d = tl.arange(0, BLOCK_D)[None, :]
    return tl.load(row.to(tl.pointer_type(tl.float16)) + d, mask=valid[:, None] & (d < HEAD_DIM), other=0.0)


@triton.jit
def fetch_tile(pool, row_off, valid, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr,
               BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr, HEADER_BYTES: tl.constexpr, OFFSET_AT: tl.constexpr,
               PHASES: tl.constexpr = 1, HALF: tl.constexpr = False):
    """The raw loads of ``decode_tile``'s tile where they can be issued apart from the decoding
    (PREFETCH 2: a block of keys ahead): codes read in units (``fetch_units``), or f16 rows read
    as they lie (HALF); ``fetched_tile`` decodes them. Other layouts load nothing here (five
    placeholders) and ``fetched_tile`` reads them at use."""
    row = pool + row_off[:, None]
    if PHASES > 1:
        a, b, c, scale, offset = fetch_units(row, valid, BLOCK_D, BITS, BLOCK_BYTES, HEADER_BYTES, OFFSET_AT, PHASES,
                                             HALF)
    elif KIND == 1 and HALF:
        a = _f16_rows(row, valid, HEAD_DIM, BLOCK_D)
        b, c, scale, offset = a, a, a, a
    else:
        a, b, c, scale, offset = row_off, row_off, row_off, row_off, row_off
    return a, b, c, scale, offset


@triton.jit
def fetched_tile(a, b, c, scale, offset, pool, row_off, valid, lut, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, BLOCK_VALUES: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr, HEADER_BYTES: tl.constexpr, OFFSET_AT: tl.constexpr,
                 SUB_VALUES: tl.constexpr, SUB_BITS: tl.constexpr, LOOKUP: tl.constexpr,
                 PHASES: tl.constexpr = 1, HALF: tl.constexpr = False, ADJACENT: tl.constexpr = True):
    """``fetch_tile``'s loads (a, b, c, scale, offset) -> ``decode_tile``'s tile of the rows at
    row_off; layouts ``fetch_tile`` does not read are read and decoded here."""
    if PHASES > 1:
        x = unit_values(a, b, c, scale, offset, lut, BLOCK_D, BITS, OFFSET_AT, LOOKUP, PHASES, HALF, ADJACENT)
    elif KIND == 1 and HALF:
        x = a
    else:
        x = decode_tile(pool, row_off, valid, lut, HEAD_DIM, BLOCK_D, KIND, BITS, BLOCK_VALUES, BLOCK_BYTES,
                        HEADER_BYTES, OFFSET_AT, SUB_VALUES, SUB_BITS, LOOKUP, PHASES, HALF, ADJACENT)
    return x


@triton.jit
def decode_tile(pool, row_off, valid, lut, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, BLOCK_VALUES: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr, HEADER_BYTES: tl.constexpr, OFFSET_AT: tl.constexpr,
                 SUB_VALUES: tl.constexpr, SUB_BITS: tl.constexpr, LOOKUP: tl.constexpr,
                 PHASES: tl.constexpr = 1, HALF: tl.constexpr = False, ADJACENT: tl.constexpr = True):
    """Rows at byte offsets row_off (N,) of pool -> (N, BLOCK_D) float32 in the code domain (f16
    with HALF, the products' f16 operands: f16 rows, q8_0's bytes, the units' tables and steps);
    zeros where a key is not valid or past HEAD_DIM (so a masked key adds 0 * 0, never NaN).
    ``lut``: the 32 code values, then the ladder's rungs (LADDER_AT on).
    NIBBLE with BITS 5 (ggml q5_x): a u32 of each code's bit 4 precedes the nibbles; OFFSET_AT
    > 0 (q4_1, q5_1): the f16 at that byte of the block is added to every value; SUB_VALUES > 0
    (the nls rows): after the f16 scale, a SUB_BITS-bit rung per SUB_VALUES values, and a value's
    scale is (scale * ladder[rung]). LOOKUP: how the code table is read (``_lookup``)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = valid[:, None] & (d < HEAD_DIM)
    row = pool + row_off[:, None]                                       # (N, 1) pointers
    if PHASES > 1:
        u0, u1, u2, scale, offset = fetch_units(row, valid, BLOCK_D, BITS, BLOCK_BYTES, HEADER_BYTES, OFFSET_AT, PHASES,
                                                HALF)
        x = unit_values(u0, u1, u2, scale, offset, lut, BLOCK_D, BITS, OFFSET_AT, LOOKUP, PHASES, HALF, ADJACENT)
    elif KIND == 1 and HALF:        # f16 rows as they lie: no float32 round trip (f16/f16 decode 310 -> 246 a block)
        x = _f16_rows(row, valid, HEAD_DIM, BLOCK_D)
    elif KIND <= 2:
        x = _float_values(row, d, mask, KIND)
    else:                                                               # [f16 scale][codes] blocks
        block = row + (d // BLOCK_VALUES) * BLOCK_BYTES
        j = d % BLOCK_VALUES
        scale = f16_aligned(block, mask)
        if SUB_VALUES > 0:                                              # rungs never straddle a byte (2-bit)
            bit = SUB_BITS * (j // SUB_VALUES)
            rungs = tl.load(block + 2 + bit // 8, mask=mask, other=0).to(tl.int32)
            rung = (rungs >> (bit % 8)) & ((1 << SUB_BITS) - 1)
            scale = scale * tl.load(lut + LADDER_AT + rung, mask=mask, other=0.0)
        if KIND == 3:                                                   # Q8: int8 codes
            code = tl.load(block + HEADER_BYTES + j, mask=mask, other=0).to(tl.int8, bitcast=True)
            if HALF:            # f16 scale times an 8-bit code: the one rounding the float32 product gets at the dot
                x = tl.load(block.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0) * code.to(tl.float16)
            else:
                x = scale * code.to(tl.float32)
        elif KIND == 4 and BITS == 5:                                   # q5_x: [qh u32][nibbles]
            code = _block_code(block + HEADER_BYTES + 4, j, mask, KIND, 4, BLOCK_VALUES)
            high = tl.load(block + HEADER_BYTES + j // 8, mask=mask, other=0).to(tl.int32)
            x = scale * tl.load(lut + (code | (((high >> (j % 8)) & 1) << 4)), mask=mask, other=0.0)
        else:
            code = _block_code(block + HEADER_BYTES, j, mask, KIND, BITS, BLOCK_VALUES)
            x = scale * _lookup(lut, code, BITS, LOOKUP)
        if OFFSET_AT > 0:                                               # q4_1, q5_1: the block minimum
            x = x + f16_aligned(block + OFFSET_AT, mask)
        # masked loads already give 0, but without the select q8_0's f16 launch took 210 registers, not 127
        x = tl.where(mask, x, 0.0)
    return x


@triton.jit
def pool_rows(table_at, t, end, PAGE_SIZE: tl.constexpr, WIDE: tl.constexpr):
    """Key positions t (any shape) -> their rows within a head's pool, through the sequence's
    block-table row at ``table_at`` (0 past ``end``: never read, masked). Both attention kernels'."""
    page = tl.load(table_at + t // PAGE_SIZE, mask=t < end, other=0)
    slot = page * PAGE_SIZE + t % PAGE_SIZE
    if WIDE:
        slot = slot.to(tl.int64)
    return slot


@triton.jit
def gated(out, gate_at, live, GATED: tl.constexpr):
    """out (float32) times sigmoid of the gate at gate_at where GATED: ``swiglu.sigmoid_mul``'s
    math (its sigmoid, the product in float32), so the fold gives that launch's bits."""
    if GATED:
        out = sigmoid(tl.load(gate_at, mask=live, other=0.0).to(tl.float32)) * out
    return out


@triton.jit
def sequence_pages(lengths_ptr, slots_ptr, table_ptr, k_pool, v_pool, h, s, length_offset, table_stride, n_pages,
                   k_row_bytes, v_row_bytes, PAGE_SIZE: tl.constexpr, BY_SLOT: tl.constexpr):
    """Where a (KV head h, sequence s) program's keys are, for both attention kernels: the
    sequence's length (lengths[s] + length_offset), its block-table row (row slots[s] of the
    cache's table with BY_SLOT, else row s) and the head's K and V pools. Row offsets go in 32
    bits from each head's 64-bit base (fewer registers), unless a head's pool reaches 2 GB (the
    kernels' WIDE, set by the launcher)."""
    length = tl.load(lengths_ptr + s).to(tl.int32) + length_offset
    if BY_SLOT:
        table_row = tl.load(slots_ptr + s).to(tl.int64)
    else:
        table_row = s.to(tl.int64)
    k_head = k_pool + h.to(tl.int64) * n_pages * PAGE_SIZE * k_row_bytes
    v_head = v_pool + h.to(tl.int64) * n_pages * PAGE_SIZE * v_row_bytes
    return length, table_ptr + table_row * table_stride, k_head, v_head
