"""Weight bytes without loading weights: each of the model's GGUF tensors sized in the type
llama-quantize gives it for a mix (``catalog.WEIGHT_QUANTS``), a GGUF file's real tensor
bytes, or for a Hugging Face folder in its stored dtype, every tensor as ``kvslim run`` loads it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import catalog
from .model import Model
from .tensors import WeightTensor, read_share

@dataclass(frozen=True)
class Place:
    """Where a tensor sits, for a mix's rules: ``index`` of ``count`` (attn_v: among the attn_v
    tensors; else its layer of the layers), ``counted``: its place among its role's tensors in
    file order (llama.cpp's running counters), and the model's GQA ratio and routed experts."""
    index: int
    count: int
    counted: int
    n_layers: int
    n_gqa: int
    n_experts: int


# llama.cpp's rules: which tensors of a role get the override (use_more_bits and the rest of
# llama_tensor_get_type's conditions).
RULES = {
    "all": lambda p: True,
    "more_bits": lambda p: p.index < p.count // 8 or p.index >= 7 * p.count // 8 or (p.index - p.count // 8) % 3 == 2,
    "first_two": lambda p: p.index < 2,
    "first_sixteenth": lambda p: p.index < p.count // 16,
    "first_eighth": lambda p: p.index < p.count // 8,
    # the IQ1/IQ2 mixes count ffn_down tensors (an expert layer's shared expert too) against layers
    "first_eighth_counted": lambda p: p.counted < p.n_layers // 8,
    "gqa4": lambda p: p.n_gqa >= 4,
    "gqa4_or_experts4": lambda p: p.n_gqa >= 4 or p.n_experts >= 4,
}


def fit_type(kind: str, cols: int) -> str:
    """llama-quantize's fallback for rows that are not a whole number of blocks."""
    if cols % catalog.WEIGHT_TYPES[kind][0]:
        kind = catalog.WEIGHT_FALLBACK.get(kind, "f16")
    return kind if cols % catalog.WEIGHT_TYPES[kind][0] == 0 else "f16"


def tensor_types(tensors: list[WeightTensor], mix: catalog.WeightMix, n_gqa: int = 1, n_experts: int = 0) -> list[str]:
    """The ggml type llama-quantize gives each tensor for ``mix``, for a model whose attention
    has ``n_gqa`` query heads per KV head and ``n_experts`` routed experts."""
    attn_v = {t.name: k for k, t in enumerate(t for t in tensors if t.role == "attn_v")}
    n_layers = 1 + max(t.layer for t in tensors)
    tied = not any(t.role == "output" for t in tensors)  # a tied embedding is quantized as the output
    seen: dict[str, int] = {}
    out = []
    for t in tensors:
        counted = seen.get(t.role, 0)
        seen[t.role] = counted + 1
        if not t.quantizable:
            out.append("f32")
        elif t.role == "output" or (tied and t.role == "token_embd"):
            out.append(fit_type(mix.output, t.cols))
        elif mix.experts and t.experts > 1:
            out.append(fit_type(mix.experts, t.cols))
        elif t.role == "token_embd":
            out.append(fit_type(mix.token_embd or mix.base, t.cols))
        else:
            i, n = (attn_v[t.name], len(attn_v)) if t.role == "attn_v" else (t.layer, n_layers)
            place = Place(i, n, counted, n_layers, n_gqa, n_experts)
            rule = (typ for role, when, typ in mix.rules if role == t.role and RULES[when](place))
            out.append(fit_type(next(rule, mix.base), t.cols))
    return out


def model_facts(config) -> tuple[int, int]:
    """(query heads per KV head, routed experts) of a config, as llama.cpp's rules read them."""
    kv = getattr(config, "num_key_value_heads", 0) or 0
    return (config.num_attention_heads // kv if kv else 0), (getattr(config, "num_experts", 0) or 0)


def tensor_bytes(t: WeightTensor, kind: str) -> int:
    """Bytes of ``t`` stored as ggml type ``kind``."""
    block, block_bytes = catalog.WEIGHT_TYPES[kind]
    return t.experts * t.rows * (t.cols // block) * block_bytes


@dataclass(frozen=True)
class WeightSize:
    """Weight bytes: the whole model, one GPU's share, and what one decode step reads on it."""

    total: int
    per_gpu: int
    read_per_token: int


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
def weight_size(model: Model, quant: str, tp: int = 1) -> WeightSize:
    """Weight bytes for a mix name from ``catalog.WEIGHT_QUANTS``, or "gguf": the file's real
    tensor bytes, spread over the tensors in proportion to their parameters (its per-tensor
    types are not read) to split them across GPUs and to find what a token reads. A Hugging
    Face folder planned in its stored dtype counts every tensor, vectors too, in that dtype:
    the bytes ``kvslim run`` holds once it has loaded the folder as stored."""
    tensors = model.tensors
    if quant == "gguf":
        n_params = sum(t.params for t in tensors)
        sizes = [t.params * model.gguf_bytes // n_params for t in tensors]
        total = model.gguf_bytes
    elif model.source == "hf" and quant == model.stored_quant:
        sizes = [tensor_bytes(t, quant) for t in tensors]
        total = sum(sizes)
    else:
        kinds = tensor_types(tensors, catalog.WEIGHT_QUANTS[quant], *model_facts(model.config))
        sizes = [tensor_bytes(t, k) for t, k in zip(tensors, kinds)]
        total = sum(sizes)
    sharded = sum(s for t, s in zip(tensors, sizes) if t.sharded)
    reads = [(t.sharded, read_share(model.config, t, s)) for t, s in zip(tensors, sizes)]
    read = sum(r // tp if split else r for split, r in reads)
    return WeightSize(total, total - sharded * (tp - 1) // tp, read)
