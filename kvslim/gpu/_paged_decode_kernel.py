"""The Triton kernel of ``paged_decode`` (imported only when it runs: importing kvslim needs no triton).

One program per (KV head, sequence, split of SPLIT_KEYS keys). It walks its keys BLOCK_N at a
time through the block table, loads the packed K/V rows as bytes, decodes them in registers to
float32 (``_codecs.decode_tile``, shared with the prefill kernel: the codec constexprs select the
layout, as ``paged_attention.c``'s codec_t does), scores the G query rows that share the KV head
against one read of each key (GQA), and keeps an online softmax. It writes its split's
(m, l, acc); the launcher merges the splits.

Triton decides at decoration time whether a kernel is interpreted (TRITON_INTERPRET=1, numpy on
the CPU) or compiled; ``INTERPRETED`` records which this module's kernels are, ``RUNNABLE``
whether triton.language's own functions (decorated when triton was imported) agree.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ._codecs import decode_tile


@triton.jit
def paged_decode_split(q_ptr, k_pool, v_pool, table_ptr, n_keys_ptr, k_lut, v_lut,
                       m_out, l_out, acc_out,
                       n_seq, n_rows, n_pages, page_size, k_row_bytes, v_row_bytes, table_width, n_splits,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                       K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_VALUES: tl.constexpr,
                       K_BYTES: tl.constexpr, K_HEADER: tl.constexpr,
                       V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_VALUES: tl.constexpr,
                       V_BYTES: tl.constexpr, V_HEADER: tl.constexpr):
    """One (KV head, sequence, split): its online-softmax state over keys
    [split * SPLIT_KEYS, min(next split, n_keys[s])). q (Hkv, S, R, D) float32 in K's code
    domain; outputs m, l (Hkv, S, n_splits, R) and acc (Hkv, S, n_splits, R, D)."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_live = g < n_rows
    d_live = d < HEAD_DIM
    head_seq = h.to(tl.int64) * n_seq + s                               # (h, s) flat, int64: pools can pass 2^31 bytes
    q = tl.load(q_ptr + (head_seq * n_rows + g[:, None]) * HEAD_DIM + d[None, :],
                mask=g_live[:, None] & d_live[None, :], other=0.0)      # (BLOCK_G, BLOCK_D)

    n_keys = tl.load(n_keys_ptr + s).to(tl.int32)
    begin = split * SPLIT_KEYS
    end = tl.minimum(begin + SPLIT_KEYS, n_keys)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)                               # key positions
        valid = t < end
        page = tl.load(table_ptr + s.to(tl.int64) * table_width + t // page_size, mask=valid, other=0)
        slot = (h.to(tl.int64) * n_pages + page.to(tl.int64)) * page_size + t % page_size
        k = decode_tile(k_pool, slot * k_row_bytes, valid, k_lut, HEAD_DIM, BLOCK_D,
                         K_KIND, K_BITS, K_VALUES, K_BYTES, K_HEADER)   # (BLOCK_N, BLOCK_D)
        v = decode_tile(v_pool, slot * v_row_bytes, valid, v_lut, HEAD_DIM, BLOCK_D,
                         V_KIND, V_BITS, V_VALUES, V_BYTES, V_HEADER)
        # fp32 products, as the torch reference: tf32 would cost ~1e-3 in the scores
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")         # (BLOCK_G, BLOCK_N)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))                 # finite: every tile has a valid key
        p = tl.exp(scores - m_new[:, None])
        corr = tl.exp(m_i - m_new)
        l_i = l_i * corr + tl.sum(p, axis=1)
        acc = acc * corr[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    part = (head_seq * n_splits + split) * n_rows + g                  # (BLOCK_G,) rows of this split
    tl.store(m_out + part, m_i, mask=g_live)
    tl.store(l_out + part, l_i, mask=g_live)
    tl.store(acc_out + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_live[:, None] & d_live[None, :])


INTERPRETED = not isinstance(paged_decode_split, JITFunction)
RUNNABLE = INTERPRETED == (not isinstance(tl.zeros, JITFunction))     # else tl.zeros & co. refuse to run
