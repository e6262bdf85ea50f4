"""Torch decoders for ggml's grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S) and the 4-bit float types MXFP4 and NVFP4.

The 2- and 3-bit files that fit a 35B mixture or an 80B Qwen3-Next into 24-32 GB are made of
these. An i-quant stores, per 4 or 8 values, an index into a fixed grid of small magnitudes
(chosen by llama.cpp's quantizer as the lattice points nearest typical weights) plus sign bits
and a scale per 16 or 32 values. The grids are data of ``gguf.quants`` (the pinned reader this
package already uses); ``native.lattices.grid(name)`` unpacks them once, so every decoder here
and the C and Triton kernels read one source.

Each decoder takes named fields (``types.TABLE``'s layout) and returns (N, block_size) float32,
bit-identical to ``gguf.quants.dequantize``: products in float32 in the same order.
"""
from __future__ import annotations

import numpy as np
import torch

from ..formats.base import cached_on, fp16_from_bytes
from ..native.lattices import MXFP4_VALUES, grid, ksigns, ue4m3_halves

IQ1_DELTA = 0.125                        # IQ1_S/IQ1_M: every grid value is shifted by +-1/8


def _grid_on(device, name: str) -> torch.Tensor:
    return cached_on(device, ("iq grid f32", name), lambda: torch.from_numpy(grid(name).astype(np.float32)))


def _fields(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """(...,) integers -> (..., len(shifts)) int64: ``(x >> s) & mask`` for each shift."""
    s = cached_on(x.device, ("iq shifts", shifts), lambda: torch.tensor(shifts, dtype=torch.int64))
    return (x.to(torch.int64).unsqueeze(-1) >> s) & mask


BITS = tuple(range(8))
SIGN_INDICES = (0, 7, 14, 21)            # the 4 x 7-bit sign indices of an XXS word


def _signs_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """(...,) sign bytes -> (..., 8) float32 +-1: bit l set makes value l negative."""
    return 1.0 - 2.0 * _fields(b, BITS, 1).float()


def _signs_from_index(idx: torch.Tensor) -> torch.Tensor:
    """(...,) 7-bit sign indices -> (..., 8) +-1 through ``ksigns``."""
    table = cached_on(idx.device, ("iq ksigns",), lambda: torch.from_numpy(ksigns().astype(np.int32)))
    return _signs_from_bytes(table[idx.long()])


def _words(b: torch.Tensor, width: int) -> torch.Tensor:
    """(N, k * width) little-endian bytes -> (N, k) int64 words."""
    parts = b.reshape(b.shape[0], -1, width).to(torch.int64)
    return sum(parts[..., i] << (8 * i) for i in range(width))


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """(N, k) bytes -> (N, 2k): low then high nibble of each byte."""
    return _fields(b, (0, 4), 0x0F).reshape(b.shape[0], -1)


def _lookup(name: str, idx: torch.Tensor) -> torch.Tensor:
    """(N, k) grid indices -> (N, k, values per entry) float32."""
    g = _grid_on(idx.device, name)
    return g[idx.reshape(-1)].reshape(*idx.shape, g.shape[1])


def _d(f) -> torch.Tensor:
    return fp16_from_bytes(f["d"]).view(-1, 1)


def decode_iq2_xxs(f) -> torch.Tensor:
    """Per 32 values two words: 4 grid indices (8 values each), then 4 x 7 sign bits and a
    4-bit scale on top; value = d * (0.5 + s) * 0.25 * grid * sign."""
    words = _words(f["qs"], 4).view(-1, 8, 2)
    n = words.shape[0]
    db = (_d(f) * (0.5 + (words[..., 1] >> 28).float()) * 0.25).view(n, 8, 1, 1)
    signs = _signs_from_index(_fields(words[..., 1], SIGN_INDICES, 0x7F))
    values = _lookup("iq2_xxs", f["qs"].reshape(n, 8, 8)[..., :4].to(torch.int64))
    return (db * values * signs).reshape(n, -1)


def decode_iq2_xs(f) -> torch.Tensor:
    """A 16-bit word per 8 values: 9 bits of grid index, 7 of signs; a 4-bit scale per 16."""
    words = _words(f["qs"], 2)                                               # (N, 32)
    n = words.shape[0]
    db = (_d(f) * (0.5 + _nibbles(f["scales"]).float()) * 0.25).view(n, 16, 1, 1)
    values = _lookup("iq2_xs", words & 511).view(n, 16, 2, 8)
    return (db * values * _signs_from_index(words >> 9).view(n, 16, 2, 8)).reshape(n, -1)


def decode_iq2_s(f) -> torch.Tensor:
    """10-bit grid indices (a byte of qs, 2 bits of qh), a sign byte per 8 values, 4-bit scales."""
    n = f["qs"].shape[0]
    high = _fields(f["qh"], (0, 2, 4, 6), 3)
    idx = f["qs"].to(torch.int64) | (high.reshape(n, -1) << 8)
    db = (_d(f) * (0.5 + _nibbles(f["scales"]).float()) * 0.25).view(n, 16, 1, 1)
    values = _lookup("iq2_s", idx).view(n, 16, 2, 8)
    return (db * values * _signs_from_bytes(f["signs"]).view(n, 16, 2, 8)).reshape(n, -1)


def decode_iq3_xxs(f) -> torch.Tensor:
    """A byte of grid index per 4 values; per 32 values a word of 4 x 7 sign bits and a 4-bit
    scale: value = d * (0.5 + s) * 0.5 * grid * sign."""
    words = _words(f["scales"], 4)                                           # (N, 8)
    n = words.shape[0]
    db = (_d(f) * (0.5 + (words >> 28).float()) * 0.5).view(n, 8, 1, 1)
    signs = _signs_from_index(_fields(words, SIGN_INDICES, 0x7F))
    values = _lookup("iq3_xxs", f["qs"].to(torch.int64)).view(n, 8, 4, 8)
    return (db * values * signs).reshape(n, -1)


def decode_iq3_s(f) -> torch.Tensor:
    """9-bit grid indices (a byte of qs, a bit of qh), a sign byte per 8 values, and per 32
    values a 4-bit scale: value = d * (1 + 2s) * grid * sign."""
    n = f["qs"].shape[0]
    high = _fields(f["qh"], BITS, 1)
    idx = f["qs"].to(torch.int64) | (high.reshape(n, -1) << 8)
    db = (_d(f) * (1 + 2 * _nibbles(f["scales"])).float()).view(n, 8, 1, 1)
    values = _lookup("iq3_s", idx).view(n, 8, 4, 8)
    return (db * values * _signs_from_bytes(f["signs"]).view(n, 8, 4, 8)).reshape(n, -1)


def decode_iq1_s(f) -> torch.Tensor:
    """Per 32 values a 16-bit word: 4 x 3 high bits of the 11-bit grid indices, a 3-bit scale,
    and the sign of the delta; value = d * (2s + 1) * (grid +- 1/8)."""
    qh = _words(f["qh"], 2)                                                  # (N, 8)
    n = qh.shape[0]
    dl = (_d(f) * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).view(n, 8, 1, 1)
    high = _fields(qh, (0, 3, 6, 9), 7)
    idx = f["qs"].to(torch.int64) | (high.reshape(n, -1) << 8)
    values = _lookup("iq1_s", idx).view(n, 8, 4, 8)
    return (dl * (values + delta)).reshape(n, -1)


def iq1_m_d(scales: torch.Tensor) -> torch.Tensor:
    """IQ1_M's fp16 super-scale: the top nibbles of its four 16-bit scale words, in order."""
    words = _words(scales, 2)
    bits = sum((words[:, i] >> 12) << (4 * i) for i in range(4))
    return bits.to(torch.int16).view(torch.float16).float().view(-1, 1)


def decode_iq1_m(f) -> torch.Tensor:
    """IQ1_S's grid with 3-bit scales per 16 values (12 bits of each scale word; the top nibbles
    make the fp16 super-scale) and a delta sign per 8 values (bit 3 of each qh nibble)."""
    words = _words(f["scales"], 2)                                           # (N, 4)
    n = words.shape[0]
    sc = _fields(words, (0, 3, 6, 9), 7)
    dl = (iq1_m_d(f["scales"]) * (2 * sc.reshape(n, 16) + 1).float()).view(n, 8, 2, 1, 1)
    qh = _nibbles(f["qh"])                                                   # (N, 32): one per grid entry
    idx = f["qs"].to(torch.int64) | ((qh & 7) << 8)
    delta = torch.where((qh & 8) == 0, IQ1_DELTA, -IQ1_DELTA).view(n, 8, 2, 2, 1)
    values = _lookup("iq1_s", idx).view(n, 8, 2, 2, 8)
    return (dl * (values + delta)).reshape(n, -1)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's shared exponent byte as float32 2^(e - 128) (the values are stored doubled);
    e < 2 gives a subnormal."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _e2m1(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes of e2m1 codes -> (..., 2k) float32 values (doubled, as ggml keeps them):
    each row's low nibbles, then its high nibbles."""
    table = cached_on(qs.device, ("e2m1 values",), lambda: torch.tensor(MXFP4_VALUES, dtype=torch.float32))
    qs = qs.to(torch.int64)
    return table[torch.cat([qs & 0x0F, qs >> 4], dim=-1)]


def decode_mxfp4(f) -> torch.Tensor:
    """32 values: an e8m0 exponent, then 16 bytes of e2m1 codes, low nibbles first."""
    return e8m0_half(f["e"]).view(-1, 1) * _e2m1(f["qs"])


def ue4m3_half(b: torch.Tensor) -> torch.Tensor:
    """NVFP4's unsigned e4m3 scale bytes as float32, halved (the values are stored doubled):
    ``lattices.ue4m3_halves``' table, gguf.quants' own values, which the C kernels read too."""
    table = cached_on(b.device, ("ue4m3 halves",), lambda: torch.from_numpy(ue4m3_halves()))
    return table[b.long()]


def decode_nvfp4(f) -> torch.Tensor:
    """64 values: four e4m3 scales (one per 16 values), then 32 bytes of e2m1 codes, 8 per
    16 values: a sub-block's low nibbles are its values 0-7, the high nibbles 8-15."""
    n = f["qs"].shape[0]
    return (ue4m3_half(f["scales"]).view(n, 4, 1) * _e2m1(f["qs"].view(n, 4, 8))).reshape(n, 64)
