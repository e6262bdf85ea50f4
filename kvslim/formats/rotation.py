"""Seeded orthogonal rotations for TurboQuant.

Power-of-two sizes use signs * normalised Walsh-Hadamard * signs (the layout of
llama.cpp's TurboQuant fork); other sizes use a Haar-random orthogonal matrix
from the QR factorisation of a Gaussian matrix. Either way the rotation is kept
as a dense (n, n) float32 matrix: at n <= 128 one matmul is faster on CPU and
GPU than a butterfly in Python, and the same matrix serves keys and queries.
"""
from __future__ import annotations

import functools

import torch

from .base import cached_on, is_power_of_two


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of size n (a power of two), entries +-1, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _generator(seed: int, n: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + n * 7919 + salt) % (1 << 62))


@functools.lru_cache(maxsize=None)
def _rotation_cpu(n: int, seed: int) -> torch.Tensor:
    if is_power_of_two(n):
        gen = _generator(seed, n, 1)
        s1 = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        s2 = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        r = s2[:, None] * hadamard(n) * s1[None, :] / n ** 0.5
    else:
        gen = _generator(seed, n, 2)
        q, rr = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        r = q * torch.sign(torch.diagonal(rr))[None, :]  # sign fix makes it Haar-distributed
    return r.float().contiguous()


def rotation_matrix(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthogonal (n, n) float32 matrix R; a vector x rotates as ``x @ R.T``."""
    return cached_on(device, ("rotation", n, seed), lambda: _rotation_cpu(n, seed))


@functools.lru_cache(maxsize=None)
def _gaussian_cpu(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, n, generator=_generator(seed, n, 3), dtype=torch.float32)


def gaussian_matrix(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Seeded (n, n) matrix of N(0, 1) entries: the QJL sketch of the product variant."""
    return cached_on(device, ("qjl", n, seed), lambda: _gaussian_cpu(n, seed))
