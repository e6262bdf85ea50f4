"""Gated delta rule: the recurrence of Gated DeltaNet layers, in two forms.

Per value head, with state S (dk, dv), decay g <= 0 (log space), rate beta:
    S <- S * exp(g_t)
    S <- S + k_t (x) beta_t * (v_t - S^T k_t)
    o_t = S^T q_t
``recurrent_gated_delta_rule`` runs that loop token by token: it is the
reference and the decode path (one token per sequence). ``chunk_gated_delta_rule``
is the prefill path (and ``gated_delta_step`` the in-place decode step): within a chunk of C tokens the updates are condensed with
the WY/UT transform (one triangular solve) so the work is matmuls, and only the
chunks are sequential. Both take q and k already L2-normalised, repeated to
the value heads, and return float32; ``gated_delta_decode`` takes a decode step's raw
inputs (q and k as convolved, the gates' pre-activations) and does the rest. ``chunk_rule``
picks, per device, the prompt form: the torch one, fla-core's kernel on a CUDA device
(kvslim/gpu/delta_rule.py) or the C recurrence on the CPU (kvslim/native/delta_rule.py);
a GPU's decode step is kvslim/gpu/delta_step.py. All are held to these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu import delta_rule as fla
from ..native import delta_rule as native

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """q, k (B, T, H, dk); v (B, T, H, dv); g, beta (B, T, H); state (B, H, dk, dv).
    Returns o (B, T, H, dv) and the final state, both float32."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    s = state.float().clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def value_heads(q: torch.Tensor, k: torch.Tensor, n_v: int):
    """q, k (T, Hk, dk) as convolved -> L2-normalised float32, repeated to the ``n_v`` value heads
    (value head h reads key head h // (Hv / Hk)): what the torch forms take."""
    rep = n_v // q.shape[1]
    return l2norm(q.float()).repeat_interleave(rep, dim=1), l2norm(k.float()).repeat_interleave(rep, dim=1)


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """A Gated DeltaNet layer's log decay g = -exp(A_log) * softplus(a + dt_bias) and rate
    beta = sigmoid(b), float32, from the pre-activations a, b (..., Hv)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gated_delta_decode(q, k, v, a, b, A_log, dt_bias, state):
    """A decode step from a layer's raw inputs: q, k (B, Hk, dk) convolved, not yet normalised;
    v (B, Hv, dv); a, b (B, Hv) the gates' pre-activations (``gates``). q and k are
    L2-normalised and repeated to the value heads (value head h reads key head h // (Hv / Hk)),
    then ``gated_delta_step`` updates ``state`` (B, Hv, dk, dv) in place. Returns o (B, Hv, dv)
    float32. gpu/delta_step.py does all of it in one launch on the slots' states in place."""
    q, k = value_heads(q, k, v.shape[1])
    g, beta = gates(a, b, A_log, dt_bias)
    return gated_delta_step(q, k, v, g, beta, state)


def gated_delta_step(q, k, v, g, beta, state):
    """Decode: one token per sequence, ``state`` (B, H, dk, dv) float32 updated in place.
    q, k (B, H, dk); v (B, H, dv); g, beta (B, H). Returns o (B, H, dv) float32."""
    b, h, dk, dv = state.shape
    q, k, v = q.float() * dk ** -0.5, k.float(), v.float()
    state.mul_(g.float().exp()[..., None, None])
    flat = state.view(b * h, dk, dv)
    kv_mem = torch.bmm(k.reshape(b * h, 1, dk), flat)                 # S^T k: what the state predicts for k
    delta = (v.reshape(b * h, 1, dv) - kv_mem) * beta.float().reshape(b * h, 1, 1)
    flat.baddbmm_(k.reshape(b * h, dk, 1), delta)                      # S += k (x) beta (v - S^T k)
    return torch.bmm(q.reshape(b * h, 1, dk), flat).view(b, h, dv)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Same contract as ``recurrent_gated_delta_rule``; O(T) sequential steps become O(T / chunk)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    # (B, H, n, C, D) float32, padded with zeros (g = 0 and beta = 0 leave the state unchanged)
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)).reshape(b, h, -1, chunk, x.shape[-1])
               for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)).reshape(b, h, -1, chunk) for x in (g, beta))
    q = q * dk ** -0.5
    cum = g.cumsum(-1)                                              # log decay from chunk start to each t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (.., C, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # UT transform: (I + strictly_lower(diag(beta) K K^T * decay)) W = [V*beta | K*beta*exp(cum)]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    rhs = torch.cat([v_beta, k_beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    intra = (q @ k.transpose(-1, -2)) * decay                       # within-chunk scores, causal
    q_dec = q * cum.exp()[..., None]                                # query reads the state decayed to t
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]              # key's write decayed to chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state.float().clone()
    out = torch.empty_like(u)
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ s                         # what the old state does not predict
        out[:, :, i] = q_dec[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, dv)[:, :, :t].transpose(1, 2)
    return out, s


def chunk_rule(device: torch.device, dtype: torch.dtype):
    """The prompt form for layers of a ``dtype`` model on ``device``, with ``chunk_gated_delta_rule``'s
    contract: fla-core's chunked kernel where it serves (half models on a GPU: its products are
    tf32); on the CPU the C recurrence; else the torch form.
    (Decode steps take ``gated_delta_decode``, or on a GPU gpu/delta_step's launch on the
    slots' states in place: the layer chooses, as it chooses the conv step.)"""
    if fla.serves(device, dtype):
        return fla.chunk
    if native.serves(device):
        return _native_chunk
    return chunk_gated_delta_rule


def _native_chunk(q, k, v, g, beta, state):
    """The C recurrence, or the torch chunked form where autograd must see the ops or the heads
    are wider than the C kernel's scratch."""
    if (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, state))) \
            or max(k.shape[-1], v.shape[-1]) > native.MAX_DIM:
        return chunk_gated_delta_rule(q, k, v, g, beta, state)
    return native.chunk(q, k, v, g, beta, state)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv over one sequence, continuing from ``conv_state``.

    x (T, C); conv_state (C, K-1) holding the previous K-1 inputs (oldest first);
    weight (C, K). Returns silu(conv) (T, C) float32 and the new state (C, K-1).
    """
    full = torch.cat([conv_state.float(), x.float().t()], dim=1)     # (C, K-1+T)
    out = F.conv1d(full[None], weight.float()[:, None, :], groups=full.shape[0])[0]  # (C, T)
    return F.silu(out.t()), full[:, -conv_state.shape[1]:]


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """One token for B sequences: x (B, C); conv_state (B, C, K-1). Returns (B, C), new state."""
    # cat and mul promote a half x and weight to float32 themselves: the same values, two fewer
    # launches a layer than converting them first (a copy each, every step on a GPU)
    full = torch.cat([conv_state.float(), x[..., None]], dim=-1)            # (B, C, K) float32
    return F.silu((full * weight).sum(-1)), full[..., 1:]
