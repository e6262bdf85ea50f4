"""Gemma (``gemma``, Gemma 1): a dense GQA decoder like Llama, except that

- RMSNorm weights are zero-centred (the norm multiplies by ``1 + w``), as in the hybrids;
- the feed-forward is GeGLU: GELU (tanh approximation) where Llama has SiLU;
- embeddings are multiplied by sqrt(hidden_size) before the first layer, while the
  tied output head reads the unscaled table.

The oracle is transformers' ``modeling_gemma.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import CausalLM
from .config import DecoderConfig
from .layers import MLP, AddNorm, Attention, DecoderLayer, Rope, project

MODEL_TYPES = ("gemma",)
GELU_TANH = ("gelu_pytorch_tanh", "gelu")   # transformers reads the legacy "gelu" as the tanh form too


@dataclass(kw_only=True)
class GemmaConfig(DecoderConfig):
    intermediate_size: int = field()    # required here (field(): not the base's default)
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_act not in GELU_TANH:
            raise ValueError(f"gemma: hidden_act {self.hidden_act!r} is not supported; expected one of {GELU_TANH}")


class GeGLU(MLP):
    """down(gelu_tanh(gate(x)) * up(x)): the SwiGLU block with GELU in place of SiLU."""

    def forward(self, x: torch.Tensor, then: AddNorm | None = None):
        gate, up = self.fused(x) if self.fused else (self.gate_proj(x), self.up_proj(x))
        return project(self.down_proj, F.gelu(gate, approximate="tanh") * up, then)


class EmbeddingScaledLayer(DecoderLayer):
    """The first decoder layer, scaling its input (the embeddings) by sqrt(hidden_size) in the
    activations' dtype, as transformers' GemmaTextScaledWordEmbedding does. Scaling here, not in
    the table, keeps the tied head and any quantized embedding unchanged."""

    def forward(self, x: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        # sqrt(hidden) rounded to the activations' dtype on the host: a number, not a tensor
        # copied to the device every forward (the first layer: no earlier MLP output pending)
        scale = torch.tensor(self.input_layernorm.weight.shape[0] ** 0.5, dtype=x.dtype).item()
        return super().forward(x * scale, *args)


def decoder_layer(c: GemmaConfig, first: bool) -> DecoderLayer:
    attention = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                          qkv_bias=c.attention_bias, o_bias=c.attention_bias)
    layer = EmbeddingScaledLayer if first else DecoderLayer
    return layer("self_attn", attention, GeGLU(c.hidden_size, c.intermediate_size), c.hidden_size, c.rms_norm_eps,
                 zero_centered=True)


class GemmaForCausalLM(CausalLM):
    def __init__(self, config: GemmaConfig):
        layers = [decoder_layer(config, i == 0) for i in range(config.num_hidden_layers)]
        rope = Rope(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        super().__init__(config, layers, rope, zero_centered_norm=True)


Config = GemmaConfig
Model = GemmaForCausalLM
