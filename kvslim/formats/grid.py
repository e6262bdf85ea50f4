"""Rotated block formats with a fitted non-uniform grid ("nl" family: nl4, nl3).

Each row is first Hadamard-rotated exactly as llama.cpp rotates its quantized
caches (``rotation.llama_rot_size``: K in blocks of the largest power of two
dividing head_dim, V in blocks of 64), so the values are close to Gaussian. Then,
per block of ``block_size`` values: an fp16 scale ``d`` and ``code_bits``-bit
indices into a fixed grid; value = grid[code] * d. The grid was fitted offline to
rotated data together with the encoder's scale search (``benchmarks/format_study.py``
prints how), the way iq4_nl's grid suits its search, and the scale is chosen per
block by trying ``SCALE_TRIES`` candidates and refitting each by least squares
(iq4_nl's search on top of the rotation).

Block bytes: [fp16 d][codes, dense little-endian bit packing (bitpack.py)].
nl4: 64 values in 34 bytes = 4.25 bits/value; nl3: 32 values in 14 bytes = 3.5.

The "nls" rows (nl4s, nl3s) spend the same header bits on two scale levels: per block
of 128 one fp16 scale ``d`` and, per sub-block of 16, a 2-bit index ``j`` into the
fixed ladder ``SUB_LADDER``: value = grid[code] * d * SUB_LADDER[j]. The encoder picks
each sub-block's rung by squared error and refits ``d`` by least squares (twice).
Block bytes: [fp16 d][8 x 2-bit rungs][codes]. nl4s: 128 values in 68 bytes = 4.25
bits/value (nl4's size, NMSE 0.0055 instead of 0.0069); nl3s: 52 bytes = 3.25.
"""
from __future__ import annotations

import dataclasses

import torch

from .base import (FP16_MAX, CodeRotation, KernelEncoder, KernelRow, KVFormat, bucketize, cached_on, fp16_bytes,
                   fp16_from_bytes)
from .bitpack import byte_table, pack_bits, packed_bytes, unpack_bits
from .rotation import hadamard_blocks, llama_rot_size

# Grids in units of the scale, fitted by benchmarks/format_study.py (alternating
# nearest-code assignment, per-block scale search and centroid update on rotated
# N(0,1) rows); symmetric, so that a zero-mean block stays zero-mean.
GRIDS: dict[int, tuple[float, ...]] = {
    4: (-1.000000, -0.764254, -0.596612, -0.460142, -0.342740, -0.237482, -0.139672, -0.046021,
        0.046021, 0.139672, 0.237482, 0.342740, 0.460142, 0.596612, 0.764254, 1.000000),
    3: (-1.000000, -0.607315, -0.335017, -0.107295, 0.107295, 0.335017, 0.607315, 1.000000),
    2: (-1.000000, -0.290855, 0.290855, 1.000000),
}
SCALE_TRIES = 16                  # candidate scales per block
SCALE_SPAN = (0.60, 1.10)         # candidates: d = amax / grid_max * f, f spread over this span
SUB_BLOCK = 16                    # nls: values per rung of the ladder
SUB_BITS = 2                      # nls: bits per rung index
# nls rungs: geometric from 1 down to 0.6 (measured: 0.6 beats 0.5, 0.7 and 0.8 on N(0,1)).
SUB_LADDER = tuple(0.6 ** (j / ((1 << SUB_BITS) - 1)) for j in range(1 << SUB_BITS))
ENCODE_CHUNK = 1 << 13            # blocks per step: bounds the (blocks, tries, block) tensors


def grid_tensor(bits: int, device) -> torch.Tensor:
    """The ``bits``-bit grid as a sorted float32 tensor on ``device``."""
    return cached_on(device, ("nl_grid", bits), lambda: torch.tensor(GRIDS[bits], dtype=torch.float32))


def nearest_code(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point for every value of ``v`` (grid sorted ascending)."""
    mids = (grid[1:] + grid[:-1]) * 0.5
    return bucketize(v, mids)


def search_scale(blocks: torch.Tensor, grid: torch.Tensor, tries: int = SCALE_TRIES,
                 span: tuple[float, float] = SCALE_SPAN) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale and codes minimising the squared error.

    Args:
        blocks: (N, B) float32 values.
        grid: sorted grid (K,).
    Returns:
        (d (N,), codes (N, B)): each candidate scale's codes are refit by least squares,
        the best candidate is kept, the codes are reassigned with it and refit once more.
    """
    amax = blocks.abs().amax(-1)                                               # (N,)
    f = torch.linspace(span[0], span[1], tries, device=blocks.device)
    d0 = (amax / grid.abs().max()).clamp_min(1e-30)
    cand = d0[:, None] * f[None, :]                                            # (N, T)
    g = grid[nearest_code(blocks[:, None, :] / cand[..., None], grid)]         # (N, T, B)
    sum_xg = (g * blocks[:, None, :]).sum(-1)
    sum_gg = (g * g).sum(-1).clamp_min(1e-30)
    best = (sum_xg * sum_xg / sum_gg).argmax(-1, keepdim=True)                 # max explained energy
    d = (sum_xg / sum_gg).gather(-1, best).squeeze(-1)
    codes = nearest_code(blocks / d.clamp_min(1e-30)[:, None], grid)
    g = grid[codes]
    d = (g * blocks).sum(-1) / (g * g).sum(-1).clamp_min(1e-30)
    live = amax > 0
    return torch.where(live, d, torch.zeros_like(d)), codes


class GridFormat(KVFormat):
    """Rotated, per-block fp16 scale, fitted non-uniform grid; ``role`` picks llama.cpp's
    rotation size for K or V."""

    def __init__(self, spec, role: str = "k"):
        super().__init__(spec)
        if role not in ("k", "v"):
            raise ValueError(f"{spec.name}: role must be 'k' or 'v', got {role!r}")
        self.role = role

    def rot_size(self, head_dim: int) -> int:
        return llama_rot_size(head_dim, self.role)

    def kernel_row(self, head_dim: int) -> KernelRow:
        """Per block [f16 scale][codes], value = scale * grid[code]."""
        bits = self.spec.code_bits
        return KernelRow("packed", bits, self.spec.block_size, tuple(grid_tensor(bits, "cpu").tolist()))

    def kernel_encoder(self, head_dim: int) -> KernelEncoder:
        """The Hadamard butterfly, then search_scale's tables as float32: the grid, its midpoints
        (nearest_code's boundaries) and the candidate factors."""
        bits = self.spec.code_bits
        grid = grid_tensor(bits, "cpu")
        return KernelEncoder("grid", self.spec.block_size, bits, rot=self.rot_size(head_dim), hadamard=True,
                             boundaries=(grid[1:] + grid[:-1]) * 0.5, centroids=grid,
                             tries=torch.linspace(SCALE_SPAN[0], SCALE_SPAN[1], SCALE_TRIES), limit=self._max_abs())

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.spec.block_size or head_dim % 64:
            raise ValueError(f"{self.name}: head_dim {head_dim} must be a multiple of 64 (the rotation) "
                             f"and of the block size {self.spec.block_size}")

    def _max_abs(self) -> float | None:
        return FP16_MAX * max(GRIDS[self.spec.code_bits]) * 0.9

    # ----- attention hooks -----------------------------------------------------------
    @property
    def transformed(self) -> bool:
        return True

    def to_code_domain(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_blocks(x, self.rot_size(x.shape[-1]))

    def from_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        return hadamard_blocks(y, self.rot_size(y.shape[-1]))

    def code_rotation(self, head_dim: int, device) -> CodeRotation | None:
        size = self.rot_size(head_dim) if self.transformed else 0
        return CodeRotation(size) if size else None

    def decode_code_domain(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        blocks = packed.reshape(-1, self.spec.block_bytes)
        d = fp16_from_bytes(blocks[:, :2])
        g = self._grid_values(blocks[:, 2:])
        return (g * d[:, None]).reshape(*packed.shape[:-1], head_dim)

    def _grid_values(self, code_bytes: torch.Tensor) -> torch.Tensor:
        """(N, block*bits/8) packed codes -> (N, block) grid values."""
        bits, n = self.spec.code_bits, code_bytes.shape[0]
        grid = grid_tensor(bits, code_bytes.device)
        if 8 % bits == 0:     # one gather per byte (two codes) instead of unpack-then-gather
            table = cached_on(code_bytes.device, ("nl_byte_table", bits), lambda: byte_table(grid, bits))
            return torch.nn.functional.embedding(code_bytes.int(), table).reshape(n, -1)
        if bits == 3:         # 3 bytes = two 12-bit halves of 4 codes each, one gather per half
            return self._lookup12(code_bytes, grid).reshape(n, -1)
        return grid[unpack_bits(code_bytes, bits, self.spec.block_size)]

    @staticmethod
    def _lookup12(code_bytes: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """(N, 3m) bytes of 3-bit codes -> (N, m, 8) grid values."""
        table = cached_on(code_bytes.device, ("nl_table12",),
                          lambda: grid[(torch.arange(4096)[:, None] >> torch.arange(0, 12, 3)) & 7])
        w = code_bytes.reshape(code_bytes.shape[0], -1, 3).int()                   # (N, m, 3)
        lo = w[..., 0] | ((w[..., 1] & 0xF) << 8)
        hi = (w[..., 1] >> 4) | (w[..., 2] << 4)
        emb = torch.nn.functional.embedding
        return torch.cat([emb(lo, table), emb(hi, table)], dim=-1)

    # ----- coding -----------------------------------------------------------------------
    codes_code_domain = True                  # blocks of the rotated row; the range check applies there

    def _encode_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        bits = self.spec.code_bits
        grid = grid_tensor(bits, y.device)
        parts = []
        for blocks in y.reshape(-1, self.spec.block_size).split(ENCODE_CHUNK):     # (N, B)
            d, codes = search_scale(blocks, grid)
            parts.append(torch.cat([fp16_bytes(d), pack_bits(codes, bits)], dim=-1))
        return torch.cat(parts).reshape(*y.shape[:-1], -1)

    def _decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.from_code_domain(self.decode_code_domain(packed, head_dim))


def pick_rungs(sub: torch.Tensor, d: torch.Tensor, grid: torch.Tensor,
               ladder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rung and codes of every sub-block for row scales ``d``.

    Args:
        sub: (N, S, B) values, S sub-blocks of B per block; d: (N,) block scales.
    Returns:
        (rungs (N, S), codes (N, S, B)) minimising each sub-block's squared error.
    """
    cand = (d[:, None, None] * ladder).clamp_min(1e-30)                     # (N, 1, R)
    codes = nearest_code(sub[:, :, None, :] / cand[..., None], grid)         # (N, S, R, B)
    err = ((sub[:, :, None, :] - grid[codes] * cand[..., None]) ** 2).sum(-1)
    rung = err.argmin(-1)                                                    # (N, S)
    return rung, codes.gather(2, rung[..., None, None].expand(-1, -1, 1, sub.shape[-1])).squeeze(2)


def refit_scale(sub: torch.Tensor, rung: torch.Tensor, codes: torch.Tensor, grid: torch.Tensor,
                ladder: torch.Tensor) -> torch.Tensor:
    """Least-squares block scale for fixed rungs and codes, rounded to fp16 as stored."""
    g = grid[codes] * ladder[rung][..., None]
    d = (g * sub).sum((-1, -2)) / (g * g).sum((-1, -2)).clamp_min(1e-30)
    return d.half().float()


def search_two_level(blocks: torch.Tensor, grid: torch.Tensor, ladder: torch.Tensor,
                     sub_block: int = SUB_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d (N,), rungs (N, S), codes (N, S, B)) of (N, S*B) blocks for the nls layout.

    Start: d = the largest of the sub-blocks' own best scales (``search_scale``), so
    the ladder (1 .. 0.6) reaches down from it; then twice: pick rungs and codes, refit d.
    """
    sub = blocks.reshape(blocks.shape[0], -1, sub_block)
    d_sub, _ = search_scale(sub.reshape(-1, sub_block), grid)
    d = d_sub.reshape(sub.shape[:2]).amax(-1).half().float()
    for _ in range(2):
        rung, codes = pick_rungs(sub, d, grid, ladder)
        d = refit_scale(sub, rung, codes, grid, ladder)
    return d, rung, codes


class SubScaleGridFormat(GridFormat):
    """Rotated, fp16 scale per block of 128 with a 2-bit ladder rung per 16 values,
    fitted non-uniform grid (the "nls" rows)."""

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.spec.block_size:
            raise ValueError(f"{self.name}: head_dim {head_dim} must be a multiple of the block size "
                             f"{self.spec.block_size}")

    def kernel_row(self, head_dim: int) -> KernelRow:
        """Per block of 128 [f16 d][a 2-bit rung per 16 values][codes]: d * ladder[rung] * grid[code]."""
        return dataclasses.replace(super().kernel_row(head_dim), header_bytes=self.spec.block_header_bytes,
                                   sub_values=SUB_BLOCK, sub_bits=SUB_BITS, ladder=SUB_LADDER)

    def kernel_encoder(self, head_dim: int) -> KernelEncoder:
        """The grid's search per sub-block, then a rung of the ladder per 16 values (two rounds)."""
        return dataclasses.replace(super().kernel_encoder(head_dim), kind="grid_sub", ladder=ladder_tensor("cpu"),
                                   sub_values=SUB_BLOCK)

    def _max_abs(self) -> float | None:
        # The refit d can reach the block maximum over the lowest rung (1.1 / 0.6 of it).
        return FP16_MAX * min(SUB_LADDER) / SCALE_SPAN[1] * 0.9

    def header_fields(self) -> tuple[tuple[str, int, int], ...]:
        return (("scale", 0, 2), ("rungs", 2, self.spec.block_header_bytes - 2))

    def _encode_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        bits, grid = self.spec.code_bits, grid_tensor(self.spec.code_bits, y.device)
        ladder = ladder_tensor(y.device)
        parts = []
        for blocks in y.reshape(-1, self.spec.block_size).split(ENCODE_CHUNK // 4):
            d, rung, codes = search_two_level(blocks, grid, ladder)
            parts.append(torch.cat([fp16_bytes(d), pack_bits(rung, SUB_BITS),
                                    pack_bits(codes.flatten(1), bits)], dim=-1))
        return torch.cat(parts).reshape(*y.shape[:-1], -1)

    def decode_code_domain(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        head = self.spec.block_header_bytes
        blocks = packed.reshape(-1, self.spec.block_bytes)
        d = fp16_from_bytes(blocks[:, :2])[:, None]
        g = self._grid_values(blocks[:, head:]).reshape(blocks.shape[0], -1, SUB_BLOCK)
        # Rungs through a byte table (four 2-bit rungs per byte), times d: one scale per 16 values.
        # (Folding the rung into a (rung, code byte) table measured 20% slower: the index build
        # costs more than the multiply it saves.)
        rung_table = cached_on(packed.device, ("nls_rungs",), lambda: byte_table(ladder_tensor("cpu"), SUB_BITS))
        scale = torch.nn.functional.embedding(blocks[:, 2:head].int(), rung_table).reshape(blocks.shape[0], -1)
        return (g * (scale * d)[..., None]).reshape(*packed.shape[:-1], head_dim)


def ladder_tensor(device) -> torch.Tensor:
    return cached_on(device, ("nls_ladder",), lambda: torch.tensor(SUB_LADDER, dtype=torch.float32))


__all__ = ["GridFormat", "SubScaleGridFormat", "GRIDS", "SUB_LADDER", "search_scale", "search_two_level",
           "nearest_code", "packed_bytes"]
