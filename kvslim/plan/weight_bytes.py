"""Weight bytes without loading weights: a GGUF-style tensor list derived from
the config, each tensor sized in the type llama-quantize gives it for a mix
(``catalog.WEIGHT_QUANTS``), or a GGUF file's real tensor bytes."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import models
from ..gguf import names
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


def _weight_tensor(name: str, shape: tuple[int, ...]) -> WeightTensor:
    """A GGUF tensor from its name and (experts, rows, cols) shape; 1-D tensors are one row."""
    *experts, rows, cols = (1, *shape) if len(shape) == 1 else shape
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    return WeightTensor(name.removesuffix(".weight"), layer, rows, cols, experts[0] if experts else 1,
                        quantizable=not names.stays_f32(name, len(shape)),
                        sharded=len(shape) > 1 and not name.endswith(names.ROUTERS))


def weight_tensors(c) -> list[WeightTensor]:
    """Every weight of the text decoder as a GGUF file names and shapes it, in the model's
    layer order: the model's own parameters (built on the meta device) mapped through
    ``gguf.names``. Vision towers and MTP heads are not counted: llama-server loads neither
    with the decoder, and kvslim's models have none."""
    arch = names.gguf_arch(c.model_type)
    return [_weight_tensor(name, shape) for hf_name, hf_shape in models.parameter_shapes(c).items()
            for name, shape in names.tensor_shapes(arch, hf_name, hf_shape)]


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
