"""Qwen3-Next / Qwen3-Coder-Next (``qwen3_next``).

Same hybrid decoder as Qwen3.5 (blocks imported from ``qwen3_5``); the
DeltaNet projections are fused and grouped per key head: ``in_proj_qkvz`` holds,
for each key head, [q | k | its value heads' v | their z], and ``in_proj_ba``
holds [b | a] for the value heads of each key head.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import CausalLM
from .layers import Rope, fuse
from .qwen3_5 import GatedDeltaNet, HybridConfig, build_layers

MODEL_TYPES = ("qwen3_next",)


class FusedGatedDeltaNet(GatedDeltaNet):
    def _make_projections(self, c: HybridConfig) -> None:
        self.in_proj_qkvz = nn.Linear(c.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(c.hidden_size, 2 * self.n_v, bias=False)
        self.fused = None

    def fuse_projections(self) -> None:
        self.fused = fuse(self, ["in_proj_qkvz", "in_proj_ba"])

    def project(self, x: torch.Tensor):
        n, rep = x.shape[0], self.n_v // self.n_k
        qkvz, ba = self.fused(x) if self.fused else (self.in_proj_qkvz(x), self.in_proj_ba(x))
        qkvz = qkvz.reshape(n, self.n_k, 2 * self.dk + 2 * rep * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, rep * self.dv, rep * self.dv], dim=-1)
        b, a = torch.split(ba.reshape(n, self.n_k, 2 * rep), [rep, rep], dim=-1)
        qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return qkv, z.reshape(n, self.n_v, self.dv), b.reshape(n, self.n_v), a.reshape(n, self.n_v)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, config: HybridConfig):
        rope = Rope(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        super().__init__(config, build_layers(config, FusedGatedDeltaNet), rope, zero_centered_norm=True)


Config = HybridConfig
Model = Qwen3NextForCausalLM
