"""KV cache formats: one preset table, derived sizes, encode/decode.

    >>> fmt = kvslim.formats.get("turbo4")
    >>> packed = fmt.encode(k)            # (..., 128) float -> (..., 66) uint8
    >>> k_hat = fmt.decode(packed, 128)   # -> (..., 128) float32
"""
from __future__ import annotations

import functools
import os

from .base import FormatSpec, KernelRow, KVFormat
from .floats import FloatFormat
from .ggml import NOROT, GgmlFormat
from .grid import GridFormat, SubScaleGridFormat
from .klt import KLTFormat
from .turbo import TurboFormat

# The one table. block_bytes and bits per value are derived from these columns.
# The ggml names mean what they mean in llama.cpp today: Hadamard-rotated (PR #21038);
# "-norot" rows are the same blocks without the rotation (LLAMA_ATTN_ROT_DISABLE=1).
_GGML: tuple[tuple[str, int, int, str], ...] = (
    ("q8_0", 8, 2, "fp16 scale + 32 int8 per block"),
    ("q5_1", 5, 4, "fp16 scale and min, 5-bit codes"),
    ("q5_0", 5, 2, "fp16 scale, 5-bit symmetric codes"),
    ("q4_1", 4, 4, "fp16 scale and min, 4-bit codes"),
    ("iq4_nl", 4, 2, "fp16 scale, 4-bit indices into a non-linear grid"),
    ("q4_0", 4, 2, "fp16 scale, 4-bit symmetric codes"),
)
TABLE: tuple[FormatSpec, ...] = (
    FormatSpec("f32", "float", 1, 32, 0, "IEEE float32"),
    FormatSpec("f16", "float", 1, 16, 0, "IEEE float16, the usual unquantized cache"),
    FormatSpec("bf16", "float", 1, 16, 0, "bfloat16"),
    *(FormatSpec(name, "ggml", 32, bits, header, f"ggml, Hadamard-rotated as llama.cpp: {text}", rotated=True)
      for name, bits, header, text in _GGML),
    FormatSpec("turbo4", "turbo", 128, 4, 2, "TurboQuant: rotation + 4-bit Lloyd-Max codebook, fp16 norm"),
    FormatSpec("turbo3", "turbo", 128, 3, 2, "TurboQuant: rotation + 3-bit Lloyd-Max codebook, fp16 norm"),
    FormatSpec("turbo2", "turbo", 128, 2, 2, "TurboQuant: rotation + 2-bit Lloyd-Max codebook, fp16 norm"),
    FormatSpec("nl4", "nl", 64, 4, 2, "rotated as llama.cpp + fp16 scale per 64 + 4-bit fitted grid, scale search"),
    FormatSpec("nl3", "nl", 32, 3, 2, "rotated as llama.cpp + fp16 scale per 32 + 3-bit fitted grid, scale search"),
    FormatSpec("nl4s", "nls", 128, 4, 4,
               "rotated as llama.cpp + fp16 scale per 128, 2-bit sub-scale per 16 + 4-bit fitted grid"),
    FormatSpec("nl3s", "nls", 128, 3, 4,
               "rotated as llama.cpp + fp16 scale per 128, 2-bit sub-scale per 16 + 3-bit fitted grid"),
    FormatSpec("klt3", "klt", 128, 2.625, 2,
               "V only, calibrated per model: o_proj-weighted KLT basis + water-filled 0-8 bits per direction "
               "+ fitted grids, fp16 row scale"),
    FormatSpec("turbo4p", "turbo_prod", 128, 4, 4,
               "TurboQuant product: 3-bit MSE + 1-bit QJL residual (unbiased dot products)", True),
    FormatSpec("turbo3p", "turbo_prod", 128, 3, 4,
               "TurboQuant product: 2-bit MSE + 1-bit QJL residual (unbiased dot products)", True),
    *(FormatSpec(name + NOROT, "ggml", 32, bits, header, f"ggml, unrotated: {text}")
      for name, bits, header, text in _GGML),
)
_BY_NAME = {spec.name: spec for spec in TABLE}
_CLASSES = {"float": FloatFormat, "ggml": GgmlFormat, "nl": GridFormat, "nls": SubScaleGridFormat, "turbo": TurboFormat, "turbo_prod": TurboFormat,
            "klt": KLTFormat}


def names() -> list[str]:
    """All format names, in table order (widest first within each family)."""
    return [spec.name for spec in TABLE]


def standalone_names(head_dim: int | None = None) -> list[str]:
    """The names that code any row on their own: all but the calibrated (klt) rows, which need a
    model's calibration (random vectors, MiniLM's caches and plans for other models have none).
    With ``head_dim``, only those that can store rows that long (nl4's rotation takes 64 values:
    a default sweep at MiniLM's 32 failed part-way)."""
    return [spec.name for spec in TABLE if spec.family != "klt" and (head_dim is None or _stores(spec.name, head_dim))]


def _stores(name: str, head_dim: int) -> bool:
    try:
        get(name).check_head_dim(head_dim)
    except ValueError:
        return False
    return True


ROT_DISABLE_ENV = "LLAMA_ATTN_ROT_DISABLE"


def rotation_disabled() -> bool:
    """True when LLAMA_ATTN_ROT_DISABLE is set to a non-zero integer, as llama.cpp reads it."""
    text = os.environ.get(ROT_DISABLE_ENV, "").strip()
    try:
        return int(text) != 0
    except ValueError:
        return False


def get(name: str, role: str = "k") -> KVFormat:
    """The format called ``name``; raises ValueError listing the valid names.

    Args:
        name: a name from the table (case-insensitive).
        role: "k" or "v": rotated ggml types use llama.cpp's rotation size for that role
            (K: the largest power of two dividing head_dim; V: 64).
    With LLAMA_ATTN_ROT_DISABLE=1 in the environment, ggml names resolve to their
    unrotated ``-norot`` rows, as the variable turns llama.cpp's rotation off.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if rotation_disabled() and isinstance(key, str) and f"{key}{NOROT}" in _BY_NAME:
        key = f"{key}{NOROT}"
    return _get(key, role)


@functools.lru_cache(maxsize=None)
def _get(key: str, role: str) -> KVFormat:
    spec = _BY_NAME.get(key)
    if spec is None:
        raise ValueError(f"unknown KV cache type {key!r}; valid types: {', '.join(names())}")
    if spec.family in ("ggml", "nl", "nls", "klt"):
        return _CLASSES[spec.family](spec, role)
    return _CLASSES[spec.family](spec)


def parse_list(text: str) -> list[KVFormat]:
    """A comma list of names (as ``-ctk q8_0,turbo4`` takes) -> formats."""
    return [get(part) for part in text.split(",") if part.strip()]


__all__ = ["FormatSpec", "KVFormat", "TABLE", "NOROT", "ROT_DISABLE_ENV", "get", "names", "standalone_names", "parse_list",
           "rotation_disabled"]
