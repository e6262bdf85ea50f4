"""The one attention dispatcher every model calls, and its reference.

``attend`` reads the packed history chunk by chunk and merges the chunks with
an online softmax, so extra memory is bounded by the chunk, not the depth:
  - TurboQuant K: the query is rotated once and scored against codebook values
    in the rotated domain (keys are never un-rotated);
  - TurboQuant V: probabilities are applied to rotated values and one inverse
    rotation is applied to the output;
  - ggml and float K/V: each chunk is decoded, used and dropped.
``attend_reference`` decodes the whole history, then does plain softmax
attention: same signature, used by the parity tests.
"""
from __future__ import annotations


import torch

from ..formats.turbo import TurboFormat
from .kv import KVCache

SCORE_BUDGET_BYTES = 32 << 20   # fp32 scores held at once by one chunk
MIN_CHUNK, MAX_CHUNK = 256, 4096


def attend(cache: KVCache, slot: int, q: torch.Tensor, scale: float | None = None,
           chunk_tokens: int | None = None) -> torch.Tensor:
    """Causal attention of the newest ``Tq`` positions of ``slot`` over its cache.

    Args:
        cache: the layer's KV cache, already holding these positions' K and V.
        slot: sequence id.
        q: queries ``(Tq, n_heads, head_dim)``; n_heads a multiple of n_kv_heads (GQA).
        scale: softmax scale, default ``head_dim ** -0.5``.
        chunk_tokens: history tokens per chunk (default: from a fixed score budget).
    Returns:
        float32 ``(Tq, n_heads, head_dim)``.
    """
    qf, q_pos, shape = _prepare(cache, slot, q, scale)
    n_kv, rows, dim = qf.shape
    chunk = chunk_tokens or _chunk_for(rows * n_kv)
    rot_k, rot_v = isinstance(cache.fmt_k, TurboFormat), isinstance(cache.fmt_v, TurboFormat)
    first_q = cache.offset(slot) - q.shape[0]
    q_k = cache.fmt_k.rotate(qf) if rot_k else qf
    acc = _OnlineSoftmax(n_kv, rows, dim, qf.device)
    for start, kb, vb in cache.packed_chunks(slot, chunk):
        k = (cache.fmt_k.decode_rotated(kb, dim) if rot_k else cache.fmt_k.decode(kb, dim))
        v = (cache.fmt_v.decode_rotated(vb, dim) if rot_v else cache.fmt_v.decode(vb, dim))
        acc.update(_masked_scores(q_k, k, start, q_pos, first_q), v.transpose(0, 1))
    start, wk, wv = cache.window(slot)
    if wk.shape[0]:
        v = wv.float()
        acc.update(_masked_scores(qf, wk.float(), start, q_pos, first_q),
                   (cache.fmt_v.rotate(v) if rot_v else v).transpose(0, 1))
    out = acc.result()
    return _finish(cache.fmt_v.unrotate(out) if rot_v else out, shape)


def attend_reference(cache: KVCache, slot: int, q: torch.Tensor, scale: float | None = None,
                     chunk_tokens: int | None = None) -> torch.Tensor:
    """Decode everything to float32, then plain causal softmax attention."""
    qf, q_pos, shape = _prepare(cache, slot, q, scale)
    dim = qf.shape[-1]
    ks, vs = [], []
    for _, kb, vb in cache.packed_chunks(slot, cache.ctx):
        ks.append(cache.fmt_k.decode(kb, dim))
        vs.append(cache.fmt_v.decode(vb, dim))
    _, wk, wv = cache.window(slot)
    k = torch.cat(ks + [wk.float()]).transpose(0, 1)              # (H_kv, T, D)
    v = torch.cat(vs + [wv.float()]).transpose(0, 1)
    scores = qf @ k.transpose(1, 2)                               # (H_kv, G*Tq, T)
    future = torch.arange(k.shape[1], device=qf.device)[None, :] > q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return _finish(probs @ v, shape)


def _prepare(cache: KVCache, slot: int, q: torch.Tensor, scale: float | None):
    """Queries as (H_kv, G*Tq, D) float32 pre-scaled, their absolute positions (G*Tq,), and the output shape."""
    if q.dim() != 3 or q.shape[-1] != cache.head_dim or q.shape[1] % cache.n_kv_heads:
        raise ValueError(f"q must be (Tq, n_heads, {cache.head_dim}) with n_heads a multiple of "
                         f"n_kv_heads={cache.n_kv_heads}; got {tuple(q.shape)}")
    n_q, n_heads, dim = q.shape
    n = cache.offset(slot)
    if n_q > n:
        raise ValueError(f"slot {slot}: {n_q} queries but only {n} cached positions; append K/V first")
    group = n_heads // cache.n_kv_heads
    scale = dim ** -0.5 if scale is None else scale
    qf = (q.float() * scale).reshape(n_q, cache.n_kv_heads, group, dim).permute(1, 2, 0, 3)
    q_pos = torch.arange(n - n_q, n, device=q.device).repeat(group)      # row g*Tq + t -> position of t
    return qf.reshape(cache.n_kv_heads, group * n_q, dim), q_pos, (n_q, n_heads, dim, group)


def _finish(out: torch.Tensor, shape) -> torch.Tensor:
    n_q, n_heads, dim, group = shape
    out = out.reshape(-1, group, n_q, dim).permute(2, 0, 1, 3)          # (Tq, H_kv, G, D)
    return out.reshape(n_q, n_heads, dim)


def _chunk_for(score_rows: int) -> int:
    """History tokens per chunk so that fp32 scores stay within SCORE_BUDGET_BYTES."""
    return max(MIN_CHUNK, min(MAX_CHUNK, SCORE_BUDGET_BYTES // (4 * max(score_rows, 1))))


def _masked_scores(q: torch.Tensor, k: torch.Tensor, start: int, q_pos: torch.Tensor, first_q: int) -> torch.Tensor:
    """Scores (H_kv, rows, n) of queries against keys (n, H_kv, D) starting at ``start``;
    ``first_q`` is the earliest query position, known on the host (no device sync)."""
    scores = q @ k.permute(1, 2, 0)
    if start + k.shape[0] - 1 > first_q:                              # some keys lie in a query's future
        k_pos = torch.arange(start, start + k.shape[0], device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores


class _OnlineSoftmax:
    """Running max, denominator and weighted sum over chunks (flash-decoding merge)."""

    def __init__(self, n_kv: int, rows: int, dim: int, device):
        self.m = torch.full((n_kv, rows, 1), float("-inf"), device=device)
        self.l = torch.zeros(n_kv, rows, 1, device=device)
        self.acc = torch.zeros(n_kv, rows, dim, device=device)

    def update(self, scores: torch.Tensor, v: torch.Tensor) -> None:
        """scores (H_kv, rows, n); v (H_kv, n, D)."""
        m_new = torch.maximum(self.m, scores.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # fully masked rows
        p = torch.exp(scores - m_safe)
        corr = torch.exp(self.m - m_safe)
        self.l = self.l * corr + p.sum(-1, keepdim=True)
        self.acc = self.acc * corr + p @ v
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l


__all__ = ["attend", "attend_reference"]
