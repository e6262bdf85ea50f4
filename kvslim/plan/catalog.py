"""The planner's tables: models (as config.json dicts), machines, weight types and mixes,
and how kvslim's cache types map onto vLLM's and llama-server's.

Everything here is data. Sizes that follow from it (parameter counts, bytes
per weight, KV bytes) are computed in the planner (``fit.py``, ``weight_size.py``), never typed in.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# ----- models -----------------------------------------------------------------
# Text-model config.json values (the fields the planner reads). Vision towers and
# multi-token-prediction heads are not listed: llama-server loads the vision tower
# from a separate mmproj file and the decoder does not need the MTP head.

_HYBRID = dict(full_attention_interval=4, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, linear_num_key_heads=16, max_position_embeddings=262_144,
               rope_theta=10_000_000.0, partial_rotary_factor=0.25, tie_word_embeddings=False)
_QWEN35_MOE = dict(_HYBRID, model_type="qwen3_5_moe_text", vocab_size=248_320, hidden_size=2048,
                   num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                   num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512)
_QWEN35_27B = dict(_HYBRID, model_type="qwen3_5_text", vocab_size=248_320, hidden_size=5120, num_hidden_layers=64,
                   num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48,
                   intermediate_size=17_408)
_QWEN3_NEXT = dict(_HYBRID, model_type="qwen3_next", vocab_size=151_936, hidden_size=2048, num_hidden_layers=48,
                   num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32, num_experts=512,
                   num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512)


@dataclass(frozen=True)
class CatalogModel:
    """A built-in model: its Hugging Face repository (for launch lines) and text config."""

    hf_id: str
    config: dict


MODELS: dict[str, CatalogModel] = {
    "qwen3.6-27b": CatalogModel("Qwen/Qwen3.6-27B", _QWEN35_27B),
    "qwen3.6-35b-a3b": CatalogModel("Qwen/Qwen3.6-35B-A3B", _QWEN35_MOE),
    "qwen3.5-27b": CatalogModel("Qwen/Qwen3.5-27B", _QWEN35_27B),
    "qwen3.5-35b-a3b": CatalogModel("Qwen/Qwen3.5-35B-A3B", _QWEN35_MOE),
    "qwen3.5-397b-a17b": CatalogModel("Qwen/Qwen3.5-397B-A17B", dict(
        _QWEN35_MOE, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
        linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024)),
    "qwen3-next-80b-a3b": CatalogModel("Qwen/Qwen3-Next-80B-A3B-Instruct", _QWEN3_NEXT),
    "qwen3-coder-next": CatalogModel("Qwen/Qwen3-Coder-Next", dict(_QWEN3_NEXT, rope_theta=5_000_000.0)),
    "llama-3.1-8b": CatalogModel("meta-llama/Llama-3.1-8B-Instruct", dict(
        model_type="llama", vocab_size=128_256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=14_336, max_position_embeddings=131_072,
        rope_theta=500_000.0, tie_word_embeddings=False)),
    "qwen3-32b": CatalogModel("Qwen/Qwen3-32B", dict(
        model_type="qwen3", vocab_size=151_936, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, intermediate_size=25_600, max_position_embeddings=40_960,
        rope_theta=1_000_000.0, tie_word_embeddings=False)),
    "qwen3-30b-a3b": CatalogModel("Qwen/Qwen3-30B-A3B", dict(
        model_type="qwen3_moe", vocab_size=151_936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, max_position_embeddings=40_960, rope_theta=1_000_000.0,
        tie_word_embeddings=False)),
}

# ----- machines -------------------------------------------------------------------
MIB = 1 << 20
GIB = 1 << 30
# Before any buffer is allocated the CUDA context and library workspaces take
# roughly 0.3-0.5 GiB of an NVIDIA GPU; 512 MiB is a round allowance for them.
NVIDIA_RESERVE = 512 * MIB
# macOS lets the GPU wire about 2/3 of unified memory on small machines and about
# 3/4 on large ones (Metal's recommendedMaxWorkingSetSize); `sudo sysctl
# iogpu.wired_limit_mb=N` raises it, or pass --mem with the figure you set.
APPLE_GPU_SHARE_SMALL, APPLE_GPU_SHARE_LARGE, APPLE_LARGE_FROM = 2 / 3, 3 / 4, 36 * GIB


@dataclass(frozen=True)
class Hardware:
    """One machine: memory as ``nvidia-smi`` (MiB) or Apple (GiB) states it, peak bandwidth in GB/s."""

    label: str
    memory_mib: int
    bandwidth_gbs: float
    vendor: str  # "nvidia" or "apple"

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def usable_bytes(self) -> int:
        """What a model may occupy: NVIDIA memory less the runtime reserve, Apple's GPU share."""
        if self.vendor == "nvidia":
            return self.memory_bytes - NVIDIA_RESERVE
        share = APPLE_GPU_SHARE_LARGE if self.memory_bytes >= APPLE_LARGE_FROM else APPLE_GPU_SHARE_SMALL
        return int(self.memory_bytes * share)


#              name                    label                        MiB     GB/s   vendor
HARDWARE: dict[str, Hardware] = {
    "rtx3090": Hardware("NVIDIA RTX 3090", 24_576, 936.0, "nvidia"),
    "rtx4090": Hardware("NVIDIA RTX 4090", 24_564, 1008.0, "nvidia"),
    "rtx5090": Hardware("NVIDIA RTX 5090", 32_607, 1792.0, "nvidia"),
    "rtx4060ti-16gb": Hardware("NVIDIA RTX 4060 Ti 16GB", 16_380, 288.0, "nvidia"),
    "h100": Hardware("NVIDIA H100 80GB SXM", 81_559, 3350.0, "nvidia"),
    "h100-pcie": Hardware("NVIDIA H100 80GB PCIe", 81_559, 2039.0, "nvidia"),
    "h200": Hardware("NVIDIA H200 141GB", 143_771, 4800.0, "nvidia"),
    "m4pro-24gb": Hardware("Apple M4 Pro 24 GB", 24 * 1024, 273.0, "apple"),
    "m4pro-48gb": Hardware("Apple M4 Pro 48 GB", 48 * 1024, 273.0, "apple"),
    "m4max-128gb": Hardware("Apple M4 Max 128 GB", 128 * 1024, 546.0, "apple"),
    "m5max-128gb": Hardware("Apple M5 Max 128 GB", 128 * 1024, 614.0, "apple"),
}


def _key(name: str) -> str:
    """Names compare on letters and digits only, so 'RTX 4090' and 'rtx-4090' find 'rtx4090'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def hardware(name: str) -> Hardware:
    """The machine called ``name``; raises ValueError listing the valid names."""
    found = {_key(k): v for k, v in HARDWARE.items()}.get(_key(name))
    if found is None:
        raise ValueError(f"unknown GPU {name!r}; valid names: {', '.join(HARDWARE)} (or give --mem 24GiB)")
    return found


def find_model(name: str) -> tuple[str, CatalogModel]:
    """The built-in model called ``name``, by catalog name or Hugging Face id ('Qwen/Qwen3.6-35B-A3B',
    'Qwen3.6-35B-A3B'), any case, with its catalog name; raises ValueError listing the valid names."""
    key = name.strip().lower()
    for short, entry in MODELS.items():
        if key in (short, entry.hf_id.lower(), entry.hf_id.lower().split("/")[-1]):
            return short, entry
    raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)} (or their Hugging Face ids, "
                     f"a Hugging Face folder with config.json, or a .gguf file)")


def model(name: str) -> CatalogModel:
    """The built-in model called ``name`` (see ``find_model``)."""
    return find_model(name)[1]


# ----- weight types and llama.cpp's quantization mixes ------------------------------------
def _weight_types() -> dict[str, tuple[int, int]]:
    """(values per block, bytes per block) of every ggml type: kvslim's weight table, itself
    checked against gguf's sizes (tests/test_weights.py)."""
    from ..weights.types import TABLE
    return {t.name: (t.block_size, t.block_bytes) for t in TABLE}


WEIGHT_TYPES: dict[str, tuple[int, int]] = _weight_types()
# llama-quantize's fallback when a row length is not a multiple of the type's block
# (llama-quant.cpp's tensor_type_fallback): the 256-value i-quants take IQ4_NL.
WEIGHT_FALLBACK = {"q6_k": "q8_0", "q5_k": "q5_1", "q4_k": "q5_0", "q3_k": "q4_0", "q2_k": "q4_0",
                   **dict.fromkeys(("iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"),
                                   "iq4_nl")}


@dataclass(frozen=True)
class WeightMix:
    """A llama-quantize file type: the default tensor type, the output tensor's type, the token
    embedding's when it is not tied to the output (None: the default), the per-role overrides
    (role, rule, type), first match wins, and the routed experts' type if it is their own.
    Roles and rules follow llama.cpp's ``llama_tensor_get_type``: ``attn_v`` covers attn_v and
    the fused attn_qkv of DeltaNet layers, counted in layer order; ``ffn_down`` covers dense,
    expert and shared-expert down projections of a layer. Rules are keys of
    ``weight_size.RULES``."""

    base: str
    output: str
    rules: tuple[tuple[str, str, str], ...] = ()
    token_embd: str | None = None
    experts: str | None = None        # the routed experts' type, whatever the rules (MXFP4_MOE)


# Weight quantizations a user can ask for, widest first (suggestions walk this order). Each is
# checked tensor by tensor against llama-quantize's own files (tests/test_plan_mixes.py). Not
# modelled: the rules for 8-expert models (Mixtral's Q8_0 attn_v), and files made without an
# importance matrix where llama.cpp then differs (IQ3_XXS's attn_v and ffn_down, IQ4_XS's first
# ffn_down layers): the i-quant files people download are made with one.
_MORE_BITS_Q6 = (("attn_v", "more_bits", "q6_k"), ("ffn_down", "more_bits", "q6_k"))


def _iq12(base: str, attn_v: str, ffn_down: str, attn_output: str | None, token_embd: str) -> WeightMix:
    """llama.cpp's IQ1_*/IQ2_* mixes: attn_v at Q4_K with GQA >= 4 or >= 4 experts, else
    ``attn_v``; the first eighth of the ffn_down tensors (counted, shared experts included) at
    ``ffn_down``; the output at Q5_K."""
    rules = (("attn_v", "gqa4_or_experts4", "q4_k"), ("attn_v", "all", attn_v),
             ("ffn_down", "first_eighth_counted", ffn_down))
    if attn_output:
        rules += (("attn_output", "all", attn_output),)
    return WeightMix(base, "q5_k", rules, token_embd)


WEIGHT_QUANTS: dict[str, WeightMix] = {
    "f32": WeightMix("f32", "f32"),
    "f16": WeightMix("f16", "f16"),
    "bf16": WeightMix("bf16", "bf16"),
    "q8_0": WeightMix("q8_0", "q8_0"),
    "q6_k": WeightMix("q6_k", "q6_k"),
    "q5_k_m": WeightMix("q5_k", "q6_k", _MORE_BITS_Q6),
    "q4_k_m": WeightMix("q4_k", "q6_k", _MORE_BITS_Q6),
    "mxfp4_moe": WeightMix("q8_0", "q8_0", experts="mxfp4"),   # a dense model's is its q8_0
    "q4_0": WeightMix("q4_0", "q6_k"),
    "iq4_xs": WeightMix("iq4_xs", "q6_k", (("attn_v", "gqa4", "q5_k"),)),
    "q3_k_m": WeightMix("q3_k", "q6_k", (("attn_v", "first_two", "q5_k"), ("attn_v", "all", "q4_k"),
                                         ("ffn_down", "first_sixteenth", "q5_k"), ("ffn_down", "all", "q4_k"),
                                         ("attn_output", "all", "q4_k"))),
    "iq3_m": WeightMix("iq3_s", "q6_k", (("attn_v", "all", "q4_k"), ("ffn_down", "first_eighth", "q4_k"),
                                         ("attn_output", "all", "q4_k"))),
    "iq3_s": WeightMix("iq3_s", "q6_k", (("attn_v", "gqa4", "q4_k"),)),
    "iq3_xxs": WeightMix("iq3_xxs", "q5_k", (("attn_v", "gqa4", "q4_k"), ("attn_k", "all", "iq2_s"),
                                             ("attn_q", "all", "iq2_s"), ("attn_output", "all", "iq3_s")),
                         token_embd="iq3_s"),
    "q2_k": WeightMix("q2_k", "q6_k", (("attn_v", "gqa4", "q4_k"), ("attn_v", "all", "q3_k"),
                                       ("ffn_down", "all", "q3_k"), ("attn_output", "all", "q3_k"))),
    "iq2_m": _iq12("iq2_s", "iq3_s", "iq3_s", "iq3_s", "iq3_s"),
    "iq2_s": _iq12("iq2_xs", "iq3_s", "iq3_s", "iq3_s", "iq3_s"),
    "iq2_xs": _iq12("iq2_xs", "q2_k", "q2_k", None, "q2_k"),
    "iq2_xxs": _iq12("iq2_xxs", "q2_k", "q2_k", None, "q2_k"),
    "iq1_m": _iq12("iq1_m", "q2_k", "q2_k", "iq2_xxs", "q2_k"),
    "iq1_s": _iq12("iq1_s", "q2_k", "q2_k", "iq2_xxs", "q2_k"),
}

# Suggestions walk WEIGHT_QUANTS down to this mix and no further: below ~3 bits a weight the
# quality loss is large (the bundled model's IQ2_XXS: mean KLD 0.105 against IQ3_XXS's 0.030,
# docs/vs-llama-cpp.md), a choice to make knowingly with -wq rather than to be offered.
LOWEST_SUGGESTED_QUANT = "iq3_xxs"


def suggested_quants() -> list[str]:
    names = list(WEIGHT_QUANTS)
    return names[:names.index(LOWEST_SUGGESTED_QUANT) + 1]


# ----- cache types in other engines -----------------------------------------------------
# vLLM takes one --kv-cache-dtype for K and V. "auto" is the model's dtype (bf16:
# the same bytes as f16); fp8 (e4m3, per-tensor scale) is the nearest to q8_0, not the same.
VLLM_KV_DTYPE = {"f16": "auto", "bf16": "auto", "q8_0": "fp8"}
# Cache types upstream llama-server accepts for -ctk/-ctv (common/arg.cpp).
LLAMA_SERVER_KV = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# What stands in for a type upstream llama-server lacks (TurboQuant): its smallest
# type, q4_0 at 4.5 bits per value, which takes more memory than planned.
LLAMA_SERVER_NEAREST = "q4_0"
