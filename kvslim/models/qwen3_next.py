"""Qwen3-Next / Qwen3-Coder-Next (``qwen3_next``).

Same hybrid decoder as Qwen3.5 (blocks imported from ``qwen3_5``); the
DeltaNet projections are fused and grouped per key head: ``in_proj_qkvz`` holds,
for each key head, [q | k | its value heads' v | their z], and ``in_proj_ba``
holds [b | a] for the value heads of each key head.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats.base import cached_on
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
        """As ``GatedDeltaNet.project``: the per-key-head groups put in Qwen3.5's order, [all q | all
        k | all v | all z] and [all b | all a], by one column gather each (``_orders``). Splitting
        each group and concatenating the kinds copied q, k, v (then their cat), z, b and a: 8
        launches a layer on a GPU, 2 now; the rest are views."""
        n = x.shape[0]
        qkvz, ba = self.fused(x) if self.fused else (self.in_proj_qkvz(x), self.in_proj_ba(x))
        qkvz_order, ba_order = _orders(self.n_k, self.dk, self.n_v // self.n_k, self.dv, x.device)
        qkvz, ba = qkvz.index_select(-1, qkvz_order), ba.index_select(-1, ba_order)
        qkv, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        b, a = ba.split([self.n_v, self.n_v], dim=-1)
        return qkv, z.view(n, self.n_v, self.dv), b, a


def _orders(n_k: int, dk: int, rep: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns of in_proj_qkvz's and in_proj_ba's outputs in Qwen3.5's order: key head h's
    group of in_proj_qkvz is [q (dk) | k (dk) | v (rep dv) | z (rep dv)] and of in_proj_ba
    [b (rep) | a (rep)]; taken kind by kind, head by head."""
    def order(sizes: list[int]) -> torch.Tensor:
        width, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
        return torch.cat([torch.arange(h * width + start, h * width + start + size)
                          for start, size in zip(starts, sizes) for h in range(n_k)])
    key = ("qwen3_next_orders", n_k, dk, rep, dv)
    return (cached_on(device, key + ("qkvz",), lambda: order([dk, dk, rep * dv, rep * dv])),
            cached_on(device, key + ("ba",), lambda: order([rep, rep])))


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, config: HybridConfig):
        rope = Rope(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        super().__init__(config, build_layers(config, FusedGatedDeltaNet), rope, zero_centered_norm=True)


Config = HybridConfig
Model = Qwen3NextForCausalLM
