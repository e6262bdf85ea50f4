"""KV cache formats: one preset table, derived sizes, encode/decode.

    >>> fmt = kvslim.formats.get("turbo4")
    >>> packed = fmt.encode(k)            # (..., 128) float -> (..., 66) uint8
    >>> k_hat = fmt.decode(packed, 128)   # -> (..., 128) float32
"""
from __future__ import annotations

import functools

from .base import FormatSpec, KVFormat
from .floats import FloatFormat
from .ggml import GgmlFormat
from .turbo import TurboFormat

# The one table. block_bytes and bits per value are derived from these columns.
#          name       family       block bits header  summary
TABLE: tuple[FormatSpec, ...] = (
    FormatSpec("f32", "float", 1, 32, 0, "IEEE float32"),
    FormatSpec("f16", "float", 1, 16, 0, "IEEE float16, the usual unquantized cache"),
    FormatSpec("bf16", "float", 1, 16, 0, "bfloat16"),
    FormatSpec("q8_0", "ggml", 32, 8, 2, "ggml: fp16 scale + 32 int8 per block"),
    FormatSpec("q5_1", "ggml", 32, 5, 4, "ggml: fp16 scale and min, 5-bit codes"),
    FormatSpec("q5_0", "ggml", 32, 5, 2, "ggml: fp16 scale, 5-bit symmetric codes"),
    FormatSpec("q4_1", "ggml", 32, 4, 4, "ggml: fp16 scale and min, 4-bit codes"),
    FormatSpec("iq4_nl", "ggml", 32, 4, 2, "ggml: fp16 scale, 4-bit indices into a non-linear grid"),
    FormatSpec("q4_0", "ggml", 32, 4, 2, "ggml: fp16 scale, 4-bit symmetric codes"),
    FormatSpec("turbo4", "turbo", 128, 4, 2, "TurboQuant: rotation + 4-bit Lloyd-Max codebook, fp16 norm"),
    FormatSpec("turbo3", "turbo", 128, 3, 2, "TurboQuant: rotation + 3-bit Lloyd-Max codebook, fp16 norm"),
    FormatSpec("turbo2", "turbo", 128, 2, 2, "TurboQuant: rotation + 2-bit Lloyd-Max codebook, fp16 norm"),
    FormatSpec("turbo4p", "turbo_prod", 128, 4, 4,
               "TurboQuant product: 3-bit MSE + 1-bit QJL residual (unbiased dot products)", True),
    FormatSpec("turbo3p", "turbo_prod", 128, 3, 4,
               "TurboQuant product: 2-bit MSE + 1-bit QJL residual (unbiased dot products)", True),
)
_BY_NAME = {spec.name: spec for spec in TABLE}
_CLASSES = {"float": FloatFormat, "ggml": GgmlFormat, "turbo": TurboFormat, "turbo_prod": TurboFormat}


def names() -> list[str]:
    """All format names, in table order (widest first within each family)."""
    return [spec.name for spec in TABLE]


@functools.lru_cache(maxsize=None)
def get(name: str) -> KVFormat:
    """The format called ``name``; raises ValueError listing the valid names."""
    spec = _BY_NAME.get(name.strip().lower() if isinstance(name, str) else name)
    if spec is None:
        raise ValueError(f"unknown KV cache type {name!r}; valid types: {', '.join(names())}")
    return _CLASSES[spec.family](spec)


def parse_list(text: str) -> list[KVFormat]:
    """A comma list of names (as ``-ctk q8_0,turbo4`` takes) -> formats."""
    return [get(part) for part in text.split(",") if part.strip()]


__all__ = ["FormatSpec", "KVFormat", "TABLE", "get", "names", "parse_list"]
