"""Dense little-endian bit packing of small unsigned codes (1 to 8 bits).

Eight codes of b bits form one b-byte word, code i at bits [b*i, b*i + b):
for b = 4 that is the usual low-nibble-first order, for b = 3 eight codes
share three bytes with nothing wasted.
"""
from __future__ import annotations

import torch


def packed_bytes(n_values: int, bits: int) -> int:
    """Bytes that ``n_values`` codes of ``bits`` bits occupy (n_values % 8 == 0)."""
    return n_values * bits // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) integer codes < 2**bits -> (..., n*bits/8) uint8; n must be a multiple of 8."""
    n = codes.shape[-1]
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], n // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1, keepdim=True)                      # (..., n/8, 1)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = (word >> byte_shifts) & 0xFF                              # (..., n/8, bits)
    return out.to(torch.uint8).reshape(*codes.shape[:-1], n * bits // 8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """(..., n*bits/8) uint8 -> (..., n) int64 codes; inverse of ``pack_bits``."""
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], n // 8, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True)                 # (..., n/8, 1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((word >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], n)
