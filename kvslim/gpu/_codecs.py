"""Packed-row decoding shared by the Triton attention kernels (decode and prefill).

Each format's row layout reaches these functions as constexprs read from ``codec_fields``
(``kvslim/native/paged_attention.py``, the C kernel's description of each format); nothing
here restates a format. Imported only when a kernel runs: importing kvslim needs no triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

# The codec kinds, as kvslim/native/paged_attention.py numbers them.
F32, F16, BF16, Q8, NIBBLE, PACKED = range(6)
LADDER_AT = tl.constexpr(32)        # where the rungs' factors follow the code values in ``lut``


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
def _lookup(lut, code, BITS: tl.constexpr, SELECT: tl.constexpr):
    """lut[code] for a tile of codes: with SELECT and up to 4 bits, a select per table entry (the
    entries loaded as scalars), else a gather, which holds a 64-bit address per value (the
    launcher picks per side: ``paged_prefill._codec_args``)."""
    if SELECT and BITS <= 4:
        x = tl.zeros(code.shape, tl.float32)
        for i in tl.static_range(1 << BITS):
            x = tl.where(code == i, tl.load(lut + i), x)
    else:
        x = tl.load(lut + code)
    return x


@triton.jit
def decode_tile(pool, row_off, valid, lut, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, BLOCK_VALUES: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr, HEADER_BYTES: tl.constexpr, OFFSET_AT: tl.constexpr,
                 SUB_VALUES: tl.constexpr, SUB_BITS: tl.constexpr, SELECT: tl.constexpr):
    """Rows at byte offsets row_off (N,) of pool -> (N, BLOCK_D) float32 in the code domain;
    zeros where a key is not valid or past HEAD_DIM (so a masked key adds 0 * 0, never NaN).
    ``lut``: the 32 code values, then the ladder's rungs (LADDER_AT on).
    NIBBLE with BITS 5 (ggml q5_x): a u32 of each code's bit 4 precedes the nibbles; OFFSET_AT
    > 0 (q4_1, q5_1): the f16 at that byte of the block is added to every value; SUB_VALUES > 0
    (the nls rows): after the f16 scale, a SUB_BITS-bit rung per SUB_VALUES values, and a value's
    scale is (scale * ladder[rung]). SELECT: how the code table is read (``_lookup``)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = valid[:, None] & (d < HEAD_DIM)
    row = pool + row_off[:, None]                                       # (N, 1) pointers
    if KIND <= 2:
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
            x = scale * code.to(tl.float32)
        elif KIND == 4 and BITS == 5:                                   # q5_x: [qh u32][nibbles]
            code = _block_code(block + HEADER_BYTES + 4, j, mask, KIND, 4, BLOCK_VALUES)
            high = tl.load(block + HEADER_BYTES + j // 8, mask=mask, other=0).to(tl.int32)
            x = scale * tl.load(lut + (code | (((high >> (j % 8)) & 1) << 4)), mask=mask, other=0.0)
        else:
            code = _block_code(block + HEADER_BYTES, j, mask, KIND, BITS, BLOCK_VALUES)
            x = scale * _lookup(lut, code, BITS, SELECT)
        if OFFSET_AT > 0:                                               # q4_1, q5_1: the block minimum
            x = x + f16_aligned(block + OFFSET_AT, mask)
    return tl.where(mask, x, 0.0)
