"""Qwen3.5 / Qwen3.6 (``qwen3_5``, ``qwen3_5_moe`` and their ``*_text`` configs).

Hybrid decoder: Gated DeltaNet layers (fixed-size recurrent state) and gated
attention layers (KV cache) in a 3:1 pattern; dense SwiGLU or sparse MoE with
a shared expert. The oracle is transformers' ``modeling_qwen3_5.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import gpu
from ..gpu import conv_step as gpu_conv
from ..gpu import delta_step as gpu_step
from .base import CausalLM
from .batch import Batch
from .config import HybridConfig
from .delta_rule import causal_conv, causal_conv_step, chunk_rule, gated_delta_decode, gates, value_heads
from .layers import MLP, AddNorm, Attention, DecoderLayer, RMSNormGated, Rope, SparseMoE, fuse, project

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer with a fixed-size state per sequence."""

    def __init__(self, c: HybridConfig):
        super().__init__()
        self.n_k, self.n_v = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.n_k * self.dk, self.n_v * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)                         # used for its weight (C, 1, K) only
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = RMSNormGated(self.dv, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, c.hidden_size, bias=False)
        self._make_projections(c)

    def _make_projections(self, c: HybridConfig) -> None:
        self.in_proj_qkv = nn.Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.fused = None

    def fuse_projections(self) -> None:
        self.fused = fuse(self, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])

    def project(self, x: torch.Tensor):
        """x (N, hidden) -> qkv (N, conv_dim) in [Q | K | V] order, z (N, Hv, dv), b and a (N, Hv)."""
        if self.fused:
            qkv, z, b, a = self.fused(x)
        else:
            qkv, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return qkv, z.view(x.shape[0], self.n_v, self.dv), b, a

    def forward(self, x: torch.Tensor, batch: Batch, cache, then: AddNorm | None = None):
        """The layer's output projection (N, hidden); with ``then``, (normed, summed) of it (``project``)."""
        n = x.shape[0]
        qkv, z, b, a = self.project(x)
        # in x's dtype: the float32 outputs of the rule are rounded once as they are written
        out = torch.empty(n, self.n_v, self.dv, dtype=x.dtype, device=x.device)
        normed = False
        if batch.is_decode:
            normed = self._decode(qkv, z, a, b, batch, cache, out)
        else:
            g, beta = gates(a, b, self.A_log, self.dt_bias)
            for seg in batch.segments:
                self._prefill(qkv, g, beta, seg, cache, out)
        return project(self.out_proj, (out if normed else self.norm(out, z)).reshape(n, -1), then)

    def _heads(self, mixed: torch.Tensor):
        """Convolved (T, conv_dim) -> q, k (T, Hk, dk) and v (T, Hv, dv), as convolved."""
        t = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return q.reshape(t, self.n_k, self.dk), k.reshape(t, self.n_k, self.dk), v.reshape(t, self.n_v, self.dv)

    def _prefill(self, qkv, g, beta, seg, cache, out) -> None:
        rows = slice(seg.begin, seg.end)
        mixed, cache.conv[seg.slot] = causal_conv(qkv[rows], cache.conv[seg.slot], self.conv1d.weight[:, 0])
        q, k, v = self._heads(mixed)
        q, k = value_heads(q, k, self.n_v)
        chunk = chunk_rule(q.device, qkv.dtype)                       # q, k, v are float32 from the conv
        o, state = chunk(q[None], k[None], v[None], g[None, rows], beta[None, rows], cache.recurrent[seg.slot][None])
        out[rows], cache.recurrent[seg.slot] = o[0], state[0]
        cache.advance(seg.slot, seg.length)

    def _decode(self, qkv, z, a, b, batch, cache, out) -> bool:
        """One token for each sequence, all in one step, from the raw q, k, v and gate inputs
        (``gated_delta_decode``). On a GPU with the kernels on, ``_decode_kernels`` (True
        returned: ``out`` is normed); otherwise consecutive slots are updated in place through
        a view, others gathered and scattered back."""
        normed = False
        if gpu.TRITON and gpu_step.runs_on(qkv) and gpu_conv.runs_on(qkv):
            normed = self._decode_kernels(qkv, z, a, b, batch, cache, out)
        else:
            idx = batch.slot_index()
            mixed, cache.conv[idx] = causal_conv_step(qkv, cache.conv[idx], self.conv1d.weight[:, 0])
            state = cache.recurrent[idx]                            # a view when idx is a slice
            out[:] = gated_delta_decode(*self._heads(mixed), a, b, self.A_log, self.dt_bias, state)
            if not isinstance(idx, slice):
                cache.recurrent[idx] = state
        if not batch.prepared:                                      # else the caller commits lengths
            for seg in batch.segments:
                cache.advance(seg.slot, 1)
        return normed

    def _decode_kernels(self, qkv, z, a, b, batch, cache, out) -> bool:
        """The kernels read and update each slot's conv and recurrent states where the cache keeps
        them: the conv, the rule and the output norm in one launch (``delta_step``'s ``conv``
        and ``norm``), or with the switches off the conv's launch, then the step's, then the
        norm's (the layer's). Returns whether ``out`` is normed."""
        norm = (z, self.norm.weight, self.norm.eps) if gpu_step.NORM_IN_STEP else None
        weight = self.conv1d.weight[:, 0]
        if gpu_step.CONV_IN_STEP:
            heads, conv = self._heads(qkv), (cache.conv, weight)
        else:
            heads, conv = self._heads(gpu_conv.conv_step(qkv, cache.conv, batch.slot_ids, weight)), None
        gpu_step.delta_step(*heads, a, b, self.A_log, self.dt_bias, cache.recurrent, batch.slot_ids, out=out,
                            norm=norm, conv=conv)
        return norm is not None


def feed_forward(c: HybridConfig, layer: int) -> nn.Module:
    if c.uses_moe(layer):
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.shared_expert_intermediate_size, renormalize=c.norm_topk_prob)
    return MLP(c.hidden_size, c.intermediate_size)


def gated_attention(c: HybridConfig) -> Attention:
    return Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                     qkv_bias=c.attention_bias, o_bias=c.attention_bias, gated=True, qk_norm="zero_centered")


def build_layers(c: HybridConfig, delta_net: type[GatedDeltaNet]) -> list[DecoderLayer]:
    layers = []
    for i, kind in enumerate(c.layer_types):
        if kind == "full_attention":
            name, mixer = "self_attn", gated_attention(c)
        elif kind == "linear_attention":
            name, mixer = "linear_attn", delta_net(c)
        else:
            raise ValueError(f"layer {i}: unknown layer type {kind!r}; expected full_attention or linear_attention")
        layers.append(DecoderLayer(name, mixer, feed_forward(c, i), c.hidden_size, c.rms_norm_eps,
                                   zero_centered=True))
    return layers


class Qwen35ForCausalLM(CausalLM):
    def __init__(self, config: HybridConfig):
        rope = Rope(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        super().__init__(config, build_layers(config, GatedDeltaNet), rope, zero_centered_norm=True)


Config = HybridConfig
Model = Qwen35ForCausalLM
