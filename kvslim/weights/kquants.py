"""Torch decoders for ggml's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS: 256-value
super-blocks.

Each takes (N, block_bytes) uint8 and returns (N, 256) float32, bit-identical to
``gguf.quants.dequantize`` (and so to ggml's ``dequantize_row_*``): every product is
formed in float32 in the same order, with no fused multiply-add. The byte layouts
are the ``fields`` of the rows in ``types.TABLE``; decoders read fields by name.
"""
from __future__ import annotations

import torch

from ..formats.base import cached_on, fp16_from_bytes
from ..formats.ggml import IQ4NL_VALUES

QK_K = 256           # values per super-block
SUB = 32             # values per sub-block with its own 6-bit scale (Q4_K, Q5_K)


def _bits(x: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """(N, G, L) bytes -> (N, G, len(shifts), L): ``(x >> s) & mask`` for each shift."""
    s = cached_on(x.device, ("k-quant shifts", tuple(shifts)),
                  lambda: torch.tensor(shifts, dtype=torch.uint8)).view(1, 1, -1, 1)
    return (x.unsqueeze(2) >> s) & mask


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> (scales, mins), each (N, 8) of 6-bit values.

    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales/mins 4-7 take
    their low nibble from bytes 8-11 and their top 2 bits from bytes 0-3 / 4-7.
    """
    d, m, md = scales.view(-1, 3, 4).unbind(1)                     # (N, 4) each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _affine_subblocks(f: dict[str, torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """value = (d * scale) * q - (dmin * min) per 32-value sub-block; q (N, 8, 32)."""
    n = q.shape[0]
    sc, mn = scale_min_k4(f["scales"])
    scale = fp16_from_bytes(f["d"]).view(n, 1) * sc.float()        # (N, 8)
    offset = fp16_from_bytes(f["dmin"]).view(n, 1) * mn.float()
    return (scale.unsqueeze(-1) * q.float() - offset.unsqueeze(-1)).reshape(n, QK_K)


def codes_q4_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, 8, 32) codes 0-15: each 32 bytes of qs carry two sub-blocks, low nibbles first."""
    qs = f["qs"]
    return _bits(qs.view(qs.shape[0], -1, SUB), [0, 4], 0x0F).reshape(qs.shape[0], -1, SUB)


def codes_q5_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, 8, 32) codes 0-31: Q4_K's nibbles plus a fifth bit, bit j of qh[l] for sub-block j."""
    qh = f["qh"]
    high = _bits(qh.view(qh.shape[0], 1, SUB), list(range(8)), 0x01).reshape(qh.shape[0], -1, SUB)
    return codes_q4_k(f) | (high << 4)


def codes_q6_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, 8, 32) codes 0-63, the values' q plus 32: two halves of 128 values; in each, ql's 64
    bytes give 4 low-nibble groups and qh's 32 bytes the 2-bit tops."""
    ql, qh = f["ql"], f["qh"]
    n = ql.shape[0]
    low = _bits(ql.view(n, 2, 64), [0, 4], 0x0F).reshape(n, -1, SUB)
    high = _bits(qh.view(n, 2, SUB), [0, 2, 4, 6], 0x03).reshape(n, -1, SUB)
    return low | (high << 4)


def decode_q4_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _affine_subblocks(f, codes_q4_k(f))


def decode_q5_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return _affine_subblocks(f, codes_q5_k(f))


def decode_q6_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Codes offset by 32; one int8 scale per 16 values."""
    n = f["ql"].shape[0]
    q = (codes_q6_k(f).view(torch.int8) - 32).view(n, QK_K // 16, 16)
    scale = fp16_from_bytes(f["d"]).view(n, 1) * f["scales"].view(torch.int8).float()   # (N, 16)
    return (scale.unsqueeze(-1) * q.float()).reshape(n, QK_K)


def decode_q3_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """2-bit codes in two halves of 128 (32 bytes of qs each, 4 shifts), minus 4 where the hmask
    bit is clear (bit b of hmask[l] belongs to sub-block b); a six-bit scale (stored plus 32) per
    16 values: 4 low bits from bytes 0-7, 2 high bits from bytes 8-11."""
    qs, hmask, sc = f["qs"], f["hmask"], f["scales"]
    n = qs.shape[0]
    low = _bits(sc[:, :8].reshape(n, 1, 8), [0, 4], 0x0F).reshape(n, 16)
    high = _bits(sc[:, 8:].reshape(n, 1, 4), [0, 2, 4, 6], 0x03).reshape(n, 16)
    scale = ((low | (high << 4)).view(torch.int8) - 32).float()
    dl = (fp16_from_bytes(f["d"]).view(n, 1) * scale).view(n, 16, 1)
    ql = _bits(qs.view(n, 2, SUB), [0, 2, 4, 6], 0x03).reshape(n, 16, 16)
    qh = _bits(hmask.view(n, 1, SUB), list(range(8)), 0x01).reshape(n, 16, 16) ^ 1
    q = (ql.view(torch.int8) - (qh << 2).view(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def decode_q2_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """2-bit codes as Q3_K's; per 16 values a byte of 4-bit scale (low) and 4-bit min (high):
    value = (d * scale) * q - dmin * min."""
    qs, sc = f["qs"], f["scales"]
    n = qs.shape[0]
    dl = (fp16_from_bytes(f["d"]).view(n, 1) * (sc & 0x0F).float()).view(n, 16, 1)
    ml = (fp16_from_bytes(f["dmin"]).view(n, 1) * (sc >> 4).float()).view(n, 16, 1)
    q = _bits(qs.view(n, 2, SUB), [0, 2, 4, 6], 0x03).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)



def iq4_xs_scales(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, 8) int8 scales, one per 32 values: six bits stored plus 32, the 4 low ones in
    scales_l (byte j // 2, nibble j % 2), the 2 high in the 16-bit scales_h."""
    lo, hi = f["scales_l"], f["scales_h"]
    n = lo.shape[0]
    low = _bits(lo.view(n, 1, 4), [0, 4], 0x0F).transpose(2, 3).reshape(n, 8)
    high16 = hi[:, 0].to(torch.int32) | (hi[:, 1].to(torch.int32) << 8)                          # (N,)
    shifts = cached_on(lo.device, ("iq4_xs shifts",), lambda: torch.arange(0, 16, 2, dtype=torch.int32))
    high = ((high16.view(n, 1) >> shifts) & 3).to(torch.uint8)                                # (N, 8)
    return (low | (high << 4)).view(torch.int8) - 32


def iq4_xs_indices(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, 8, 32) grid indices: 16 bytes per 32 values, low nibbles first."""
    qs = f["qs"]
    return _bits(qs.view(qs.shape[0], 8, 16), [0, 4], 0x0F).reshape(qs.shape[0], 8, 32).long()


def decode_iq4_xs(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """IQ4_NL's grid in super-blocks, a scale per 32 values."""
    n = f["qs"].shape[0]
    dl = (fp16_from_bytes(f["d"]).view(n, 1) * iq4_xs_scales(f).float()).view(n, 8, 1)
    grid = cached_on(f["qs"].device, ("iq4_nl grid",), lambda: torch.tensor(IQ4NL_VALUES, dtype=torch.float32))
    return (dl * grid[iq4_xs_indices(f)]).reshape(n, QK_K)
