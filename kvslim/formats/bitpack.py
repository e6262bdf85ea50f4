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
    """(..., n*bits/8) uint8 -> (..., n) codes; inverse of ``pack_bits``.

    Widths that divide 8 unpack with byte shifts (uint8 result); the others
    assemble each b-byte word in int32 or int64 first (int64 result).
    """
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)           # (..., bytes, per_byte)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    word_dtype = torch.int32 if bits * 8 <= 31 else torch.int64
    b = packed.to(word_dtype).reshape(*packed.shape[:-1], n // 8, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=word_dtype) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True, dtype=word_dtype)          # (..., n/8, 1)
    shifts = torch.arange(8, device=packed.device, dtype=word_dtype) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], n).long()


def byte_table(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(256, 8/bits) table: the codebook values of the codes packed in each byte value.

    Decoding through it is one gather per byte instead of unpack-then-gather per code.
    """
    byte = torch.arange(256, device=values.device)
    shifts = torch.arange(0, 8, bits, device=values.device)
    return values[(byte[:, None] >> shifts) & ((1 << bits) - 1)]
