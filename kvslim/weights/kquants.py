"""Torch decoders for ggml's K-quants (Q4_K, Q5_K, Q6_K): 256-value super-blocks.

Each takes (N, block_bytes) uint8 and returns (N, 256) float32, bit-identical to
``gguf.quants.dequantize`` (and so to ggml's ``dequantize_row_*``): every product is
formed in float32 in the same order, with no fused multiply-add. The byte layouts
are the ``fields`` of the rows in ``types.TABLE``; decoders read fields by name.
"""
from __future__ import annotations

import torch

from ..formats.base import cached_on, fp16_from_bytes

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


def decode_q4_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each 32 bytes of qs carry two sub-blocks: low nibbles first, then high nibbles."""
    qs = f["qs"]
    q = _bits(qs.view(qs.shape[0], -1, SUB), [0, 4], 0x0F)        # (N, 4, 2, 32)
    return _affine_subblocks(f, q.reshape(qs.shape[0], -1, SUB))


def decode_q5_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Q4_K's nibbles plus a fifth bit: bit j of qh[l] belongs to sub-block j, position l."""
    qs, qh = f["qs"], f["qh"]
    n = qs.shape[0]
    low = _bits(qs.view(n, -1, SUB), [0, 4], 0x0F).reshape(n, -1, SUB)        # (N, 8, 32)
    high = _bits(qh.view(n, 1, SUB), list(range(8)), 0x01).reshape(n, -1, SUB)
    return _affine_subblocks(f, low | (high << 4))


def decode_q6_k(f: dict[str, torch.Tensor]) -> torch.Tensor:
    """Two halves of 128 values; in each, ql's 64 bytes give 4 low-nibble groups and
    qh's 32 bytes the 2-bit tops; codes are offset by 32; one int8 scale per 16 values."""
    ql, qh = f["ql"], f["qh"]
    n = ql.shape[0]
    low = _bits(ql.view(n, 2, 64), [0, 4], 0x0F).reshape(n, -1, SUB)          # (N, 8, 32)
    high = _bits(qh.view(n, 2, SUB), [0, 2, 4, 6], 0x03).reshape(n, -1, SUB)
    q = ((low | (high << 4)).view(torch.int8) - 32).view(n, QK_K // 16, 16)
    scale = fp16_from_bytes(f["d"]).view(n, 1) * f["scales"].view(torch.int8).float()   # (N, 16)
    return (scale.unsqueeze(-1) * q.float()).reshape(n, QK_K)
