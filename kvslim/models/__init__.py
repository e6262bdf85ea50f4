"""Model architectures, one file per Hugging Face ``model_type``.

``config_from_dict`` reads a config.json dict into the right config dataclass;
its ``cache_layout(type_k, type_v)`` lists each layer's cache spec (what the
planner sums and ``make_cache`` allocates). ``build`` makes the (empty) model.
"""
from __future__ import annotations

from types import ModuleType

from . import llama, qwen3_5, qwen3_next
from .base import CausalLM
from .batch import Batch, DecodeBatch, Segment

_FILES: tuple[ModuleType, ...] = (qwen3_5, qwen3_next, llama)
ARCHITECTURES: dict[str, ModuleType] = {t: m for m in _FILES for t in m.MODEL_TYPES}


def model_type_of(d: dict) -> str:
    inner = d.get("text_config")
    t = (inner or {}).get("model_type") if isinstance(inner, dict) else None
    return t or d.get("model_type", "")


def architecture(d: dict) -> ModuleType:
    t = model_type_of(d)
    if t not in ARCHITECTURES:
        raise ValueError(f"model_type {t!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[t]


def config_from_dict(d: dict):
    """The config dataclass for a Hugging Face config.json dict."""
    try:
        return architecture(d).Config.from_dict(d)
    except KeyError as missing:
        raise ValueError(f"config is missing the field {missing}") from None


def build(config) -> CausalLM:
    """An uninitialised model for ``config`` (weights come from a loader)."""
    return ARCHITECTURES[config.model_type].Model(config)


__all__ = ["ARCHITECTURES", "Batch", "DecodeBatch", "Segment", "CausalLM", "config_from_dict", "build", "architecture"]
