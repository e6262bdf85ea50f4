"""The Triton kernel of ``paged_prefill`` (imported only when it runs: importing kvslim needs no triton).

One program per (KV head, sequence, tile of BLOCK_M query rows, split of keys). It walks the
keys its tile can see BLOCK_N at a time through the block table, decodes the packed K/V rows
in registers (``_codecs.decode_tile``; 4-, 2- and 1-bit codes come two bytes a load, the tile's
columns then permuted as ``_codecs.columns`` says, so q is read in K's column order and the sum
stored from V's), scores the tile's rows against
one read of each key, masks each row at its own causal limit, and keeps an online softmax.
The rows of a tile may be any query positions (the GQA heads' rows g*T + t share a tile); the
tile reads keys up to the largest of its positions, and each row masks the rest.

Triton decides at decoration time whether a kernel is interpreted (TRITON_INTERPRET=1, numpy on
the CPU) or compiled; ``INTERPRETED`` records which this module's kernels are, ``RUNNABLE``
whether triton.language's own functions (decorated when triton was imported) agree.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import (after_previous, columns, decode_tile, fetch_tile, fetched_tile, gated, pool_rows,
                      sequence_pages, stored_as)


@triton.jit
def paged_prefill_tile(q_ptr, q_pos_ptr, k_pool, v_pool, table_ptr, lengths_ptr, k_lut, v_lut,
                       m_out, l_out, acc_out,
                       n_seq, n_rows, n_pages, k_row_bytes, v_row_bytes, table_stride,
                       n_splits, split_keys,
                       q_heads, q_seqs, q_rows, q_scale, slots_ptr, length_offset, o_heads, o_seqs, o_rows,
                       gate_ptr, g_heads, g_seqs, g_rows,
                       HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT: tl.constexpr, WIDE: tl.constexpr,
                       K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_VALUES: tl.constexpr,
                       K_BYTES: tl.constexpr, K_HEADER: tl.constexpr, K_OFFSET: tl.constexpr,
                       K_SUB: tl.constexpr, K_SUB_BITS: tl.constexpr, K_LOOKUP: tl.constexpr,
                       V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_VALUES: tl.constexpr,
                       V_BYTES: tl.constexpr, V_HEADER: tl.constexpr, V_OFFSET: tl.constexpr,
                       V_SUB: tl.constexpr, V_SUB_BITS: tl.constexpr, V_LOOKUP: tl.constexpr,
                       K_PHASES: tl.constexpr = 1, V_PHASES: tl.constexpr = 1, AT_END: tl.constexpr = False,
                       BY_SLOT: tl.constexpr = False, NORMALISE: tl.constexpr = False, GATED: tl.constexpr = False,
                       PREFETCH: tl.constexpr = False, ADJACENT: tl.constexpr = True, PDL: tl.constexpr = False):
    """One (KV head, sequence, row tile, split): the online-softmax state of rows
    [tile * BLOCK_M, next tile) over keys [split * split_keys, next split), where row r sees key
    t < length with t <= q_pos[s, r], length = lengths[s] + length_offset. q (Hkv, S, R, D) of
    any float type at strides (q_heads, q_seqs, q_rows, 1), in K's code domain, times q_scale
    as read (a decode step's queries where the layer left them); q_pos (S, R) int32, or with
    AT_END (decode) every row at its sequence's last key, length - 1, and q_pos unread; lengths
    of any int type (decode: the positions, offset 1). The sequence's pages: row slots[s] of the
    table with BY_SLOT (the cache's whole table), else row s. Outputs m, l (Hkv, S, n_splits, R)
    and acc (Hkv, S, n_splits, R, D); with NORMALISE (one split), acc / l alone, into acc_out at
    strides (o_heads, o_seqs, o_rows, 1), in acc_out's type; with GATED too, times sigmoid of the
    gate (Hkv, S, R, D) at strides (g_heads, g_seqs, g_rows, 1) (gated attention's output gate).
    PREFETCH 1: each block's pool rows read from the block table one block ahead, so the K/V loads
    of a block need not wait for a table load first; 2: also each block's packed codes (or f16
    rows with f16 products) loaded a block ahead into registers, their table rows two ahead, so a
    block's loads are in flight while the one before is decoded and multiplied (Triton's
    pipeliner leaves loads that feed a decoding, not a dot, where they are). Launch settings for
    a lease to time. ADJACENT: a group of codes' values in adjacent columns of the tile (the
    default), else W columns apart, as before session 45 (``_codecs.columns``)."""
    after_previous(PDL)
    h = tl.program_id(0)
    s = tl.program_id(1)
    tile = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)                          # query rows
    d_k = columns(BLOCK_D, K_KIND, K_BITS, K_VALUES, K_BYTES, K_HEADER, K_PHASES, ADJACENT)   # q's columns, K's order
    d = columns(BLOCK_D, V_KIND, V_BITS, V_VALUES, V_BYTES, V_HEADER, V_PHASES, ADJACENT)     # acc's in V's
    r_live = r < n_rows
    d_live = d < HEAD_DIM
    head_seq = h.to(tl.int64) * n_seq + s                               # (h, s) flat, int64: pools can pass 2^31 bytes
    q_at = q_ptr + h.to(tl.int64) * q_heads + s.to(tl.int64) * q_seqs
    q = tl.load(q_at + r[:, None] * q_rows + d_k[None, :],
                mask=r_live[:, None] & (d_k < HEAD_DIM)[None, :], other=0.0).to(tl.float32) * q_scale
    length, table_at, k_head, v_head = sequence_pages(lengths_ptr, slots_ptr, table_ptr, k_pool, v_pool, h, s,
                                                      length_offset, table_stride, n_pages, k_row_bytes,
                                                      v_row_bytes, PAGE_SIZE, BY_SLOT)
    if AT_END:                                                          # padding rows see nothing
        q_pos = tl.where(r_live, length - 1, -1)
    else:
        q_pos = tl.load(q_pos_ptr + s.to(tl.int64) * n_rows + r, mask=r_live, other=-1)

    begin = split * split_keys
    n_keys = tl.minimum(length, tl.max(q_pos) + 1)                     # causal: none past the tile's last row
    end = tl.minimum(begin + split_keys, n_keys)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if PREFETCH:                                                        # the first block's rows, before the loop
        slot_next = pool_rows(table_at, begin + tl.arange(0, BLOCK_N), end, PAGE_SIZE, WIDE)
    if PREFETCH == 2:       # and its codes; the second block's rows
        slot = slot_next
        k0, k1, k2, k3, k4 = fetch_tile(k_head, slot * k_row_bytes, begin + tl.arange(0, BLOCK_N) < end, HEAD_DIM,
                                        BLOCK_D, K_KIND, K_BITS, K_BYTES, K_HEADER, K_OFFSET, K_PHASES, DOT == "f16")
        v0, v1, v2, v3, v4 = fetch_tile(v_head, slot * v_row_bytes, begin + tl.arange(0, BLOCK_N) < end, HEAD_DIM,
                                        BLOCK_D, V_KIND, V_BITS, V_BYTES, V_HEADER, V_OFFSET, V_PHASES, DOT == "f16")
        slot_next = pool_rows(table_at, begin + BLOCK_N + tl.arange(0, BLOCK_N), end, PAGE_SIZE, WIDE)
    for start in range(begin, end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)                               # key positions
        valid = t < end
        if PREFETCH == 2:       # this block's codes came a block ago; the next block's loads go out now,
            here = slot         # from rows read a block before that, and then this block is decoded
            kf = (k0, k1, k2, k3, k4)
            vf = (v0, v1, v2, v3, v4)
            slot = slot_next
            k0, k1, k2, k3, k4 = fetch_tile(k_head, slot * k_row_bytes, t + BLOCK_N < end, HEAD_DIM, BLOCK_D,
                                            K_KIND, K_BITS, K_BYTES, K_HEADER, K_OFFSET, K_PHASES, DOT == "f16")
            v0, v1, v2, v3, v4 = fetch_tile(v_head, slot * v_row_bytes, t + BLOCK_N < end, HEAD_DIM, BLOCK_D,
                                            V_KIND, V_BITS, V_BYTES, V_HEADER, V_OFFSET, V_PHASES, DOT == "f16")
            slot_next = pool_rows(table_at, t + 2 * BLOCK_N, end, PAGE_SIZE, WIDE)
            k = fetched_tile(kf[0], kf[1], kf[2], kf[3], kf[4], k_head, here * k_row_bytes, valid, k_lut, HEAD_DIM,
                             BLOCK_D, K_KIND, K_BITS, K_VALUES, K_BYTES, K_HEADER, K_OFFSET, K_SUB, K_SUB_BITS,
                             K_LOOKUP, K_PHASES, DOT == "f16", ADJACENT)
            v = fetched_tile(vf[0], vf[1], vf[2], vf[3], vf[4], v_head, here * v_row_bytes, valid, v_lut, HEAD_DIM,
                             BLOCK_D, V_KIND, V_BITS, V_VALUES, V_BYTES, V_HEADER, V_OFFSET, V_SUB, V_SUB_BITS,
                             V_LOOKUP, V_PHASES, DOT == "f16", ADJACENT)
        else:
            if PREFETCH:        # this block's rows were read a block ago; the next block's go out now
                slot = slot_next
                slot_next = pool_rows(table_at, t + BLOCK_N, end, PAGE_SIZE, WIDE)
            else:
                slot = pool_rows(table_at, t, end, PAGE_SIZE, WIDE)
            k = decode_tile(k_head, slot * k_row_bytes, valid, k_lut, HEAD_DIM, BLOCK_D,
                            K_KIND, K_BITS, K_VALUES, K_BYTES, K_HEADER, K_OFFSET, K_SUB, K_SUB_BITS, K_LOOKUP,
                            K_PHASES, DOT == "f16", ADJACENT)
            v = decode_tile(v_head, slot * v_row_bytes, valid, v_lut, HEAD_DIM, BLOCK_D,
                            V_KIND, V_BITS, V_VALUES, V_BYTES, V_HEADER, V_OFFSET, V_SUB, V_SUB_BITS, V_LOOKUP,
                            V_PHASES, DOT == "f16", ADJACENT)
        scores = _scores(q, k, DOT)                                     # (BLOCK_M, BLOCK_N)
        seen = valid[None, :] & (t[None, :] <= q_pos[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        m_i, l_i, acc = _fold(m_i, l_i, acc, scores, v, DOT)

    if NORMALISE:                                                       # the output itself, where the caller wants it
        o_at = acc_out + h.to(tl.int64) * o_heads + s.to(tl.int64) * o_seqs
        g_at = gate_ptr + h.to(tl.int64) * g_heads + s.to(tl.int64) * g_seqs
        live = r_live[:, None] & d_live[None, :]
        out = gated(acc / l_i[:, None], g_at + r[:, None] * g_rows + d[None, :], live, GATED)
        tl.store(o_at + r[:, None] * o_rows + d[None, :], stored_as(out, acc_out), mask=live)
    else:
        part = (head_seq * n_splits + split) * n_rows + r              # (BLOCK_M,) rows of this split
        tl.store(m_out + part, m_i, mask=r_live)
        tl.store(l_out + part, l_i, mask=r_live)
        tl.store(acc_out + part[:, None] * HEAD_DIM + d[None, :], acc, mask=r_live[:, None] & d_live[None, :])


@triton.jit
def _scores(q, k, DOT: tl.constexpr):
    """q (BLOCK_M, BLOCK_D) against k (BLOCK_N, BLOCK_D). DOT "ieee" (the default): tl.dot in
    fp32 products, as the torch reference (tf32 would cost ~1e-3); "tf32x3" / "tf32": tensor-core
    products; "f16": operands rounded to f16, float32 sums, on tensor cores (what llama.cpp's and
    vLLM's kernels do; opt-in: it moves scores by ~1e-3 relative); "fma": broadcast products
    summed over D, no tl.dot, so no dimension need be 16 (a decode tile keeps its 8 query rows
    unpadded)."""
    if DOT == "fma":                    # if/else, not an early return: the compiler reads what follows one
        out = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    elif DOT == "f16":
        out = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
    else:
        out = tl.dot(q, tl.trans(k), input_precision=DOT)
    return out


@triton.jit
def _weighted(p, v, DOT: tl.constexpr):
    """p (BLOCK_M, BLOCK_N) times v (BLOCK_N, BLOCK_D), as ``_scores`` computes products."""
    if DOT == "fma":
        out = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    elif DOT == "f16":
        out = tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        out = tl.dot(p, v, input_precision=DOT)
    return out


@triton.jit
def _fold(m_i, l_i, acc, scores, v, DOT: tl.constexpr):
    """One block of masked scores (BLOCK_M, BLOCK_N) and values (BLOCK_N, BLOCK_D) into the state.
    A row may have seen no key yet (its causal limit lies before this block): its max stays
    -inf and it is shifted by 0 instead, so exp gives 0, never NaN (as ``_OnlineSoftmax``)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    corr = tl.exp(m_i - m_safe)
    l_i = l_i * corr + tl.sum(p, axis=1)
    acc = acc * corr[:, None] + _weighted(p, v, DOT)
    return m_new, l_i, acc


MERGE_STAGES = tl.constexpr(3)


@triton.jit
def merge_splits(m_ptr, l_ptr, acc_ptr, m_out, l_out, acc_out, n_splits, n_rows, n_seq, o_heads, o_seqs, o_rows,
                 gate_ptr, g_heads, g_seqs, g_rows,
                 HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 NORMALISE: tl.constexpr = False, GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (KV head x sequence, BLOCK_R query rows, BLOCK_D columns): the n_splits states of
    each row, m and l (Hkv * S, n_splits, R) and acc (..., D), merged into one, m and l
    (Hkv * S, R) and acc (..., D): each split rescaled to the row's common max and summed, splits
    in order, BLOCK_S at a time. A split without keys (m = -inf) weighs 0; a row without any keeps
    -inf, 0, 0 (``paged_prefill.merge_splits``, the torch form, is the reference). With NORMALISE,
    acc / l alone, into acc_out at strides (o_heads, o_seqs, o_rows, 1) of the (Hkv, S, R, D)
    output (n_seq: S), in its type; with GATED, times sigmoid of the gate at strides (g_heads,
    g_seqs, g_rows, 1), as ``paged_prefill_tile``'s store."""
    after_previous(PDL)
    hs = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    r_live = r < n_rows
    first = hs * n_splits * n_rows                                      # split 0, row 0 of this head and sequence
    tops = tl.full([BLOCK_S, BLOCK_R], float("-inf"), tl.float32)
    # both passes' loads a few blocks ahead (cp.async into shared memory, Triton's pipeliner, which
    # takes a loop without tl.dot only when asked): a program a head's rows at -np 1 (128K keys:
    # 256 splits, 8 blocks a pass) waited on memory once a block; the sums keep their order
    for start in tl.range(0, n_splits, BLOCK_S, num_stages=MERGE_STAGES):
        live = (start + s < n_splits)[:, None] & r_live[None, :]
        at = first + (start + s)[:, None] * n_rows + r[None, :]         # (BLOCK_S, BLOCK_R) states
        tops = tl.maximum(tops, tl.load(m_ptr + at, mask=live, other=float("-inf")))
    top = tl.max(tops, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    sums = tl.zeros([BLOCK_S, BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in tl.range(0, n_splits, BLOCK_S, num_stages=MERGE_STAGES):
        live = (start + s < n_splits)[:, None] & r_live[None, :]
        at = first + (start + s)[:, None] * n_rows + r[None, :]
        weight = tl.exp(tl.load(m_ptr + at, mask=live, other=float("-inf")) - safe[None, :])
        sums += tl.load(l_ptr + at, mask=live, other=0.0) * weight
        part = tl.load(acc_ptr + at[:, :, None] * HEAD_DIM + d[None, None, :],
                       mask=live[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
        acc += tl.sum(part * weight[:, :, None], axis=0)
    live = r_live[:, None] & (d < HEAD_DIM)[None, :]
    if NORMALISE:
        o_at = acc_out + (hs // n_seq) * o_heads + (hs % n_seq) * o_seqs
        g_at = gate_ptr + (hs // n_seq) * g_heads + (hs % n_seq) * g_seqs + r[:, None] * g_rows + d[None, :]
        out = gated(acc / tl.sum(sums, axis=0)[:, None], g_at, live, GATED)
        tl.store(o_at + r[:, None] * o_rows + d[None, :], stored_as(out, acc_out), mask=live)
    else:
        out = hs * n_rows + r
        tl.store(acc_out + out[:, None] * HEAD_DIM + d[None, :], acc, mask=live)
        if tl.program_id(2) == 0:
            tl.store(m_out + out, top, mask=r_live)
            tl.store(l_out + out, tl.sum(sums, axis=0), mask=r_live)


INTERPRETED = not isinstance(paged_prefill_tile, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
