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


# ----- llama.cpp's attention rotation (upstream PR #21038) ---------------------------
# Upstream rotates quantized K and V with a plain orthonormal Sylvester Walsh-Hadamard
# matrix (no random signs), block-diagonally along the head: K (and the query) in
# blocks of the largest power of two dividing head_dim, V in blocks of 64, and the
# attention output goes back through V's matrix. Heads not a multiple of 64 stay
# unrotated. H / sqrt(n) is symmetric and its own inverse, so one function serves both ways.
LLAMA_ROT_MIN = 64


def llama_rot_size(head_dim: int, role: str) -> int:
    """Hadamard block size llama.cpp uses for a K or V head of ``head_dim`` (0: no rotation)."""
    if head_dim % LLAMA_ROT_MIN:
        return 0
    if role == "v":
        return LLAMA_ROT_MIN
    return head_dim & -head_dim          # the largest power of two dividing head_dim


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal Sylvester Walsh-Hadamard matrix H / sqrt(n), float32; symmetric, H @ H = I."""
    return cached_on(device, ("hadamard", n), lambda: (hadamard(n) / n ** 0.5).float())


def hadamard_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """Apply H / sqrt(n) to every run of ``n`` values along the last dimension (its own inverse).
    On the CPU (outside autograd and traced graphs) the C butterfly, elsewhere the torch one:
    the same float32 operations in the same order, so the same bits."""
    if n == 0:
        return x
    from ..native import kv_encode                # formats import before native: import at use
    if kv_encode.serves_hadamard(x):
        return kv_encode.hadamard_rows(x, n)
    return hadamard_blocks_torch(x, n)


def hadamard_blocks_torch(x: torch.Tensor, n: int) -> torch.Tensor:
    """The reference butterfly (log2 n rounds of sums and differences), not a matmul: each row's
    result is then the same whatever else is in the batch (a matmul's blocking depends on the
    batch size and rounds differently), so a token encodes to the same bytes alone or inside a
    prefill chunk."""
    if n == 0:
        return x
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)                       # (rows, blocks, halves, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return (y * n ** -0.5).reshape(x.shape)
