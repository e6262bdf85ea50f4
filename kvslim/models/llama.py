"""Dense GQA decoders: ``llama`` (Llama 2/3/3.1), ``qwen2`` (q/k/v biases) and
``qwen3`` (per-head q/k RMSNorm). Every layer is attention, so every layer
carries a KV cache: the contrast case for the hybrids.
"""
from __future__ import annotations

from .base import CausalLM
from .config import LlamaConfig
from .layers import MLP, Attention, DecoderLayer, Rope

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def attention(c: LlamaConfig) -> Attention:
    qwen2 = c.model_type == "qwen2"                                 # biases on q, k, v only
    return Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                     qkv_bias=qwen2 or c.attention_bias, o_bias=c.attention_bias and not qwen2,
                     qk_norm="plain" if c.model_type == "qwen3" else None)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: LlamaConfig):
        layers = [DecoderLayer("self_attn", attention(config),
                               MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias),
                               config.hidden_size, config.rms_norm_eps, zero_centered=False)
                  for _ in range(config.num_hidden_layers)]
        rope = Rope(config.head_dim, config.rope_theta, config.partial_rotary_factor, config.rope_scaling)
        super().__init__(config, layers, rope, zero_centered_norm=False)


Config = LlamaConfig
Model = LlamaForCausalLM
