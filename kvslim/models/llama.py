"""Dense GQA decoders: ``llama`` (Llama 2/3/3.1), ``qwen2`` (q/k/v biases) and
``qwen3`` (per-head q/k RMSNorm). Every layer is attention, so every layer
carries a KV cache: the contrast case for the hybrids.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..cache import KVLayerSpec
from .base import CausalLM
from .layers import MLP, Attention, DecoderLayer, Rope
from .qwen3_5 import rope_fields, text_config

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    rope_scaling: dict = field(default_factory=dict)
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        d = text_config(d)
        d.update(rope_fields(d))
        if d.get("num_key_value_heads") is None:
            d["num_key_value_heads"] = d["num_attention_heads"]
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    def cache_layout(self, type_k: str = "f16", type_v: str = "f16") -> list[KVLayerSpec]:
        return [KVLayerSpec(self.num_key_value_heads, self.head_dim, type_k, type_v)] * self.num_hidden_layers

    def attention(self) -> Attention:
        qwen2 = self.model_type == "qwen2"                          # biases on q, k, v only
        return Attention(self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                         self.rms_norm_eps, qkv_bias=qwen2 or self.attention_bias,
                         o_bias=self.attention_bias and not qwen2,
                         qk_norm="plain" if self.model_type == "qwen3" else None)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: LlamaConfig):
        layers = [DecoderLayer("self_attn", config.attention(),
                               MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias),
                               config.hidden_size, config.rms_norm_eps, zero_centered=False)
                  for _ in range(config.num_hidden_layers)]
        rope = Rope(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        super().__init__(config, layers, rope, zero_centered_norm=False)


Config = LlamaConfig
Model = LlamaForCausalLM
