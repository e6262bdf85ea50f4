"""What a Hugging Face checkpoint is called in a GGUF file, as data.

Sources (checked against, not copied from):
- tensor and key names: the ``gguf`` package 0.19 (``constants.py``: TENSOR_NAMES
  and the per-arch MODEL_TENSORS lists; ``tensor_mapping.py``: which HF name maps
  to which tensor), and llama.cpp's loaders ``src/models/{qwen35,qwen35moe,
  qwen3next}.cpp`` (which tensors and shapes the C++ side asks for);
- layout conventions: llama.cpp's converter (``conversion/qwen.py``,
  ``conversion/llama.py``, ``conversion/base.py``; older single-file
  ``convert_hf_to_gguf.py``). Each convention below says where it comes from.

The conventions themselves are applied in ``writer.py`` (HF -> GGUF) and undone in
``reader.py`` (GGUF -> HF); the permutations they share live here so that the
two directions cannot drift apart.
"""
from __future__ import annotations

import numpy as np

# ----- architectures ------------------------------------------------------------
# HF model_type -> general.architecture. qwen3_5 / qwen3_5_moe (multimodal wrappers)
# export their text model, as the converter's Qwen3_5TextModel / Qwen3_5MoeTextModel do.
# Mistral checkpoints go through the converter's LlamaModel, hence "llama".
GGUF_ARCH = {
    "qwen3_5": "qwen35", "qwen3_5_text": "qwen35",
    "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
    "qwen3_next": "qwen3next",
    "llama": "llama", "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "qwen3_moe": "qwen3moe",             # plan-only in kvslim: named for the planner's accounting
}

# general.architecture -> the HF model_type read_config reports (text configs).
HF_MODEL_TYPE = {
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
    "qwen3next": "qwen3_next",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
}

HYBRID = frozenset({"qwen35", "qwen35moe", "qwen3next"})
MOE = frozenset({"qwen35moe", "qwen3next"})
# Value heads reordered grouped -> tiled: conversion/qwen.py _LinearAttentionVReorderBase,
# subclassed only by Qwen3_5TextModel and Qwen3_5MoeTextModel (not Qwen3NextModel).
TILED_VALUE_HEADS = frozenset({"qwen35", "qwen35moe"})
# RMSNorm weights stored as 1 + w: conversion/qwen.py Qwen3NextModel.modify_tensors
# ("norm.weight" except "linear_attn.norm.weight"), inherited by both Qwen3.5 classes.
# Gemma's too, every "norm.weight" (the converter's GemmaModel.modify_tensors).
ZERO_CENTRED_NORMS = HYBRID | {"gemma"}
# q/k rows permuted from HF's rotate_half layout to interleaved pairs:
# conversion/llama.py LlamaModel (undo_permute = True). Qwen2Model / Qwen3Model do not
# permute, because llama.cpp runs those archs with NEOX-style (half-split) RoPE.
ROPE_PERMUTED = frozenset({"llama"})

# ----- tensor names -------------------------------------------------------------
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# Per layer: HF name after "model.layers.{i}." -> GGUF name after "blk.{i}.".
_ATTENTION = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_DENSE_MLP = {
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gated DeltaNet. dt_bias is renamed dt_proj.bias by the converter, hence ssm_dt.bias;
# A_log has no ".weight", hence the bare "ssm_a" (llama.cpp: LLM_TENSOR_SSM_A_NOSCAN).
_DELTANET = {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",           # qwen3next: kept fused
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",         # qwen3next, legacy files only
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
# Routed experts: HF's fused gate_up_proj (E, 2I, H) is split into gate / up (Qwen2MoeModel),
# unless the converter ran with --fuse-gate-up-exps (ffn_gate_up_exps, gate rows first).
_MOE = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
EXPERTS_GATE_UP = "mlp.experts.gate_up_proj"
EXPERTS_SPLIT = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
EXPERTS_FUSED = "ffn_gate_up_exps.weight"


def _post_norm(gguf_name: str) -> dict[str, str]:
    return {"post_attention_layernorm.weight": gguf_name}


# The hybrids list ATTN_POST_NORM (post_attention_norm) and no FFN_NORM in MODEL_TENSORS,
# so tensor_mapping sends post_attention_layernorm there; the dense archs use ffn_norm.
LAYER_TENSORS: dict[str, dict[str, str]] = {
    "qwen35": {**_ATTENTION, **_DELTANET, **_DENSE_MLP, **_post_norm("post_attention_norm.weight")},
    "qwen35moe": {**_ATTENTION, **_DELTANET, **_MOE, **_post_norm("post_attention_norm.weight")},
    "qwen3next": {**_ATTENTION, **_DELTANET, **_MOE, **_post_norm("post_attention_norm.weight")},
    "llama": {**_ATTENTION, **_DENSE_MLP, **_post_norm("ffn_norm.weight")},
    "qwen2": {**_ATTENTION, **_DENSE_MLP, **_post_norm("ffn_norm.weight")},
    "qwen3": {**_ATTENTION, **_DENSE_MLP, **_post_norm("ffn_norm.weight")},
    "gemma": {**_ATTENTION, **_DENSE_MLP, **_post_norm("ffn_norm.weight")},
    "qwen3moe": {**_ATTENTION, **_DENSE_MLP, **_MOE, **_post_norm("ffn_norm.weight")},
}

# Tensors the converter always writes as F32 whatever --outtype says
# (conversion/base.py prepare_tensors): every 1-d tensor, every "*_norm.weight",
# names not ending in ".weight" (ssm_a, ssm_dt.bias, biases), and by type
# FFN_GATE_INP (router), FFN_GATE_INP_SHEXP (shared-expert gate) and SSM_CONV1D.
F32_BY_NAME = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def stays_f32(name: str, ndim: int) -> bool:
    """Whether the converter writes GGUF tensor ``name`` as F32 whatever the output type."""
    return ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or name.endswith(F32_BY_NAME)


# Routers: one small matrix every GPU keeps whole under tensor parallelism (vLLM's gates
# are ReplicatedLinear), unlike the projections, which are split.
ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def gguf_arch(model_type: str) -> str:
    """general.architecture for a Hugging Face model_type; ValueError listing the known ones."""
    if model_type not in GGUF_ARCH:
        raise ValueError(f"model_type {model_type!r} has no GGUF architecture; known: {', '.join(sorted(GGUF_ARCH))}")
    return GGUF_ARCH[model_type]


def tensor_shapes(arch: str, hf_name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensor(s) one Hugging Face parameter is stored as, with their shapes (rows
    first, as the writer hands arrays to gguf), values untouched: the fused experts' gate_up
    split in two, conv1d's (C, 1, K) squeezed. Qwen3-Next's fused in_proj_qkvz keeps one
    tensor (ssm_in), the byte-identical layout of its first GGUF files."""
    if hf_name in GLOBAL_TENSORS:
        return [(GLOBAL_TENSORS[hf_name], tuple(shape))]
    parts = hf_name.split(".", 3)
    suffix = parts[3] if len(parts) == 4 and parts[:2] == ["model", "layers"] else None
    if suffix not in LAYER_TENSORS[arch] and suffix != EXPERTS_GATE_UP:
        raise ValueError(f"tensor {hf_name!r} has no GGUF name for arch {arch}")
    block = f"blk.{parts[2]}."
    if suffix == EXPERTS_GATE_UP:
        e, rows, cols = shape
        return [(block + name, (e, rows // 2, cols)) for name in EXPERTS_SPLIT]
    if suffix.endswith("conv1d.weight"):
        shape = (shape[0], shape[-1])
    return [(block + LAYER_TENSORS[arch][suffix], tuple(shape))]

# ----- tokenizer pre-tokenizers (tokenizer.ggml.pre) -------------------------------
# The regexes are those of the original tokenizer.json files, which llama.cpp's
# src/llama-vocab.cpp quotes next to its own C++ spelling of each pre-type.
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-2's byte-level regex (tokenizers' ByteLevel(use_regex=True)). llama.cpp spells it
# without the final "|\s+"; its splitter keeps unmatched spans as pieces, which is the same.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes applied one after the other.
DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+",
                   r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"\p{N}+",
                   r"[0-9][0-9][0-9]")
# LLAMA_VOCAB_PRE_TYPE_STARCODER (and refact, command-r, smollm, codeshell, exaone, minerva,
# which share its regexes): every digit alone, then GPT-2's regex. This is tokenizers'
# Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)], the bundled model's.
STARCODER_REGEXES = (r"\p{N}", GPT2_REGEX)

# pre name -> (regexes split in sequence, ignore_merges). "gpt-2" is GPT-2's own
# byte-level regex (tokenizers' ByteLevel(use_regex=True)), marked by None.
# ignore_merges: llama-vocab.cpp sets it for the LLAMA3 pre-type only, as Llama 3's
# tokenizer.json does.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...] | None, bool]] = {
    "qwen2": ((QWEN2_REGEX,), False),
    "qwen35": ((QWEN35_REGEX,), False),
    "llama-bpe": ((LLAMA3_REGEX,), True),
    "llama3": ((LLAMA3_REGEX,), True),
    "default": (DEFAULT_REGEXES, False),
    "gpt-2": (None, False),              # llama.cpp's name (llama-vocab.cpp); "gpt2" is also read
    "gpt2": (None, False),
    **{name: (STARCODER_REGEXES, False) for name in
       ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva")},
}
# What write_gguf names a tokenizer.json pre-tokenizer, by its steps (pre_tokenizer_steps in
# writer.py; ByteLevel without a regex only maps bytes and is left out).
PRE_NAME_OF_STEPS = {
    (("split", QWEN35_REGEX),): "qwen35",
    (("split", QWEN2_REGEX),): "qwen2",
    (("split", LLAMA3_REGEX),): "llama-bpe",
    (("byte_level_regex",),): "gpt-2",                       # llama.cpp refuses "gpt2" as a pre-type
    (("digits",), ("byte_level_regex",)): "starcoder",
}

# ----- row permutations shared by both directions ---------------------------------
def tiled_value_heads(n_k: int, n_v: int) -> np.ndarray:
    """Index of the grouped value head that lands at each tiled position.

    HF groups value heads by key head ([k0: v0..v{r-1}, k1: ...], head h reads key
    head h // r); qwen35 GGUFs tile them ([k0, k1, ..., k0, k1, ...], head h reads key
    head h % n_k) so ggml can broadcast q/k without an interleaved repeat
    (conversion/qwen.py _LinearAttentionVReorderBase._reorder_v_heads).
    ``tiled = grouped[perm]``; ``grouped = tiled[argsort(perm)]``.
    """
    r = n_v // n_k
    return np.arange(n_v).reshape(n_k, r).T.reshape(-1)


def rope_interleaved_rows(head_dim: int) -> np.ndarray:
    """Index of the HF row that lands at each GGUF row within one q/k head (llama arch).

    HF stores each head as [first halves | second halves] for rotate_half; llama.cpp's
    llama arch rotates adjacent pairs, so the converter (LlamaModel.permute) reorders
    rows to [x0, x_{d/2}, x1, x_{d/2+1}, ...].
    """
    half = head_dim // 2
    return np.arange(head_dim).reshape(2, half).T.reshape(-1)


def expand_rows(perm: np.ndarray, block: int) -> np.ndarray:
    """A permutation of items turned into one of rows when each item spans ``block`` rows."""
    return (perm[:, None] * block + np.arange(block)[None, :]).reshape(-1)


def value_head_index(suffix: str, n_k: int, n_v: int, dk: int, dv: int) -> tuple[int, np.ndarray] | None:
    """(dim, index) reordering a DeltaNet tensor's value heads grouped -> tiled, or None.

    The six cases of _LinearAttentionVReorderBase.modify_tensors: the V rows of
    in_proj_qkv and of the conv1d channels (Q and K untouched), the rows of in_proj_z,
    in_proj_b, in_proj_a, the entries of A_log and dt_bias, and out_proj's columns.
    linear_attn.norm (one weight per value-head dim, shared by all heads) needs none.
    """
    if n_k == n_v or not suffix.startswith("linear_attn."):
        return None
    heads, key_dim = tiled_value_heads(n_k, n_v), n_k * dk
    kind = suffix.split(".")[1]
    if kind in ("in_proj_qkv", "conv1d"):
        return 0, np.concatenate([np.arange(2 * key_dim), 2 * key_dim + expand_rows(heads, dv)])
    if kind == "in_proj_z":
        return 0, expand_rows(heads, dv)
    if kind in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return 0, heads
    if kind == "out_proj":
        return 1, expand_rows(heads, dv)
    return None


def rope_row_index(suffix: str, n_heads: int, n_kv_heads: int, head_dim: int) -> np.ndarray | None:
    """Row index applying LlamaModel.permute to q_proj / k_proj (weights and biases), or None."""
    heads = {"self_attn.q_proj": n_heads, "self_attn.k_proj": n_kv_heads}.get(suffix.rsplit(".", 1)[0])
    if heads is None:
        return None
    return np.concatenate([h * head_dim + rope_interleaved_rows(head_dim) for h in range(heads)])
