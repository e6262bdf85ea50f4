"""The ggml block types weights may be kept in, as one table.

A row names the type, its ggml id, values per block and the block's byte layout
(fields in order); bytes per block and bits per value are derived from the layout.
Decoders map (N, block_bytes) uint8 -> (N, block_size) float32, bit-identical to
``gguf.quants.dequantize``; the 32-value types reuse ``kvslim.formats.ggml``'s
codecs (which also encode, byte-identical to ggml's reference quantizers), the
K-quants decode with ``kquants``, the i-quants and the 4-bit float types with ``iquants``. Unknown names and unsupported GGUF types raise
errors that list what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gguf
import torch

from ..formats import ggml
from . import iquants, kquants

_T = gguf.GGMLQuantizationType
QK = ggml.QK                 # 32 values per block (the legacy types)
QK_K = kquants.QK_K          # 256 values per super-block (K-quants)


@dataclass(frozen=True)
class WeightType:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    block_size: int                              # values per block
    fields: tuple[tuple[str, int], ...]          # (name, bytes) in storage order
    decode_fields: Callable | None = None        # K-quants: decoder over named fields
    summary: str = ""
    encode_values: Callable | None = None        # float types: a cast (the block types use ggml's codecs)

    @property
    def is_float(self) -> bool:
        """A plain float type, one value per "block" (llama.cpp's F16 fallback matrices)."""
        return self.block_size == 1

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.fields)

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block_size

    def row_bytes(self, n_values: int) -> int:
        """Bytes of one row of ``n_values``; a ValueError if the row is not whole blocks."""
        if n_values % self.block_size:
            raise ValueError(f"{self.name}: a row of {n_values} values is not a whole number of "
                             f"{self.block_size}-value blocks")
        return n_values // self.block_size * self.block_bytes

    def split(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """(N, block_bytes) -> {field: (N, bytes) view}."""
        out, at = {}, 0
        for name, n in self.fields:
            out[name], at = blocks[:, at:at + n], at + n
        return out

    def decode(self, blocks: torch.Tensor) -> torch.Tensor:
        """(N, block_bytes) uint8 -> (N, block_size) float32."""
        if self.decode_fields is not None:
            return self.decode_fields(self.split(blocks))
        return ggml.CODECS[self.name][1](blocks)

    @property
    def can_encode(self) -> bool:
        return self.name in ggml.CODECS or self.encode_values is not None

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """(N, block_size) float32 -> (N, block_bytes) uint8, as ggml's reference quantizer."""
        if not self.can_encode:
            raise ValueError(f"no encoder for {self.name}; encodable: {', '.join(encodable_names())}")
        if self.encode_values is not None:
            return self.encode_values(values)
        return ggml.CODECS[self.name][0](values.float())


def _legacy(name: str, ggml_type, fields, summary: str) -> WeightType:
    return WeightType(name, ggml_type, QK, fields, None, summary)


def _float(name: str, ggml_type, dtype: torch.dtype) -> WeightType:
    def decode(f: dict[str, torch.Tensor]) -> torch.Tensor:
        return f["v"].contiguous().view(dtype).float()

    def encode(values: torch.Tensor) -> torch.Tensor:     # (N, 1) -> (N, itemsize) bytes
        return values.to(dtype).contiguous().view(torch.uint8).reshape(values.shape[0], dtype.itemsize)
    # f16/bf16 can be chosen at load (--weights f16: half the bytes of f32 weights, computed in f32)
    return WeightType(name, ggml_type, 1, (("v", dtype.itemsize),), decode, f"IEEE {name}, as stored",
                      encode if dtype != torch.float32 else None)


TABLE: tuple[WeightType, ...] = (
    _legacy("q8_0", _T.Q8_0, (("d", 2), ("qs", QK)), "fp16 scale + 32 int8"),
    _legacy("q5_1", _T.Q5_1, (("d", 2), ("m", 2), ("qh", 4), ("qs", QK // 2)), "fp16 scale and min, 5-bit codes"),
    _legacy("q5_0", _T.Q5_0, (("d", 2), ("qh", 4), ("qs", QK // 2)), "fp16 scale, 5-bit codes"),
    _legacy("q4_1", _T.Q4_1, (("d", 2), ("m", 2), ("qs", QK // 2)), "fp16 scale and min, 4-bit codes"),
    _legacy("q4_0", _T.Q4_0, (("d", 2), ("qs", QK // 2)), "fp16 scale, 4-bit codes"),
    _legacy("iq4_nl", _T.IQ4_NL, (("d", 2), ("qs", QK // 2)), "fp16 scale, 4-bit indices into a fixed grid"),
    WeightType("q6_k", _T.Q6_K, QK_K, (("ql", QK_K // 2), ("qh", QK_K // 4), ("scales", QK_K // 16), ("d", 2)),
               kquants.decode_q6_k, "6-bit codes, int8 scale per 16 values, fp16 super-scale"),
    WeightType("q5_k", _T.Q5_K, QK_K, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", QK_K // 8),
                                       ("qs", QK_K // 2)),
               kquants.decode_q5_k, "5-bit codes, 6-bit scale and min per 32 values"),
    WeightType("q4_k", _T.Q4_K, QK_K, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", QK_K // 2)),
               kquants.decode_q4_k, "4-bit codes, 6-bit scale and min per 32 values"),
    WeightType("q3_k", _T.Q3_K, QK_K, (("hmask", QK_K // 8), ("qs", QK_K // 4), ("scales", 12), ("d", 2)),
               kquants.decode_q3_k, "3-bit codes, 6-bit scale per 16 values, fp16 super-scale"),
    WeightType("q2_k", _T.Q2_K, QK_K, (("scales", QK_K // 16), ("qs", QK_K // 4), ("d", 2), ("dmin", 2)),
               kquants.decode_q2_k, "2-bit codes, 4-bit scale and min per 16 values"),
    WeightType("iq4_xs", _T.IQ4_XS, QK_K, (("d", 2), ("scales_h", 2), ("scales_l", QK_K // 64), ("qs", QK_K // 2)),
               kquants.decode_iq4_xs, "4-bit indices into IQ4_NL's grid, 6-bit scale per 32 values"),
    # The grid i-quants (iquants): indices into fixed lattices, sign bits, a scale per 16 or 32 values
    WeightType("iq3_s", _T.IQ3_S, QK_K, (("d", 2), ("qs", QK_K // 4), ("qh", QK_K // 32), ("signs", QK_K // 8),
                                         ("scales", QK_K // 64)),
               iquants.decode_iq3_s, "9-bit indices into a 4-value grid, sign bits, 4-bit scale per 32 values"),
    WeightType("iq3_xxs", _T.IQ3_XXS, QK_K, (("d", 2), ("qs", QK_K // 4), ("scales", QK_K // 8)),
               iquants.decode_iq3_xxs, "8-bit indices into a 4-value grid, 7 sign bits per 8, 4-bit scale per 32"),
    WeightType("iq2_s", _T.IQ2_S, QK_K, (("d", 2), ("qs", QK_K // 8), ("signs", QK_K // 8), ("qh", QK_K // 32),
                                         ("scales", QK_K // 32)),
               iquants.decode_iq2_s, "10-bit indices into an 8-value grid, sign bits, 4-bit scale per 16 values"),
    WeightType("iq2_xs", _T.IQ2_XS, QK_K, (("d", 2), ("qs", QK_K // 4), ("scales", QK_K // 32)),
               iquants.decode_iq2_xs, "9-bit indices into an 8-value grid, 7 sign bits per 8, 4-bit scale per 16"),
    WeightType("iq2_xxs", _T.IQ2_XXS, QK_K, (("d", 2), ("qs", QK_K // 4)),
               iquants.decode_iq2_xxs, "8-bit indices into an 8-value grid, 7 sign bits per 8, 4-bit scale per 32"),
    WeightType("iq1_m", _T.IQ1_M, QK_K, (("qs", QK_K // 8), ("qh", QK_K // 16), ("scales", QK_K // 32)),
               iquants.decode_iq1_m, "11-bit indices into a ternary grid, 3-bit scale per 16 values"),
    WeightType("iq1_s", _T.IQ1_S, QK_K, (("d", 2), ("qs", QK_K // 8), ("qh", QK_K // 16)),
               iquants.decode_iq1_s, "11-bit indices into a ternary grid, 3-bit scale per 32 values"),
    WeightType("mxfp4", _T.MXFP4, QK, (("e", 1), ("qs", QK // 2)),
               iquants.decode_mxfp4, "e8m0 shared exponent, 4-bit e2m1 values (OCP microscaling)"),
    WeightType("nvfp4", _T.NVFP4, 2 * QK, (("scales", 4), ("qs", QK)),
               iquants.decode_nvfp4, "4-bit e2m1 values, an e4m3 scale per 16 (NVIDIA's FP4)"),
    # Float matrices inside a quantized file (rows that are not whole blocks) stay as stored too.
    _float("f32", _T.F32, torch.float32),
    _float("f16", _T.F16, torch.float16),
    _float("bf16", _T.BF16, torch.bfloat16),
)
_BY_NAME = {t.name: t for t in TABLE}
_BY_GGML = {t.ggml_type: t for t in TABLE}


def names() -> list[str]:
    return [t.name for t in TABLE]


def encodable_names() -> list[str]:
    """Types a dense checkpoint can be quantized to at load time (``--weights``)."""
    return [t.name for t in TABLE if t.can_encode]


def get(name: str) -> WeightType:
    key = name.lower()
    if key not in _BY_NAME:
        raise ValueError(f"unknown weight type {name!r}; valid: {', '.join(names())}")
    return _BY_NAME[key]


def from_ggml(ggml_type) -> WeightType | None:
    """The row for a GGUF tensor type, None if that type is not supported."""
    return _BY_GGML.get(ggml_type)


def supported_message() -> str:
    return "supported quantized weight types: " + ", ".join(t.ggml_type.name for t in TABLE if not t.is_float)
