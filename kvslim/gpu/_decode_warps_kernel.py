"""The Triton kernel of decode attention by warps (``paged_prefill.attend`` with KERNEL "warps";
imported only when it runs).

One program per (KV head, sequence, split of keys), as the tile kernel's decode launch, but
each warp walks its own keys: key t of a step goes to warp t mod NW, KP keys a warp a step, and
a warp keeps its own online softmax (running max, denominator and sum of every query row) until
the program's end, where the warps' states merge once. A key's row is spread over the 32 lanes
of its warp, a 2-byte unit (PH codes) a lane, B2 units a lane; the query rows (up to 8, the GQA
group) sit in every lane's registers beside their sums. So a score is each lane's products
summed in its registers and then across its warp (5 shuffles a row), and nothing in the loop
crosses warps: no shared memory and no barrier a step. The tile kernel decodes a block of keys
into a tile that its tensor-core products read from shared memory, behind barriers, every block
(sm_90 SASS: 15-17 barriers a block); session 41's H200 timed it 4.6-6.8x slower than f16 SDPA
at 128K on turbo4. This is what llama.cpp's vector kernel and vLLM's paged attention do for a
few query rows: products on CUDA cores, no tile to share.

Every tensor's axes end (..., KP, NW, 32, PH): a lane's PH codes of a unit are its own (they are
q's contiguous values too), the lanes hold a row's units and the warps its keys (the other axes
are registers). Triton's language cannot pin a layout, so the loads are shaped for the one its
coalescing picks (``_load``) and the loop-carried state starts in the layouts the step computes
it in; q is loaded per warp (NW copies, once), so that its layout has the warps where the keys
have them. docs/gpu.md has the SASS this gives under Triton 3.6 and 3.9.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import after_previous, gated, pool_rows, sequence_pages, stored_as


@triton.jit
def _units(KIND: tl.constexpr, BITS: tl.constexpr, PH: tl.constexpr, B2: tl.constexpr, VALUES: tl.constexpr,
           BYTES: tl.constexpr, HEADER: tl.constexpr):
    """Where a lane's units lie and which dimension each code is: (the row's 2-byte unit at which
    each unit lies (B2, 1, 1, 32), the one its block starts at (B2, 1, 1, 32), the dimension of
    code p of each unit (B2, 1, 1, 32, PH)). f16 rows are units of one value, lane * B2 + b (a
    lane's values side by side, q's too: else q's load took them 4 lanes a thread, and the step
    shuffled 200 times); else unit u = b * 32 + lane, in block u // GROUPS, unit u % GROUPS of it
    past the block's header, its codes at value j: packed codes PH w + p, nibbles 2w + p // 2
    (+ half a block for the high nibble), bytes 2w + p. 3-bit codes come 16 to a group of 3
    units, half a group a lane: lane u holds codes 8h .. 8h + 7 (h = u % 2) of group u // 2, from
    its units h and h + 1 (``at`` is the first; the codes cross the units' boundary).
    In 2-byte units, not bytes, so that the compiler sees a lane's units follow one another (a
    byte offset cast to a 2-byte pointer hides it: under Triton 3.6 the loads' layout then put
    lanes across keys and the step needed shared memory and 33 barriers)."""
    p = tl.arange(0, PH)[None, None, None, None, :]
    if KIND == 1 or KIND == 2:      # F16, BF16: a unit is a value, a lane's B2 values side by side
        at = tl.arange(0, 32)[None, None, None, :] * B2 + tl.arange(0, B2)[:, None, None, None]
        block = at
        dim = at[:, :, :, :, None] + 0 * p
    elif BITS == 3:                 # half a group of 16 codes (3 units) a lane
        u = tl.arange(0, B2)[:, None, None, None] * 32 + tl.arange(0, 32)[None, None, None, :]
        GROUPS: tl.constexpr = (BYTES - HEADER) // 6
        g = u // 2
        h = u % 2
        block = (g // GROUPS) * (BYTES // 2)
        at = block + HEADER // 2 + 3 * (g % GROUPS) + h
        dim = ((g // GROUPS) * VALUES + 16 * (g % GROUPS) + 8 * h)[:, :, :, :, None] + p
    else:
        u = tl.arange(0, B2)[:, None, None, None] * 32 + tl.arange(0, 32)[None, None, None, :]
        GROUPS: tl.constexpr = (BYTES - HEADER) // 2
        w = u % GROUPS
        block = (u // GROUPS) * (BYTES // 2)
        at = block + HEADER // 2 + w
        w5 = w[:, :, :, :, None]
        if KIND == 4:                                                   # NIBBLE
            j = 2 * w5 + p // 2 + (VALUES // 2) * (p % 2)
        elif KIND == 3:                                                 # Q8: two bytes a unit
            j = 2 * w5 + p
        else:                                                           # PACKED
            j = PH * w5 + p
        dim = (u // GROUPS)[:, :, :, :, None] * VALUES + j
    return at, block, dim


@triton.jit
def _load(ptr, mask, other, TIES_UP: tl.constexpr):
    """tl.load of (B2, KP, NW, 32) pointers in the layout this kernel needs: lanes over the last
    axis, warps over NW. Triton's coalescing orders a load's axes by how contiguous its addresses
    are, and axes alike (a scale's) one way under Triton 3.6 (the first first: TIES_UP) and the
    other under 3.9; loaded as (32, NW, KP, B2) under 3.6, then put back (a relabelling, no data
    moved), both get lanes and warps where the step's sums want them. With one layout, the
    loads' (lanes across keys under 3.6) were converted through shared memory every step."""
    if TIES_UP:
        x = tl.permute(tl.load(tl.permute(ptr, (3, 2, 1, 0)), mask=tl.permute(mask, (3, 2, 1, 0)), other=other),
                       (3, 2, 1, 0))
    else:
        x = tl.load(ptr, mask=mask, other=other)
    return x


@triton.jit
def _gather(ptr, TIES_UP: tl.constexpr):
    """tl.load of (B2, KP, NW, 32, PH) pointers whose addresses are alike on every axis (a code
    table's entries), loaded as ``_load`` loads, PH kept a lane's own: else the load's layout
    spread lanes over PH and the values were converted through shared memory every step."""
    if TIES_UP:
        x = tl.permute(tl.load(tl.permute(ptr, (3, 2, 1, 0, 4))), (3, 2, 1, 0, 4))
    else:
        x = tl.permute(tl.load(tl.permute(ptr, (4, 0, 1, 2, 3))), (1, 2, 3, 4, 0))
    return x


@triton.jit
def _fetch(row, valid, KIND: tl.constexpr, BITS: tl.constexpr, PH: tl.constexpr, B2: tl.constexpr,
           VALUES: tl.constexpr, BYTES: tl.constexpr, HEADER: tl.constexpr, OFFSET_AT: tl.constexpr,
           TIES_UP: tl.constexpr):
    """The loads of a step's keys' rows, nothing computed from them (so that they may be issued a
    step ahead: PREFETCH): from the rows' 2-byte pointers row (1, KP, NW, 1), each lane's units
    (the next unit too for 3-bit codes), their blocks' f16 scales and offsets (B2, KP, NW, 32;
    the unit again where a format has none); a masked key's as 0. 2-byte loads."""
    at, block, _ = _units(KIND, BITS, PH, B2, VALUES, BYTES, HEADER)
    mask = valid[None, :, :, None] & (at >= 0)                          # (B2, KP, NW, 32)
    unit = _load(row + at, mask, 0, TIES_UP)
    unit2 = unit
    if BITS == 3:
        unit2 = _load(row + at + 1, mask, 0, TIES_UP)
    scale = unit
    offset = unit
    if KIND != 1 and KIND != 2:
        scale = _load((row + block).to(tl.pointer_type(tl.float16)), mask, 0.0, TIES_UP)
        offset = scale
        if OFFSET_AT > 0:
            offset = _load((row + block + OFFSET_AT // 2).to(tl.pointer_type(tl.float16)), mask, 0.0, TIES_UP)
    return unit, unit2, scale, offset


@triton.jit
def _decoded(unit, unit2, scale, offset, lut, KIND: tl.constexpr, BITS: tl.constexpr, PH: tl.constexpr,
             OFFSET_AT: tl.constexpr, LOOKUP: tl.constexpr, TIES_UP: tl.constexpr):
    """``_fetch``'s loads -> the keys' values (B2, KP, NW, 32, PH) float32. Tables are read by a
    load a value (the table is 64 bytes: one L1 line for a warp), integer steps (q4_0's c - 8)
    by arithmetic."""
    if KIND == 1:
        x = unit.to(tl.float16, bitcast=True).to(tl.float32)[:, :, :, :, None]
    elif KIND == 2:
        x = unit.to(tl.bfloat16, bitcast=True).to(tl.float32)[:, :, :, :, None]
    else:
        p = tl.arange(0, PH)[None, None, None, None, :]
        if BITS == 3:               # codes 8h + p at bit 8h + 3p of units h, h + 1 (_units)
            word = unit.to(tl.int32) | (unit2.to(tl.int32) << 16)
            h = (tl.arange(0, 32) % 2)[None, None, None, :, None]
            code = (word[:, :, :, :, None] >> (8 * h + 3 * p)) & 7
        else:
            code = (unit.to(tl.int32)[:, :, :, :, None] >> (BITS * p)) & ((1 << BITS) - 1)
        if KIND == 3:                                                   # signed bytes
            x = ((code ^ 128) - 128).to(tl.float32)
        elif LOOKUP == 4:                                               # AFFINE: lut[0] + c (lut[1] - lut[0])
            first = tl.load(lut)
            x = code.to(tl.float32) * (tl.load(lut + 1) - first) + first
        else:
            x = _gather(lut + code, TIES_UP)
        x = scale.to(tl.float32)[:, :, :, :, None] * x
        if OFFSET_AT > 0:
            x = x + offset.to(tl.float32)[:, :, :, :, None]
    return x


@triton.jit
def _weighted_into(acc, p, v, KP: tl.constexpr):
    """acc (BLOCK_M, B2, PH, NW, 32) plus the step's values v (B2, PH, KP, NW, 32) weighted by
    p (BLOCK_M, KP, NW). Two keys a warp: one FMA into acc a key, the keys split apart (a sum
    over the keys' axis first took a multiply, an FMA and an add: 64 more instructions a step)."""
    if KP == 2:
        v0, v1 = tl.split(tl.permute(v, (0, 1, 3, 4, 2)))               # (B2, PH, NW, 32) each
        p0, p1 = tl.split(tl.permute(p, (0, 2, 1)))                     # (BLOCK_M, NW) each
        x = acc + p0[:, None, None, :, None] * v0[None]
        x = x + p1[:, None, None, :, None] * v1[None]
    else:
        x = acc + tl.sum(p[:, None, None, :, :, None] * v[None], axis=3)
    return x


@triton.jit
def paged_decode_warps(q_ptr, q_pos_ptr, k_pool, v_pool, table_ptr, lengths_ptr, k_lut, v_lut,
                       m_out, l_out, acc_out,
                       n_seq, n_rows, n_pages, k_row_bytes, v_row_bytes, table_stride,
                       n_splits, split_keys,
                       q_heads, q_seqs, q_rows, q_scale, slots_ptr, length_offset, o_heads, o_seqs, o_rows,
                       gate_ptr, g_heads, g_seqs, g_rows,
                       HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                       KP: tl.constexpr, NW: tl.constexpr, WIDE: tl.constexpr,
                       K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_VALUES: tl.constexpr,
                       K_BYTES: tl.constexpr, K_HEADER: tl.constexpr, K_OFFSET: tl.constexpr,
                       K_LOOKUP: tl.constexpr, K_PH: tl.constexpr, K_B2: tl.constexpr,
                       V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_VALUES: tl.constexpr,
                       V_BYTES: tl.constexpr, V_HEADER: tl.constexpr, V_OFFSET: tl.constexpr,
                       V_LOOKUP: tl.constexpr, V_PH: tl.constexpr, V_B2: tl.constexpr,
                       BY_SLOT: tl.constexpr = False, NORMALISE: tl.constexpr = False, GATED: tl.constexpr = False,
                       TIES_UP: tl.constexpr = False, RESCALE_AT: tl.constexpr = 8.0, PREFETCH: tl.constexpr = 0,
                       PDL: tl.constexpr = False):
    """``paged_prefill_tile``'s decode launch (AT_END: every row at its sequence's last key, q_pos
    unread) with the same arguments and outputs: the state of rows 0..n_rows-1 (at most BLOCK_M)
    of (KV head, sequence) over the keys of one split, or with NORMALISE (one split) the output.
    RESCALE_AT: with one warp, the sums are rescaled when a row's max grows by more than this.
    PREFETCH 1: each step's rows loaded a step ahead of their decoding, their table entries two
    (a warp then has two steps' loads in flight, not one; they wait on memory, not on issue)."""
    after_previous(PDL)
    h = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    head_seq = h.to(tl.int64) * n_seq + s
    length, table_at, k_head, v_head = sequence_pages(lengths_ptr, slots_ptr, table_ptr, k_pool, v_pool, h, s,
                                                      length_offset, table_stride, n_pages, k_row_bytes,
                                                      v_row_bytes, PAGE_SIZE, BY_SLOT)

    # q (BLOCK_M, K_B2, 1, NW, 32, K_PH) in K's unit order, one copy a warp
    r6 = tl.arange(0, BLOCK_M)[:, None, None, None, None, None]
    _, _, d_k = _units(K_KIND, K_BITS, K_PH, K_B2, K_VALUES, K_BYTES, K_HEADER)
    warp = tl.arange(0, NW)[None, None, None, :, None, None]
    q_at = q_ptr + h.to(tl.int64) * q_heads + s.to(tl.int64) * q_seqs
    q_ptrs = q_at + r6 * q_rows + d_k[None] + 0 * warp
    q_mask = (r6 < n_rows) & (d_k[None] + 0 * warp >= 0)                 # full shape, for the permute
    if TIES_UP:             # loaded as (32, NW, ..., PH), as ``_load`` says, then put back
        q = tl.permute(tl.load(tl.permute(q_ptrs, (4, 3, 0, 1, 2, 5)), mask=tl.permute(q_mask, (4, 3, 0, 1, 2, 5)),
                               other=0.0), (2, 3, 4, 1, 0, 5))
    else:                   # as (PH, ..., NW, 32): nibbles' PH codes are not contiguous dimensions
        q = tl.permute(tl.load(tl.permute(q_ptrs, (5, 0, 1, 2, 3, 4)), mask=tl.permute(q_mask, (5, 0, 1, 2, 3, 4)),
                               other=0.0), (1, 2, 3, 4, 5, 0))
    q = q.to(tl.float32) * q_scale

    begin = split * split_keys
    end = tl.minimum(begin + split_keys, length)
    # The loop-carried state in the layouts the step computes it in: a row's max and denominator
    # (BLOCK_M, NW) as reduced from q's products (tl.full's own layout put lanes across NW and
    # the rows, and every step converted through shared memory), the sums (BLOCK_M, V_B2, V_PH,
    # NW, 32) with the lanes' axis last, where tl.zeros puts lanes.
    l_i = tl.max(tl.sum(tl.sum(tl.sum(q * 0.0, axis=5), axis=1), axis=3), axis=1)     # zeros (BLOCK_M, NW)
    m_i = l_i + float("-inf")
    m_top = m_i
    acc = tl.zeros([BLOCK_M, V_B2, V_PH, NW, 32], tl.float32)
    k_rows = k_head.to(tl.pointer_type(tl.uint16))       # rows hold whole 2-byte units
    v_rows = v_head.to(tl.pointer_type(tl.uint16))
    STEP: tl.constexpr = KP * NW
    keys = tl.arange(0, KP)[:, None] * NW + tl.arange(0, NW)[None, :]   # (KP, NW): key t of a step to warp t mod NW
    if PREFETCH:            # the first step's rows, and the second's table entries
        slot = pool_rows(table_at, begin + keys, end, PAGE_SIZE, WIDE)
        ku, ku2, ks, ko = _fetch(k_rows + (slot * (k_row_bytes // 2))[None, :, :, None], begin + keys < end, K_KIND,
                                 K_BITS, K_PH, K_B2, K_VALUES, K_BYTES, K_HEADER, K_OFFSET, TIES_UP)
        vu, vu2, vs, vo = _fetch(v_rows + (slot * (v_row_bytes // 2))[None, :, :, None], begin + keys < end, V_KIND,
                                 V_BITS, V_PH, V_B2, V_VALUES, V_BYTES, V_HEADER, V_OFFSET, TIES_UP)
        slot = pool_rows(table_at, begin + STEP + keys, end, PAGE_SIZE, WIDE)
    for start in range(begin, end, STEP):
        t = start + keys
        valid = t < end
        if PREFETCH:        # this step's rows came a step ago; the next step's loads go out now
            k = (ku, ku2, ks, ko)
            v = (vu, vu2, vs, vo)
            ku, ku2, ks, ko = _fetch(k_rows + (slot * (k_row_bytes // 2))[None, :, :, None], t + STEP < end,
                                     K_KIND, K_BITS, K_PH, K_B2, K_VALUES, K_BYTES, K_HEADER, K_OFFSET, TIES_UP)
            vu, vu2, vs, vo = _fetch(v_rows + (slot * (v_row_bytes // 2))[None, :, :, None], t + STEP < end,
                                     V_KIND, V_BITS, V_PH, V_B2, V_VALUES, V_BYTES, V_HEADER, V_OFFSET, TIES_UP)
            slot = pool_rows(table_at, t + 2 * STEP, end, PAGE_SIZE, WIDE)
        else:
            slot = pool_rows(table_at, t, end, PAGE_SIZE, WIDE)
            k = _fetch(k_rows + (slot * (k_row_bytes // 2))[None, :, :, None], valid, K_KIND, K_BITS, K_PH, K_B2,
                       K_VALUES, K_BYTES, K_HEADER, K_OFFSET, TIES_UP)
            v = _fetch(v_rows + (slot * (v_row_bytes // 2))[None, :, :, None], valid, V_KIND, V_BITS, V_PH, V_B2,
                       V_VALUES, V_BYTES, V_HEADER, V_OFFSET, TIES_UP)
        k = _decoded(k[0], k[1], k[2], k[3], k_lut, K_KIND, K_BITS, K_PH, K_OFFSET, K_LOOKUP, TIES_UP)
        v = tl.permute(_decoded(v[0], v[1], v[2], v[3], v_lut, V_KIND, V_BITS, V_PH, V_OFFSET, V_LOOKUP, TIES_UP),
                       (0, 4, 1, 2, 3))                                 # (V_B2, V_PH, KP, NW, 32), as acc
        # a lane's products summed in its registers first (codes, then units), then across lanes:
        # 5 shuffles a row and key (summing the lanes first took 8x as many)
        scores = tl.sum(tl.sum(tl.sum(q * k[None], axis=5), axis=1), axis=3)            # (BLOCK_M, KP, NW)
        scores = tl.where(valid[None], scores, float("-inf"))
        top = tl.max(scores, axis=1)                                    # (BLOCK_M, NW)
        if NW == 1:
            # One warp: a branch on its rows' scores is uniform, so the sums are rescaled only when
            # a row's max grows past the one they are taken at by RESCALE_AT (their terms then reach
            # e^8 at most, far inside float32), not at every key: 64 multiplies a key and lane saved.
            # The first step's first key is valid (start = begin < end): m_i is finite from there on.
            m_top = tl.maximum(m_top, top)
            if tl.max(tl.max(top - m_i, axis=1), axis=0) > RESCALE_AT:
                m_new = tl.maximum(m_i, top)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None, None, :, None]
                m_i = m_new
            p = tl.exp(scores - m_i[:, None, :])
            l_i = l_i + tl.sum(p, axis=1)
            acc = _weighted_into(acc, p, v, KP)
        else:
            m_new = tl.maximum(m_i, top)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key yet: weights 0, not NaN
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None, :])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = _weighted_into(acc * alpha[:, None, None, :, None], p, v, KP)
            m_i = m_new
    if NW == 1:             # the state at the rows' true max, as the other launches leave it
        fix = tl.exp(m_i - tl.where(m_top == float("-inf"), 0.0, m_top))
        l_i = l_i * fix
        acc = acc * fix[:, None, None, :, None]
        m_i = m_top

    # the warps' states merged, once
    m_all = tl.max(m_i, axis=1)                                         # (BLOCK_M,)
    weight = tl.exp(m_i - tl.where(m_all == float("-inf"), 0.0, m_all)[:, None])
    l_all = tl.sum(l_i * weight, axis=1)
    out = tl.sum(acc * weight[:, None, None, :, None], axis=3)         # (BLOCK_M, V_B2, V_PH, 32)
    r = tl.arange(0, BLOCK_M)
    r4 = r[:, None, None, None]
    _, _, d_v = _units(V_KIND, V_BITS, V_PH, V_B2, V_VALUES, V_BYTES, V_HEADER)
    d = tl.permute(tl.reshape(d_v, (V_B2, 32, V_PH)), (0, 2, 1))[None]   # (1, V_B2, V_PH, 32)
    live = (r4 < n_rows) & (d < HEAD_DIM)
    if NORMALISE:                                                       # the output itself, where the caller wants it
        o_at = acc_out + h.to(tl.int64) * o_heads + s.to(tl.int64) * o_seqs
        g_at = gate_ptr + h.to(tl.int64) * g_heads + s.to(tl.int64) * g_seqs
        out = gated(out / l_all[:, None, None, None], g_at + r4 * g_rows + d, live, GATED)
        tl.store(o_at + r4 * o_rows + d, stored_as(out, acc_out), mask=live)
    else:
        part = (head_seq * n_splits + split) * n_rows + r              # (BLOCK_M,) rows of this split
        tl.store(m_out + part, m_all, mask=r < n_rows)
        tl.store(l_out + part, l_all, mask=r < n_rows)
        tl.store(acc_out + part[:, None, None, None] * HEAD_DIM + d, out, mask=live)


@triton.jit
def _tie_probe(src, dst):
    """A load whose two axes are equally (not) contiguous: the axis its layout gives lanes first
    says how this Triton's coalescing orders ties (``first_axis_first``)."""
    at = tl.arange(0, 32)[:, None] * 1024 + tl.arange(0, 32)[None, :] * 32768
    tl.store(dst + at, tl.load(src + at))


def first_axis_first() -> bool:
    """Whether this Triton's coalescing gives lanes to the first of a load's equally contiguous
    axes (Triton 3.6: TIES_UP) or the last (3.9), read from the layout it gives ``_tie_probe``
    (compiled for sm_90, no GPU needed). ImportError where it cannot compile (no CUDA backend,
    or this module interpreted)."""
    import re

    from . import compile_sm90
    if INTERPRETED:
        raise ImportError("interpreted kernels are not compiled")
    ttgir = compile_sm90(_tie_probe, {"src": "*fp32", "dst": "*fp32"}, {}, num_warps=1).asm["ttgir"]
    lanes = re.search(r"threadsPerWarp = \[(\d+), (\d+)\]", ttgir)
    return int(lanes.group(1)) > int(lanes.group(2))


INTERPRETED = not isinstance(paged_decode_warps, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
