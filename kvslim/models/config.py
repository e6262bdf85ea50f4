"""Model configs: one dataclass per architecture family, all read by one ``from_dict``.

``DecoderConfig`` holds the fields every decoder has and the one loader that turns a
Hugging Face config.json dict into a config (text part of multimodal wrappers, both
spellings of the RoPE keys, defaults derived as transformers derives them, unknown
keys ignored). A family adds its fields and, where needed, a ``derive`` step.

Configs only describe; the model files build from them. ``runnable`` is False for
architectures kvslim can plan but not run (no model file): they must still say what
the planner needs, their cache layout and their parameter shapes.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

from ..cache import KVLayerSpec, StateLayerSpec


def text_config(d: dict) -> dict:
    """The language model's part of a (possibly multimodal) config, as a fresh dict."""
    inner = d.get("text_config")
    out = dict(inner) if isinstance(inner, dict) else dict(d)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in out and key in d:
            out[key] = d[key]
    out.setdefault("model_type", d.get("model_type", ""))
    return out


def model_type_of(d: dict) -> str:
    """The text model's ``model_type`` of a config.json dict."""
    inner = d.get("text_config")
    t = (inner or {}).get("model_type") if isinstance(inner, dict) else None
    return t or d.get("model_type", "")


def rope_fields(d: dict) -> dict:
    """rope_theta / partial_rotary_factor / rope_scaling from either the transformers 5
    ``rope_parameters`` dict or the older top-level keys."""
    params = dict(d.get("rope_parameters") or {})
    old = d.get("rope_scaling") or {}
    out = {"rope_theta": params.get("rope_theta", d.get("rope_theta")),
           "partial_rotary_factor": params.get("partial_rotary_factor", d.get("partial_rotary_factor"))}
    scaling = {k: v for k, v in {**old, **params}.items()
               if k not in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        out["rope_scaling"] = scaling
    return {k: v for k, v in out.items() if v is not None}


@dataclass(kw_only=True)
class DecoderConfig:
    """What every decoder-only text model has; every layer attention unless a family says otherwise."""

    runnable: ClassVar[bool] = True     # False: plan-only (no model file)

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0        # 0: as many as the attention heads (transformers' default)
    head_dim: int = 0                   # 0: hidden_size // num_attention_heads
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 1.0
    rope_scaling: dict = field(default_factory=dict)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    # routed experts (0: a dense feed-forward in every layer)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict):
        """From a Hugging Face config.json dict (a ``text_config`` inside is taken if present);
        unknown keys are ignored. Raises ValueError naming a missing required field."""
        d = text_config(d)
        d.update(rope_fields(d))
        if d.get("num_experts") is None and d.get("num_local_experts") is not None:
            d["num_experts"] = d["num_local_experts"]               # transformers 5 writes Qwen3-MoE's so
        cls.derive(d)
        names = {f.name for f in fields(cls)}
        for f in fields(cls):
            if f.default is MISSING and f.default_factory is MISSING and d.get(f.name) is None:
                raise ValueError(f"config is missing the field {f.name!r}")
        values = {k: v for k, v in d.items() if k in names and v is not None}
        check_types(cls, values)
        return cls(**values)

    @classmethod
    def derive(cls, d: dict) -> None:
        """Fill fields a family computes from other keys (in place, before the dataclass is built)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def uses_moe(self, layer: int) -> bool:
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def cache_layout(self, type_k: str = "f16", type_v: str = "f16") -> list[KVLayerSpec | StateLayerSpec]:
        """Per layer, the cache it needs: here a KV cache for every layer."""
        return [KVLayerSpec(self.num_key_value_heads, self.head_dim, type_k, type_v)] * self.num_hidden_layers


@dataclass(kw_only=True)
class LlamaConfig(DecoderConfig):
    """Dense GQA decoders: ``llama``, ``mistral``, ``qwen2`` and ``qwen3``."""

    intermediate_size: int = field()    # required here (field(): not the base's default)
    mlp_bias: bool = False


@dataclass(kw_only=True)
class HybridConfig(DecoderConfig):
    """Text config of the hybrid Qwen models (``qwen3_5*`` and ``qwen3_next``): Gated DeltaNet
    layers with a fixed-size state between gated attention layers."""

    layer_types: list[str]
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144

    @classmethod
    def derive(cls, d: dict) -> None:
        if not d.get("layer_types") and d.get("num_hidden_layers") is not None:
            every = d.get("full_attention_interval", 4)
            d["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                for i in range(d["num_hidden_layers"])]

    def cache_layout(self, type_k: str = "f16", type_v: str = "f16") -> list[KVLayerSpec | StateLayerSpec]:
        """Per layer: a KV cache for attention layers, a fixed-size state for DeltaNet layers."""
        kv = KVLayerSpec(self.num_key_value_heads, self.head_dim, type_k, type_v)
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        state = StateLayerSpec(conv_dim=2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim,
                               conv_kernel=self.linear_conv_kernel_dim, n_v_heads=self.linear_num_value_heads,
                               k_head_dim=self.linear_key_head_dim, v_head_dim=self.linear_value_head_dim)
        return [kv if t == "full_attention" else state for t in self.layer_types]


# a number field's JSON types: an int where a float goes is fine (rope_theta 1000000), a bool is not a number
NUMBER_TYPES = {"int": ((int,), "an integer"), "float": ((int, float), "a number"), "bool": ((bool,), "true or false")}


def check_types(cls, values: dict) -> None:
    """A ValueError naming a field of config.json whose value is not of its type ("hidden_size":
    "64" failed deep inside torch); fields of other types (lists, unions) are left to the model."""
    kinds = {f.name: f.type for f in fields(cls)}
    for name, value in values.items():
        if kinds.get(name) not in NUMBER_TYPES:
            continue
        allowed, expected = NUMBER_TYPES[kinds[name]]
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ValueError(f"config field {name!r} is {value!r}; expected {expected}")


# ----- plan-only architectures (kvslim has no model file for them) -------------------------------

@dataclass(kw_only=True)
class Qwen3MoeConfig(DecoderConfig):
    """``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): attention in every layer, per-head q/k
    RMSNorm, routed experts without a shared expert. Enough to plan it; kvslim cannot run it."""

    runnable: ClassVar[bool] = False

    num_experts: int = field()
    num_experts_per_tok: int = field()
    moe_intermediate_size: int = field()
    max_position_embeddings: int = 40_960

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face parameter name -> shape, in the layout kvslim's own loaders use
        (experts fused as ``gate_up_proj`` / ``down_proj``): what a model file's modules
        would declare, for the planner's tensor accounting."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                           p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                           p + "self_attn.o_proj.weight": (h, q), p + "self_attn.q_norm.weight": (self.head_dim,),
                           p + "self_attn.k_norm.weight": (self.head_dim,),
                           p + "post_attention_layernorm.weight": (h,)})
            shapes.update(self._feed_forward_shapes(p))
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def _feed_forward_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        h = self.hidden_size
        if not self.uses_moe(int(p.split(".")[2])):
            f = self.intermediate_size
            return {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)}
        e, f = self.num_experts, self.moe_intermediate_size
        return {p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * f, h),
                p + "mlp.experts.down_proj": (e, h, f)}


PLAN_ONLY: dict[str, type[DecoderConfig]] = {"qwen3_moe": Qwen3MoeConfig}
