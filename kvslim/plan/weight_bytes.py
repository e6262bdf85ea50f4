"""Weight bytes without loading weights: a GGUF-style tensor list derived from
the config, each tensor sized in the type llama-quantize gives it for a mix
(``catalog.WEIGHT_QUANTS``), or a GGUF file's real tensor bytes."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import catalog

if TYPE_CHECKING:
    from .planner import Model


@dataclass(frozen=True)
class WeightTensor:
    """One weight as a GGUF file would store it."""

    name: str                 # llama.cpp's name without ".weight", e.g. "blk.3.ffn_down_exps"
    layer: int                # -1 outside the blocks
    rows: int                 # output features
    cols: int                 # input features: the row quantized in blocks
    experts: int = 1          # routed experts stacked in one tensor
    quantizable: bool = True  # vectors, routers and conv kernels stay f32
    sharded: bool = True      # split across tensor-parallel GPUs (else replicated)

    @property
    def params(self) -> int:
        return self.experts * self.rows * self.cols

    @property
    def role(self) -> str:
        """llama.cpp's category for type choice: attn_v, ffn_down, attn_output, output, token_embd."""
        base = self.name.split(".")[-1]
        if base in ("attn_v", "attn_qkv"):
            return "attn_v"
        return "ffn_down" if base.startswith("ffn_down") else base


def _matrix(name: str, layer: int, rows: int, cols: int, experts: int = 1) -> WeightTensor:
    return WeightTensor(name, layer, rows, cols, experts)


def _vector(name: str, layer: int, n: int) -> WeightTensor:
    return WeightTensor(name, layer, 1, n, quantizable=False, sharded=False)


def _is_hybrid(c) -> bool:
    return hasattr(c, "layer_types")


def _layer_types(c) -> list[str]:
    return list(c.layer_types) if _is_hybrid(c) else ["full_attention"] * c.num_hidden_layers


def _uses_moe(c, layer: int) -> bool:
    return getattr(c, "num_experts", 0) > 0 and c.uses_moe(layer)


def _attention(c, i: int) -> list[WeightTensor]:
    p, h = f"blk.{i}.", c.hidden_size
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    gate = 2 if _is_hybrid(c) else 1                # gated attention projects a gate beside each query
    out = [_matrix(p + "attn_q", i, gate * q_width, h), _matrix(p + "attn_k", i, kv_width, h),
           _matrix(p + "attn_v", i, kv_width, h), _matrix(p + "attn_output", i, h, q_width)]
    if c.model_type not in ("llama", "mistral", "qwen2"):   # per-head q/k RMSNorm
        out += [_vector(p + "attn_q_norm", i, c.head_dim), _vector(p + "attn_k_norm", i, c.head_dim)]
    if c.model_type == "qwen2" or c.attention_bias:
        out += [_vector(p + "attn_q.bias", i, q_width), _vector(p + "attn_k.bias", i, kv_width),
                _vector(p + "attn_v.bias", i, kv_width)]
    return out


def _delta_net(c, i: int) -> list[WeightTensor]:
    p, h, n_v = f"blk.{i}.", c.hidden_size, c.linear_num_value_heads
    key_dim, value_dim = c.linear_num_key_heads * c.linear_key_head_dim, n_v * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    if c.model_type == "qwen3_next":                # q, k, v, z and b, a fused per key head
        proj = [_matrix(p + "ssm_in", i, conv_dim + value_dim, h), _matrix(p + "ssm_ba", i, 2 * n_v, h)]
    else:
        proj = [_matrix(p + "attn_qkv", i, conv_dim, h), _matrix(p + "attn_gate", i, value_dim, h),
                _matrix(p + "ssm_beta", i, n_v, h), _matrix(p + "ssm_alpha", i, n_v, h)]
    conv = WeightTensor(p + "ssm_conv1d", i, conv_dim, c.linear_conv_kernel_dim, quantizable=False)
    return proj + [conv, _vector(p + "ssm_dt", i, n_v), _vector(p + "ssm_a", i, n_v),
                   _vector(p + "ssm_norm", i, c.linear_value_head_dim), _matrix(p + "ssm_out", i, h, value_dim)]


def _feed_forward(c, i: int) -> list[WeightTensor]:
    p, h = f"blk.{i}.", c.hidden_size
    if not _uses_moe(c, i):
        f = c.intermediate_size
        return [_matrix(p + "ffn_gate", i, f, h), _matrix(p + "ffn_up", i, f, h), _matrix(p + "ffn_down", i, h, f)]
    e, f = c.num_experts, c.moe_intermediate_size
    out = [WeightTensor(p + "ffn_gate_inp", i, e, h, quantizable=False, sharded=False),
           _matrix(p + "ffn_gate_exps", i, f, h, e), _matrix(p + "ffn_up_exps", i, f, h, e),
           _matrix(p + "ffn_down_exps", i, h, f, e)]
    s = getattr(c, "shared_expert_intermediate_size", 0)
    if s:
        out += [_matrix(p + "ffn_gate_shexp", i, s, h), _matrix(p + "ffn_up_shexp", i, s, h),
                _matrix(p + "ffn_down_shexp", i, h, s), _vector(p + "ffn_gate_inp_shexp", i, h)]  # (h, 1): 1-D to ggml
    return out


def weight_tensors(c) -> list[WeightTensor]:
    """Every weight of the text decoder, in llama.cpp's layer order (vision towers and
    MTP heads are not counted: llama-server loads neither with the decoder)."""
    h = c.hidden_size
    out = [_matrix("token_embd", -1, c.vocab_size, h)]
    for i, kind in enumerate(_layer_types(c)):
        out.append(_vector(f"blk.{i}.attn_norm", i, h))
        out += _attention(c, i) if kind == "full_attention" else _delta_net(c, i)
        out.append(_vector(f"blk.{i}.post_attention_norm", i, h))
        out += _feed_forward(c, i)
    out.append(_vector("output_norm", -1, h))
    if not c.tie_word_embeddings:
        out.append(_matrix("output", -1, c.vocab_size, h))
    return out


def parameter_counts(c) -> tuple[int, int]:
    """(total, active per token) parameters; active counts top-k of the routed experts and,
    by the usual convention, the embeddings."""
    tensors = weight_tensors(c)
    active = sum(t.params if t.role == "token_embd" else _read_share(c, t, t.params) for t in tensors)
    return sum(t.params for t in tensors), active


# llama.cpp's layer rules: which layers get more bits (llama_tensor_get_type's use_more_bits).
LAYER_RULES = {
    "all": lambda i, n: True,
    "more_bits": lambda i, n: i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2,
    "first_two": lambda i, n: i < 2,
    "first_sixteenth": lambda i, n: i < n // 16,
}


def _fit_type(kind: str, cols: int) -> str:
    """llama-quantize's fallback for rows that are not a whole number of blocks."""
    if cols % catalog.WEIGHT_TYPES[kind][0]:
        kind = catalog.WEIGHT_FALLBACK.get(kind, "f16")
    return kind if cols % catalog.WEIGHT_TYPES[kind][0] == 0 else "f16"


def tensor_types(tensors: list[WeightTensor], mix: catalog.WeightMix) -> list[str]:
    """The ggml type llama-quantize gives each tensor for ``mix``."""
    attn_v = {t.name: k for k, t in enumerate(t for t in tensors if t.role == "attn_v")}
    n_layers = 1 + max(t.layer for t in tensors)
    tied = not any(t.role == "output" for t in tensors)  # a tied embedding is quantized as the output
    out = []
    for t in tensors:
        if not t.quantizable:
            out.append("f32")
        elif t.role == "output" or (tied and t.role == "token_embd"):
            out.append(_fit_type(mix.output, t.cols))
        else:
            i, n = (attn_v[t.name], len(attn_v)) if t.role == "attn_v" else (t.layer, n_layers)
            rule = (typ for role, when, typ in mix.rules if role == t.role and LAYER_RULES[when](i, n))
            out.append(_fit_type(next(rule, mix.base), t.cols))
    return out


def tensor_bytes(t: WeightTensor, kind: str) -> int:
    """Bytes of ``t`` stored as ggml type ``kind``."""
    block, block_bytes = catalog.WEIGHT_TYPES[kind]
    return t.experts * t.rows * (t.cols // block) * block_bytes


@dataclass(frozen=True)
class Weights:
    """Weight bytes: the whole model, one GPU's share, and what one decode step reads on it."""

    total: int
    per_gpu: int
    read_per_token: int


def _read_share(c, t: WeightTensor, size: int) -> int:
    """Of ``size`` bytes of ``t``, what one decoded token reads: the top-k routed experts,
    one embedding row, everything else."""
    if t.role == "token_embd":
        return size // t.rows
    return size * c.num_experts_per_tok // t.experts if t.experts > 1 else size


def weight_quant_names(model: Model) -> list[str]:
    return list(catalog.WEIGHT_QUANTS) + (["gguf"] if model.gguf_bytes else [])


def check_weight_quant(model: Model, name: str) -> str:
    """``name`` normalised; raises ValueError listing the valid names."""
    key = name.strip().lower()
    if key not in weight_quant_names(model):
        raise ValueError(f"unknown weight quantization {name!r}; valid: {', '.join(weight_quant_names(model))}"
                         + ("" if model.gguf_bytes else " (gguf: only with a GGUF file)"))
    return key


@functools.lru_cache(maxsize=256)
def weights(model: Model, quant: str, tp: int = 1) -> Weights:
    """Weight bytes for a mix name from ``catalog.WEIGHT_QUANTS``, or "gguf": the file's real
    tensor bytes, spread over the tensors in proportion to their parameters (its per-tensor
    types are not read) to split them across GPUs and to find what a token reads."""
    tensors = model.tensors
    if quant == "gguf":
        n_params = sum(t.params for t in tensors)
        sizes = [t.params * model.gguf_bytes // n_params for t in tensors]
        total = model.gguf_bytes
    else:
        sizes = [tensor_bytes(t, k) for t, k in zip(tensors, tensor_types(tensors, catalog.WEIGHT_QUANTS[quant]))]
        total = sum(sizes)
    sharded = sum(s for t, s in zip(tensors, sizes) if t.sharded)
    reads = [(t.sharded, _read_share(model.config, t, s)) for t, s in zip(tensors, sizes)]
    read = sum(r // tp if split else r for split, r in reads)
    return Weights(total, total - sharded * (tp - 1) // tp, read)
