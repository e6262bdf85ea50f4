"""Model architectures, one file per Hugging Face ``model_type``.

A model file declares ``MODEL_TYPES``, ``Config`` (a ``config.DecoderConfig``) and
``Model``; it is found here by those names, so adding an architecture touches no
other file in this package. ``config_from_dict`` reads a config.json dict into the
right config, for runnable and plan-only (``config.PLAN_ONLY``) architectures; its
``cache_layout(type_k, type_v)`` lists each layer's cache spec (what the planner sums
and ``make_cache`` allocates). ``build`` makes the (empty) model.
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import torch

from .base import CausalLM
from .batch import Batch, DecodeBatch, Segment
from .config import PLAN_ONLY, DecoderConfig, model_type_of


def _model_files() -> list[ModuleType]:
    found = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__))
    return [m for m in found if hasattr(m, "MODEL_TYPES")]


ARCHITECTURES: dict[str, ModuleType] = {t: m for m in _model_files() for t in m.MODEL_TYPES}


def architecture(d: dict) -> ModuleType:
    """The model file for a config.json dict; ValueError listing the runnable types."""
    t = model_type_of(d)
    if t not in ARCHITECTURES:
        why = "can be planned but not run" if t in PLAN_ONLY else "is not supported"
        raise ValueError(f"model_type {t!r} {why}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[t]


def config_class(model_type: str) -> type[DecoderConfig]:
    """The config dataclass of ``model_type``, runnable or plan-only."""
    if model_type in PLAN_ONLY:
        return PLAN_ONLY[model_type]
    if model_type not in ARCHITECTURES:
        supported = sorted({*ARCHITECTURES, *PLAN_ONLY})
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported)}")
    return ARCHITECTURES[model_type].Config


def config_from_dict(d: dict) -> DecoderConfig:
    """The config dataclass for a Hugging Face config.json dict (``runnable`` says whether
    kvslim has a model for it)."""
    return config_class(model_type_of(d)).from_dict(d)


def build(config: DecoderConfig) -> CausalLM:
    """An uninitialised model for ``config`` (weights come from a loader)."""
    if not config.runnable:
        raise ValueError(f"model_type {config.model_type!r} can be planned but not run; "
                         f"runnable: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[config.model_type].Model(config)


def build_on_meta(config: DecoderConfig) -> CausalLM:
    """The model for ``config`` on the meta device: every parameter's name and shape, no memory."""
    with torch.device("meta"):
        return build(config)


def parameter_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter name -> shape, in the order the model declares them: read off the
    model built on the meta device, or for a plan-only config from its own description."""
    if not config.runnable:
        return config.parameter_shapes()
    return {name: tuple(p.shape) for name, p in build_on_meta(config).named_parameters()}


__all__ = ["ARCHITECTURES", "Batch", "DecodeBatch", "Segment", "CausalLM", "DecoderConfig", "config_from_dict", "config_class",
           "build", "build_on_meta", "parameter_shapes", "architecture", "model_type_of"]
