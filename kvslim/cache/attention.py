"""Attention over the paged KV pool (the torch backend's math) and its reference.

``attend_pages`` reads a group of sequences' pages block by block through the
block table and merges the blocks with an online softmax, so extra memory is
bounded by one block whatever the depth, and nothing is concatenated:
  - the K format's code domain: the query is moved there once
    (``to_code_domain``; TurboQuant rotates it) and scored against rows decoded
    in that domain (``decode_code_domain``; keys are never un-rotated);
  - the V format's code domain: probabilities weight values decoded in their
    code domain, and one ``from_code_domain`` maps the output back.
``attend_batch`` serves a whole flat batch: all decode rows of all sequences in
one vectorised group, each prefill chunk as a group of its own.
``attend_reference`` decodes the whole history with the public, checked
decoders and does plain softmax attention: the parity tests' oracle.
"""
from __future__ import annotations

import math
import weakref

import torch

from .. import gpu
from ..devices import to_device
from ..gpu import paged_decode as gpu_decode
from ..gpu import paged_prefill as gpu_prefill
from ..gpu import rotation as gpu_rotation
from ..gpu import tuned as gpu_tuned
from ..gpu.swiglu import gated
from ..native import paged_attention as native
from ..native import prefill_attention as native_prefill


# ``dot`` -> the GPU kernels' launch overrides: "bf16" (the bf16 backend) takes their products on
# tensor cores with f16 operands and float32 sums, as llama.cpp's and vLLM's kernels do (f16 keeps
# 11 significant bits, more than bf16's 8; session 31's H200 sweep: f16/f16 decode at 131K 1.9x
# faster than the float32 products, turbo4 1.1-1.2x); "f32" keeps float32 products (FMAs). A decode
# step's launch may come from a lease's sweep instead (``gpu.tuned``), with products no less precise.
KERNEL_DOTS = gpu_tuned.BACKENDS
BLOCK_BUDGET_BYTES = 32 << 20   # float32 bytes one block may hold (decoded K and V, scores)
MAX_BLOCK_TOKENS = 4096


def attend(cache, slot: int, q: torch.Tensor, scale: float | None = None,
           chunk_tokens: int | None = None) -> torch.Tensor:
    """Causal attention of the newest ``Tq`` positions of ``slot`` over its cache.

    Args:
        cache: the layer's KV cache, already holding these positions' K and V.
        slot: sequence id.
        q: queries ``(Tq, n_heads, head_dim)``; n_heads a multiple of n_kv_heads (GQA).
        scale: softmax scale, default ``head_dim ** -0.5``.
        chunk_tokens: history tokens per block (default: from a fixed memory budget).
    Returns:
        float32 ``(Tq, n_heads, head_dim)``.
    """
    n_q = _check_query(cache, slot, q)
    first = cache.offset(slot) - n_q
    return _attend_segment(cache, slot, q, first, scale, chunk_tokens)


def attend_batch(cache, batch, q: torch.Tensor, scale: float | None = None, dot: str = "f32",
                 gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for every row of a flat batch whose K/V are already stored.

    q ``(N, n_heads, D)`` -> float32 ``(N, n_heads, D)``. Single-token segments
    (decode) form one group read together; longer segments (prefill chunks) go alone.
    ``dot`` "bf16": half-precision products where a kernel has them (a prompt's rows in the C
    kernel on CPUs with AVX512_BF16; every row in the GPU kernels, ``KERNEL_DOTS``).
    ``gate`` (N, n_heads, D): gated attention's; the output times sigmoid(gate), in its type
    (``gated``), inside a DecodeBatch's attention launch where the GPU kernel serves it.
    """
    if batch.prepared:
        return attend_decode_static(cache, batch, q, scale, dot, gate)
    out = _attend_flat(cache, batch, q, scale, dot)
    return out if gate is None else gated(out, gate)


def _attend_flat(cache, batch, q: torch.Tensor, scale: float | None, dot: str) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    decode = [seg for seg in batch.segments if seg.length == 1]
    if decode:
        rows = None if len(decode) == len(batch.segments) else to_device([seg.begin for seg in decode], q.device)
        q_dec = q if rows is None else q[rows]
        o = _attend_decode(cache, [seg.slot for seg in decode], [seg.start_pos for seg in decode], q_dec, scale, dot)
        if rows is None:
            out = o
        else:
            out[rows] = o
    for seg in batch.segments:
        if seg.length > 1:
            out[seg.begin:seg.end] = _attend_segment(cache, seg.slot, q[seg.begin:seg.end], seg.start_pos, scale,
                                                      dot=dot)
    return out


def _attend_decode(cache, slots: list[int], positions: list[int], q: torch.Tensor, scale,
                   dot: str = "f32") -> torch.Tensor:
    """One query token per sequence: q (S, H, D) -> (S, H, D)."""
    n_seq, n_heads, dim = q.shape
    qg = _group(cache.n_kv_heads, q.unsqueeze(1), scale)                # (S, Hkv, G, D)
    q_pos = to_device(positions, q.device)[:, None].expand(n_seq, qg.shape[2])
    out = attend_pages(cache, slots, qg, q_pos, min(positions), one_position=True, dot=dot)
    return out.reshape(n_seq, n_heads, dim)


def attend_decode_static(cache, batch, q: torch.Tensor, scale: float | None = None, dot: str = "f32",
                         gate: torch.Tensor | None = None) -> torch.Tensor:
    """A DecodeBatch's attention: one query per sequence over ``batch.n_pages`` pages of each.
    No host reads outside one opaque op, shapes fixed by (B, n_pages): it traces into a
    compiled step, where the op stays one call (``kvslim::paged_decode``) that reads the
    packed pages block by block. q (B, H, D) -> float32 (B, H, D), or with ``gate`` the gated
    output in the gate's type."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.kvslim.paged_decode(q, cache.k_pool, cache.v_pool, cache.block_table[:, :batch.n_pages],
                                         batch.slots, batch.positions, float(scale), *cache.op_names, dot, gate)


# Bound calibrated formats (klt3: a calibration per layer) by the name the paged_decode op carries:
# an op takes strings, not objects, and the table's name alone does not say which layer's basis.
_BOUND: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def op_name(fmt) -> str:
    """The name a format travels by through ``kvslim::paged_decode``: its table name, or for a bound
    calibrated format a name registered here for that object. Called when a cache is made
    (``KVCache.op_names``): registering inside a traced step would break its graph."""
    if not fmt.calibrated:
        return fmt.name
    name = f"{fmt.name}@{id(fmt):x}"
    _BOUND[name] = fmt
    return name


def _op_format(name: str, role: str):
    from .. import formats                                           # formats import nothing from here
    bound = _BOUND.get(name)
    return bound if bound is not None else formats.get(name, role=role)


@torch.library.custom_op("kvslim::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor, scale: float, type_k: str, type_v: str,
                 dot: str = "f32", gate: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, D) of any float type, model domain; pools (Hkv, pages, page_size, row bytes);
    table (n_slots, P): the cache's block table's first P columns, sequence b's pages in row
    slots[b]; sequence b sees its keys at positions <= positions[b]. -> float32 (B, H, D).
    Block-wise online softmax over the pages, as ``attend_pages``; ``dot`` as there. On a GPU
    with the kernels on, one kernel takes q, the table and the positions as they lie and writes
    the output in this layout (``gpu_decode.step_output``); the torch form here is its
    reference. ``gate`` (B, H, D): gated attention's; the output times sigmoid(gate) in the
    gate's type (the kernel's store does it, else ``gated``)."""
    fmt_k, fmt_v = _op_format(type_k, "k"), _op_format(type_v, "v")
    n_kv = k_pool.shape[0]
    if gpu.TRITON and gpu_decode.serves_step(fmt_k, fmt_v, q, n_kv):
        tune, split = gpu_decode.step_launch(fmt_k, fmt_v, q.shape[-1], q.shape[1] // n_kv, dot, q.device)
        return gpu_decode.step_output(fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions,
                                      split_keys=split, tune=tune, gate=gate)
    out = _paged_decode_torch(fmt_k, fmt_v, q, k_pool, v_pool, table, slots, positions, scale, dot)
    return out if gate is None else gated(out, gate)


def _paged_decode_torch(fmt_k, fmt_v, q, k_pool, v_pool, table, slots, positions, scale, dot) -> torch.Tensor:
    """``paged_decode``'s torch form: the block loop over each sequence's pages, float32."""
    n_kv = k_pool.shape[0]
    n_seq, n_heads, dim = q.shape
    qg = _group(n_kv, q.unsqueeze(1), scale).transpose(0, 1).contiguous()          # (Hkv, B, G, D), scaled
    q_code = gpu_rotation.to_code_domain(fmt_k, qg)
    acc = _scan_decode(fmt_k, fmt_v, k_pool, v_pool, table.index_select(0, slots), q_code, positions + 1, dot=dot)
    return gpu_rotation.from_code_domain(fmt_v, acc.result()).transpose(0, 1).reshape(n_seq, n_heads, dim)


@paged_decode.register_fake
def _(q, k_pool, v_pool, table, slots, positions, scale, type_k, type_v, dot="f32", gate=None):
    return torch.empty(q.shape, dtype=torch.float32 if gate is None else gate.dtype, device=q.device)


def _attend_segment(cache, slot: int, q: torch.Tensor, first: int, scale, chunk_tokens=None,
                    dot: str = "f32") -> torch.Tensor:
    """Tq consecutive queries of one sequence from position ``first``: (Tq, H, D) -> (Tq, H, D)."""
    n_q, n_heads, dim = q.shape
    group = n_heads // cache.n_kv_heads
    qg = _group(cache.n_kv_heads, q.unsqueeze(0), scale)                # (1, Hkv, G*Tq... see _group)
    q_pos = torch.arange(first, first + n_q, device=q.device).repeat(group)[None]    # row g*Tq + t
    out = attend_pages(cache, [slot], qg, q_pos, first, chunk_tokens, dot=dot)   # (1, Hkv, G*Tq, D)
    out = out.reshape(cache.n_kv_heads, group, n_q, dim).permute(2, 0, 1, 3)
    return out.reshape(n_q, n_heads, dim)


def _group(n_kv_heads: int, q: torch.Tensor, scale) -> torch.Tensor:
    """(S, Tq, H, D) -> pre-scaled float32 (S, Hkv, G*Tq, D), row g*Tq + t: the query heads
    that share one KV head read its rows together (GQA)."""
    n_seq, n_q, n_heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    qf = (q.float() * scale).reshape(n_seq, n_q, n_kv_heads, n_heads // n_kv_heads, dim)
    return qf.permute(0, 2, 3, 1, 4).reshape(n_seq, n_kv_heads, -1, dim)


def attend_pages(cache, slots: list[int], q: torch.Tensor, q_pos: torch.Tensor, first_q: int,
                 block_tokens: int | None = None, one_position: bool = False, dot: str = "f32") -> torch.Tensor:
    """The core: queries of S sequences over their pages and f16 windows.

    Args:
        slots: the S sequences' slots.
        q: (S, Hkv, R, D) float32, scaled, in the model domain.
        q_pos: (S, R) absolute position of each query row (the causal limit).
        first_q: the smallest query position (known on the host: decides where masks are needed).
        one_position: every row of a sequence is at that sequence's newest position (decode),
            so each sees all of its packed keys: the native kernel can serve it.
        dot: "bf16" scores and sums the pages with bf16 operands (float32 sums) in the C kernel
            where this CPU has AVX512_BF16 (``native.prefill_attention``; a prompt's rows only),
            and with f16 operands in the GPU kernels (``KERNEL_DOTS``, decode too); "f32" keeps
            float32.
    Returns:
        (S, Hkv, R, D) float32 in the model domain.
    """
    n_seq, n_kv, n_rows, dim = q.shape
    packed = [cache.n_packed(s) for s in slots]
    slot_ids = to_device(slots, q.device)
    q = q.transpose(0, 1)                                               # (Hkv, S, R, D): heads lead, as in the pool
    q_code = gpu_rotation.to_code_domain(cache.fmt_k, q)               # rotate once
    table = cache.block_table[slot_ids, :-(-max(packed) // cache.page_size)]   # pages the longest one uses
    lengths = to_device(packed, q.device)
    if one_position:
        acc = _scan_decode(cache.fmt_k, cache.fmt_v, cache.k_pool, cache.v_pool, table, q_code, lengths, block_tokens,
                           dot)
    elif gpu.TRITON and gpu_prefill.supports(cache.fmt_k, cache.fmt_v, q_code):   # rows at their own positions
        acc = _OnlineSoftmax.of(*gpu_prefill.prefill_state(cache.fmt_k, cache.fmt_v, q_code, q_pos, cache.k_pool,
                                                           cache.v_pool, table, lengths, tune=KERNEL_DOTS[dot]))
    else:   # a block that ends by every sequence's end and by the first query's position needs no mask
        acc = _OnlineSoftmax(n_kv, n_seq, n_rows, dim, q.device)
        per_block = _pages_per_block(n_kv, dim, cache.page_size, n_seq, n_rows, block_tokens)
        if dot == "bf16" and native_prefill.supports(q_code):
            _scan_bf16(cache, table, q_code, q_pos, lengths, acc, per_block)
        else:
            _scan_pages(cache.fmt_k, cache.fmt_v, cache.k_pool, cache.v_pool, table, q_code, q_pos, lengths, acc,
                        per_block, dim, unmasked_end=min(min(packed), first_q + 1))
    if cache.f16_window:
        _window_block(cache, slots, slot_ids, packed, q, q_pos, acc)
    return gpu_rotation.from_code_domain(cache.fmt_v, acc.result()).transpose(0, 1)


def _scan_pages(fmt_k, fmt_v, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, q_code: torch.Tensor,
                q_pos: torch.Tensor, lengths: torch.Tensor, acc: "_OnlineSoftmax", per_block: int, head_dim: int,
                unmasked_end: int = 0, bf16: bool = False) -> None:
    """Fold the pages of ``table`` (S, P) into ``acc``, ``per_block`` pages at a time: scores in
    K's code domain, row scales on scores and probabilities, a mask on every block that reaches
    past ``unmasked_end`` (0: every block). Only one block's decoded rows are alive at once.
    ``bf16``: one sequence's block goes to the C kernel (bf16 operands, float32 sums, its own mask)."""
    page_size = k_pool.shape[2]
    for first in range(0, table.shape[1], per_block):
        start = first * page_size
        pages = table[:, first:first + per_block]
        (k, k_scale), (v, v_scale) = _decode_pages(fmt_k, fmt_v, k_pool, v_pool, pages, head_dim)
        if bf16:
            native_prefill.fold(acc.m, acc.l, acc.acc, q_code, k, k_scale, v, v_scale, q_pos, start, int(lengths[0]))
            continue
        if q_code.shape[2] > head_dim:          # a prompt's many rows: scale the block's T x D rows, not R x T
            k, k_scale = _scaled_rows(k, k_scale)
            v, v_scale = _scaled_rows(v, v_scale)
        scores = q_code @ k.transpose(-1, -2)                           # (Hkv, S, R, T)
        if k_scale is not None:
            scores = scores * k_scale.unsqueeze(-2)
        if start + k.shape[2] > unmasked_end:                           # keys past an end or in a future
            scores = _mask(scores, start, lengths, q_pos)
        acc.update(scores, v, v_scale)
        del k, v, scores, k_scale, v_scale                              # before the next block: one block alive


def _scan_bf16(cache, table: torch.Tensor, q_code: torch.Tensor, q_pos: torch.Tensor, lengths: torch.Tensor,
               acc: "_OnlineSoftmax", per_block: int) -> None:
    """One sequence's pages into ``acc`` by the bf16 C kernel: it decodes the packed rows itself
    where the decode kernel's codecs know both formats, else folds the blocks torch decodes. Those
    blocks start on the kernel's key tiles, so a row's sums run in one order whatever its chunk."""
    dim = q_code.shape[-1]
    if native_prefill.reads_pages(cache.fmt_k, cache.fmt_v, dim):
        native_prefill.fold_pages(acc.m, acc.l, acc.acc, q_code, cache.fmt_k, cache.fmt_v, cache.k_pool,
                                  cache.v_pool, table, int(lengths[0]), q_pos)
        return
    step = native_prefill.KEY_TILE // math.gcd(cache.page_size, native_prefill.KEY_TILE)      # pages
    _scan_pages(cache.fmt_k, cache.fmt_v, cache.k_pool, cache.v_pool, table, q_code, q_pos, lengths, acc,
                -(-per_block // step) * step, dim, bf16=True)


def _scan_decode(fmt_k, fmt_v, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 q_code: torch.Tensor, n_keys: torch.Tensor, block_tokens: int | None = None,
                 dot: str = "f32") -> "_OnlineSoftmax":
    """The softmax state of one query position per sequence (every row of sequence s sees its first
    ``n_keys[s]`` keys): from the Triton kernel on a GPU (its products as ``dot`` asks,
    ``KERNEL_DOTS``) or the C kernel on the CPU where they know both formats (one pass over the
    packed rows, nothing decoded to memory), else from the torch block loop, which is their
    reference."""
    if gpu.TRITON and gpu_decode.supports(fmt_k, fmt_v, q_code):
        return _OnlineSoftmax.of(*gpu_decode.decode_state(fmt_k, fmt_v, q_code, k_pool, v_pool, table, n_keys,
                                                          tune=KERNEL_DOTS[dot]))
    if native.supports(fmt_k, fmt_v, q_code):
        return _OnlineSoftmax.of(*native.decode_state(fmt_k, fmt_v, q_code, k_pool, v_pool, table, n_keys))
    n_kv, n_seq, n_rows, dim = q_code.shape
    acc = _OnlineSoftmax(n_kv, n_seq, n_rows, dim, q_code.device)
    per_block = _pages_per_block(n_kv, dim, k_pool.shape[2], n_seq, n_rows, block_tokens)
    q_pos = (n_keys - 1)[:, None].expand(n_seq, n_rows)
    _scan_pages(fmt_k, fmt_v, k_pool, v_pool, table, q_code, q_pos, n_keys, acc, per_block, dim)
    return acc


def _scaled_rows(rows: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """A block's decoded rows (Hkv, S, T, D) times their row scales (Hkv, S, T), if any: the
    scores (or probabilities) scaled per key instead, equal up to float rounding, with T x D
    multiplies instead of R x T. A prompt chunk has R = 4,096 query rows per KV head (512
    tokens x GQA 8) against D = 256: a pp512 with turbo4 K/V at depth 4096 spent 18.7 ms
    scaling scores and probabilities, and ran at 4.4K t/s (6.0K so; q8_0 6.2K)."""
    return (rows if scale is None else rows * scale.unsqueeze(-1)), None


def _decode_pages(fmt_k, fmt_v, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, head_dim: int):
    """Packed rows of a block of pages (S, P) -> K and V as (values (Hkv, S, P*page_size, D), row
    scale or None), code domain. One gather of packed bytes per pool; each head's rows contiguous."""
    n_seq, n_pages = pages.shape
    idx = pages.reshape(-1).long()
    shape = (k_pool.shape[0], n_seq, n_pages * k_pool.shape[2], -1)
    kb = k_pool.index_select(1, idx).reshape(shape)
    vb = v_pool.index_select(1, idx).reshape(shape)
    return fmt_k.decode_code_domain_scaled(kb, head_dim), fmt_v.decode_code_domain_scaled(vb, head_dim)


def _mask(scores: torch.Tensor, start: int, lengths: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """-inf where a key lies past its sequence's packed end or after the query's position."""
    k_pos = torch.arange(start, start + scores.shape[-1], device=scores.device)
    invalid = (k_pos[None, None, :] >= lengths[:, None, None]) | (k_pos[None, None, :] > q_pos[:, :, None])
    return scores.masked_fill_(invalid, float("-inf"))                 # (S, R, T) broadcast over heads


def _window_block(cache, slots, slot_ids, packed, q, q_pos, acc) -> None:
    """The f16 windows: keys scored in the model domain, values moved into V's code domain."""
    win = [cache.window_len(s) for s in slots]
    if not max(win):
        return
    n = max(win)
    wk = cache.win_k[slot_ids, :n].float().permute(2, 0, 1, 3)          # (Hkv, S, n, D)
    wv = gpu_rotation.to_code_domain(cache.fmt_v, cache.win_v[slot_ids, :n].permute(2, 0, 1, 3))
    scores = q @ wk.transpose(-1, -2)                                   # (Hkv, S, R, n)
    base = to_device(packed, q.device)
    j = torch.arange(n, device=q.device)
    k_pos = base[:, None] + j[None, :]                                  # (S, n)
    invalid = (j[None, :] >= to_device(win, q.device)[:, None])[:, None, :] | \
        (k_pos[:, None, :] > q_pos[:, :, None])                         # (S, R, n)
    acc.update(scores.masked_fill(invalid, float("-inf")), wv)


def _pages_per_block(n_kv: int, head_dim: int, page_size: int, n_seq: int, n_rows: int,
                     block_tokens: int | None = None) -> int:
    """Pages read at once so that decoded K, V and scores stay within BLOCK_BUDGET_BYTES."""
    if block_tokens is None:
        per_token = 4 * n_seq * n_kv * (2 * head_dim + n_rows)
        block_tokens = min(MAX_BLOCK_TOKENS, BLOCK_BUDGET_BYTES // per_token)
    return max(1, block_tokens // page_size)


class _OnlineSoftmax:
    """Running max, denominator and weighted sum over blocks (flash-decoding merge)."""

    def __init__(self, n_kv: int, n_seq: int, rows: int, dim: int, device):
        self.m = torch.full((n_kv, n_seq, rows, 1), float("-inf"), device=device)
        self.l = torch.zeros(n_kv, n_seq, rows, 1, device=device)
        self.acc = torch.zeros(n_kv, n_seq, rows, dim, device=device)

    @classmethod
    def of(cls, m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> "_OnlineSoftmax":
        """A state computed elsewhere (the native kernel), to fold more blocks into."""
        state = cls.__new__(cls)
        state.m, state.l, state.acc = m, l, acc
        return state

    def update(self, scores: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor | None = None) -> None:
        """scores (Hkv, S, R, n); v (Hkv, S, n, D), each row times v_scale (Hkv, S, n) if given."""
        m_new = torch.maximum(self.m, scores.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # fully masked rows
        p = scores.sub_(m_safe).exp_()                  # in place: the block's scores are not read again
        corr = torch.exp(self.m - m_safe)
        self.l = self.l * corr + p.sum(-1, keepdim=True)
        if v_scale is not None:
            p.mul_(v_scale.unsqueeze(-2))
        acc = self.acc.mul_(corr)                       # acc * corr + p @ v, one pass over acc
        self.acc = torch.baddbmm(acc.flatten(0, -3), p.flatten(0, -3), v.flatten(0, -3)).view(acc.shape)
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l


# ----- the reference ----------------------------------------------------------------
def attend_reference(cache, slot: int, q: torch.Tensor, scale: float | None = None,
                     chunk_tokens: int | None = None) -> torch.Tensor:
    """Decode everything to float32 with the public decoders, then plain causal softmax attention."""
    n_q = _check_query(cache, slot, q)
    n_heads, dim = q.shape[1:]
    group = n_heads // cache.n_kv_heads
    kb, vb = cache.rows(slot)
    _, wk, wv = cache.window(slot)
    k = torch.cat([cache.fmt_k.decode(kb, dim), wk.float()]).transpose(0, 1)     # (Hkv, T, D)
    v = torch.cat([cache.fmt_v.decode(vb, dim), wv.float()]).transpose(0, 1)
    qf = _group(cache.n_kv_heads, q.unsqueeze(0), scale)[0]                      # (Hkv, G*Tq, D)
    n = cache.offset(slot)
    q_pos = torch.arange(n - n_q, n, device=q.device).repeat(group)
    future = torch.arange(k.shape[1], device=q.device)[None, :] > q_pos[:, None]
    probs = torch.softmax((qf @ k.transpose(1, 2)).masked_fill(future, float("-inf")), dim=-1)
    out = (probs @ v).reshape(cache.n_kv_heads, group, n_q, dim).permute(2, 0, 1, 3)
    return out.reshape(n_q, n_heads, dim)


def _check_query(cache, slot: int, q: torch.Tensor) -> int:
    if q.dim() != 3 or q.shape[-1] != cache.head_dim or q.shape[1] % cache.n_kv_heads:
        raise ValueError(f"q must be (Tq, n_heads, {cache.head_dim}) with n_heads a multiple of "
                         f"n_kv_heads={cache.n_kv_heads}; got {tuple(q.shape)}")
    n = cache.offset(slot)
    if q.shape[0] > n:
        raise ValueError(f"slot {slot}: {q.shape[0]} queries but only {n} cached positions; append K/V first")
    return q.shape[0]


__all__ = ["attend", "attend_batch", "attend_decode_static", "attend_pages", "attend_reference"]
