"""Weight bytes without loading weights: each of the model's GGUF tensors sized in the type
llama-quantize gives it for a mix (``catalog.WEIGHT_QUANTS``), a GGUF file's real tensor
bytes, or for a Hugging Face folder in its stored dtype, every tensor as ``kvslim run`` loads it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import catalog
from .model import Model
from .tensors import WeightTensor, read_share

# llama.cpp's layer rules: which layers get more bits (llama_tensor_get_type's use_more_bits).
LAYER_RULES = {
    "all": lambda i, n: True,
    "more_bits": lambda i, n: i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2,
    "first_two": lambda i, n: i < 2,
    "first_sixteenth": lambda i, n: i < n // 16,
}


def fit_type(kind: str, cols: int) -> str:
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
            out.append(fit_type(mix.output, t.cols))
        else:
            i, n = (attn_v[t.name], len(attn_v)) if t.role == "attn_v" else (t.layer, n_layers)
            rule = (typ for role, when, typ in mix.rules if role == t.role and LAYER_RULES[when](i, n))
            out.append(fit_type(next(rule, mix.base), t.cols))
    return out


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
        sizes = [tensor_bytes(t, k) for t, k in zip(tensors, tensor_types(tensors, catalog.WEIGHT_QUANTS[quant]))]
        total = sum(sizes)
    sharded = sum(s for t, s in zip(tensors, sizes) if t.sharded)
    reads = [(t.sharded, read_share(model.config, t, s)) for t, s in zip(tensors, sizes)]
    read = sum(r // tp if split else r for split, r in reads)
    return WeightSize(total, total - sharded * (tp - 1) // tp, read)
