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
# (values per block, bytes per block) from ggml's block structs (ggml-common.h):
# q8_0 = fp16 d + 32 int8; q4_0 = fp16 d + 16 nibble bytes; q4_1/q5_0/q5_1 add a min
# or high bits; the k-quants pack 256 values: q6_K 210 B (6.5625 bits), q5_K 176 B
# (5.5), q4_K 144 B (4.5), q3_K 110 B (3.4375).
WEIGHT_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18),
    "q6_k": (256, 210), "q5_k": (256, 176), "q4_k": (256, 144), "q3_k": (256, 110),
}
# llama-quantize's fallback when a row length is not a multiple of the k-quant block.
WEIGHT_FALLBACK = {"q6_k": "q8_0", "q5_k": "q5_1", "q4_k": "q5_0", "q3_k": "q4_0"}


@dataclass(frozen=True)
class WeightMix:
    """A llama-quantize file type: the default tensor type, the output tensor's type and the
    per-role overrides (role, layer rule, type), first match wins. Roles and rules follow
    llama.cpp's ``llama_tensor_get_type``: ``attn_v`` covers attn_v and the fused attn_qkv of
    DeltaNet layers, counted in layer order; ``ffn_down`` covers dense, expert and shared-expert
    down projections of a layer."""

    base: str
    output: str
    rules: tuple[tuple[str, str, str], ...] = ()


# Weight quantizations a user can ask for, widest first (suggestions walk this order).
# The rules for 8-expert models (Mixtral) and imatrix-dependent tweaks are not modelled.
_MORE_BITS_Q6 = (("attn_v", "more_bits", "q6_k"), ("ffn_down", "more_bits", "q6_k"))
WEIGHT_QUANTS: dict[str, WeightMix] = {
    "f32": WeightMix("f32", "f32"),
    "f16": WeightMix("f16", "f16"),
    "bf16": WeightMix("bf16", "bf16"),
    "q8_0": WeightMix("q8_0", "q8_0"),
    "q6_k": WeightMix("q6_k", "q6_k"),
    "q5_k_m": WeightMix("q5_k", "q6_k", _MORE_BITS_Q6),
    "q4_k_m": WeightMix("q4_k", "q6_k", _MORE_BITS_Q6),
    "q4_0": WeightMix("q4_0", "q6_k"),
    "q3_k_m": WeightMix("q3_k", "q6_k", (("attn_v", "first_two", "q5_k"), ("attn_v", "all", "q4_k"),
                                         ("ffn_down", "first_sixteenth", "q5_k"), ("ffn_down", "all", "q4_k"),
                                         ("attn_output", "all", "q4_k"))),
}

# ----- cache types in other engines -----------------------------------------------------
# vLLM takes one --kv-cache-dtype for K and V. "auto" is the model's dtype (bf16:
# the same bytes as f16); fp8 (e4m3, per-tensor scale) is the nearest to q8_0, not the same.
VLLM_KV_DTYPE = {"f16": "auto", "bf16": "auto", "q8_0": "fp8"}
# Cache types upstream llama-server accepts for -ctk/-ctv (common/arg.cpp).
LLAMA_SERVER_KV = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# What stands in for a type upstream llama-server lacks (TurboQuant): its smallest
# type, q4_0 at 4.5 bits per value, which takes more memory than planned.
LLAMA_SERVER_NEAREST = "q4_0"
