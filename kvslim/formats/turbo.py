"""TurboQuant KV formats (Zandieh et al., arXiv 2504.19874), MSE and product variants.

A row of head_dim values is split into groups of at most 128 (head_dim 256 ->
two groups, as in llama.cpp's fork). Per group:
  MSE variant (turbo2/3/4): keep the norm, rotate the unit vector with a seeded
    orthogonal matrix, quantize each coordinate to the nearest Lloyd-Max
    centroid for the exact rotated-coordinate density, pack the b-bit indices.
    The stored fp16 scale is ||x|| / ||centroids||, so a decoded vector keeps
    the input's length.
  Product variant (turbo3p/4p, experimental): (b-1)-bit MSE codes plus a 1-bit
    QJL sketch sign(S r) of the residual r and its norm; inner products with
    the decoded vector are unbiased.
Group bytes: [fp16 scale] ([fp16 residual norm]) [codes] ([sign bits]).

Keys can stay in the rotated domain: <q, k> = <R q, R k>, so attention rotates
the query once (``rotate``) and reads ``decode_rotated`` rows; values are summed
rotated and one ``unrotate`` is applied to the attention output.
"""
from __future__ import annotations

import math

import torch

from .base import (FP16_MAX, CodeRotation, KernelEncoder, KernelRow, KVFormat, bucketize, cached_on, ceil_div,
                   check_float_input, fp16_bytes, fp16_from_bytes)
from .bitpack import byte_table, pack_bits, packed_bytes, unpack_bits
from .codebook import lloyd_max
from .rotation import gaussian_matrix, rotation_matrix

DEFAULT_SEED = 0x5EED
MAX_GROUP = 128


class TurboFormat(KVFormat):
    """TurboQuant; ``spec.code_bits`` is the total bits per value of the payload."""

    seed: int = DEFAULT_SEED

    @property
    def qjl(self) -> bool:
        """True for the product (MSE + QJL residual sketch) variant."""
        return self.spec.family == "turbo_prod"

    @property
    def mse_bits(self) -> int:
        return self.spec.code_bits - 1 if self.qjl else self.spec.code_bits

    # ----- layout ---------------------------------------------------------------
    def _layout(self, head_dim: int) -> tuple[int, int]:
        n_groups = ceil_div(head_dim, MAX_GROUP)
        return n_groups, head_dim // n_groups

    def kernel_row(self, head_dim: int) -> KernelRow | None:
        """The MSE variant: per group [f16 scale][codes], value = scale * centroid[code] (rotated
        domain); the QJL variant's residual sketch has no table form."""
        if self.qjl:
            return None
        _, group = self.blocks(head_dim)
        centroids = self.codebook(group, torch.device("cpu"))[0]
        return KernelRow("packed", self.mse_bits, group, tuple(centroids.tolist()))

    def kernel_encoder(self, head_dim: int) -> KernelEncoder | None:
        """The MSE variant, per group: its rotation matrix and codebook; the limit is on the
        group norms (the fp16 scale). The QJL variant's sketch: none."""
        if self.qjl:
            return None
        _, group = self.blocks(head_dim)
        centroids, boundaries = self.codebook(group, torch.device("cpu"))
        return KernelEncoder("turbo", group, self.mse_bits, rot=group, rot_matrix=rotation_matrix(group, self.seed),
                             boundaries=boundaries, centroids=centroids, limit=FP16_MAX)

    def _check_head_dim(self, head_dim: int) -> None:
        n_groups = ceil_div(head_dim, MAX_GROUP)
        group = head_dim // n_groups
        if head_dim % n_groups or group % 8 or group < 16:
            raise ValueError(f"{self.name}: head_dim {head_dim} must split into equal groups of at most "
                             f"{MAX_GROUP} values, each a multiple of 8 and at least 16")

    def _max_abs(self) -> float | None:
        return None  # the norm is checked instead, see _encode

    def header_fields(self) -> tuple[tuple[str, int, int], ...]:
        return (("scale", 0, 2), ("residual_norm", 2, 2)) if self.qjl else (("scale", 0, 2),)

    def overflow_flag(self, x: torch.Tensor) -> torch.Tensor:
        """Per token row: group norms past fp16's range (or NaN/inf) cannot be stored."""
        n_groups, g = self.blocks(x.shape[-1])
        norm = x.float().reshape(x.shape[0], -1, g).norm(dim=-1)                 # (T, groups)
        return ~torch.isfinite(norm).all(dim=-1) | (norm.amax(dim=-1) > FP16_MAX)

    # ----- attention hooks: keys and values stay rotated ---------------------------------
    @property
    def transformed(self) -> bool:
        return True

    def to_code_domain(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(x)

    def from_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        return self.unrotate(y)

    def code_rotation(self, head_dim: int, device) -> CodeRotation:
        _, g = self.blocks(head_dim)
        return CodeRotation(g, rotation_matrix(g, self.seed, device))

    def decode_code_domain(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.decode_rotated(packed, head_dim)

    def decode_code_domain_scaled(self, packed: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n_groups, g = self.blocks(head_dim)
        if n_groups != 1 or self.qjl:                                   # one scale per row only
            return self.decode_rotated(packed, head_dim), None
        centroids, _ = self.codebook(g, packed.device)
        scale = fp16_from_bytes(packed[..., :2])                         # (...,)
        values = self._lookup(packed[..., 2:], centroids, g)             # (..., g) unit-norm codebook values
        return values, scale

    # ----- pieces the attention path reuses -----------------------------------------
    def codebook(self, group: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(centroids, boundaries) as float32 tensors on ``device`` (cached per device)."""
        bits = self.mse_bits                                              # lloyd_max only on a cache miss
        return (cached_on(device, ("centroids", group, bits), lambda: torch.tensor(lloyd_max(group, bits).centroids).float()),
                cached_on(device, ("boundaries", group, bits),
                          lambda: torch.tensor(lloyd_max(group, bits).boundaries).float()))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate (..., head_dim) group by group into the coded domain."""
        n_groups, g = self.blocks(x.shape[-1])
        r = rotation_matrix(g, self.seed, x.device)
        return (x.reshape(*x.shape[:-1], n_groups, g) @ r.T).reshape(x.shape)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of ``rotate``."""
        n_groups, g = self.blocks(y.shape[-1])
        r = rotation_matrix(g, self.seed, y.device)
        return (y.reshape(*y.shape[:-1], n_groups, g) @ r).reshape(y.shape)

    # ----- encode ---------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Checked encode; also refuses group norms past the fp16 scale's range."""
        x = check_float_input(x, self.name)
        self.check_head_dim(x.shape[-1])
        n_groups, g = self.blocks(x.shape[-1])
        big = float(x.float().reshape(-1, n_groups, g).norm(dim=-1).max())
        if big > FP16_MAX:
            raise ValueError(f"{self.name}: a group norm of {big:.6g} exceeds the fp16 "
                             f"range of the stored scale ({FP16_MAX:g})")
        return self._encode(x)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        head_dim = x.shape[-1]
        n_groups, g = self.blocks(head_dim)
        xg = x.float().reshape(-1, n_groups, g)                          # (N, G, g)
        norm = xg.norm(dim=-1)                                           # (N, G)
        unit = xg / norm.clamp_min(1e-30).unsqueeze(-1)
        y = unit @ rotation_matrix(g, self.seed, x.device).T             # rotated unit vectors
        centroids, boundaries = self.codebook(g, x.device)
        codes = bucketize(y, boundaries)
        c = centroids[codes]
        if self.qjl:
            resid = y - c
            signs = (resid @ gaussian_matrix(g, self.seed, x.device).T) >= 0
            parts = [fp16_bytes(norm), fp16_bytes(resid.norm(dim=-1)),
                     pack_bits(codes, self.mse_bits), pack_bits(signs, 1)]
        else:
            parts = [fp16_bytes(norm / c.norm(dim=-1)), pack_bits(codes, self.mse_bits)]
        return torch.cat(parts, dim=-1).reshape(*x.shape[:-1], -1)

    # ----- decode ---------------------------------------------------------------
    def decode_rotated(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Decode to the rotated domain, float32 (..., head_dim): no inverse rotation."""
        n_groups, g = self.blocks(head_dim)
        row = packed.reshape(-1, n_groups, packed.shape[-1] // n_groups)    # (N, G, group bytes)
        centroids, _ = self.codebook(g, packed.device)
        scale = fp16_from_bytes(row[..., :2])
        off = 4 if self.qjl else 2
        code_len = packed_bytes(g, self.mse_bits)
        y = self._lookup(row[..., off:off + code_len], centroids, g)
        if self.qjl:
            signs = unpack_bits(row[..., off + code_len:], 1, g).float() * 2 - 1
            rnorm = fp16_from_bytes(row[..., 2:4])
            gain = rnorm * (math.sqrt(math.pi / 2) / g)
            y = y + gain.unsqueeze(-1) * (signs @ gaussian_matrix(g, self.seed, packed.device))
        return (y * scale.unsqueeze(-1)).reshape(*packed.shape[:-1], head_dim)

    def _lookup(self, code_bytes: torch.Tensor, centroids: torch.Tensor, g: int) -> torch.Tensor:
        """Centroid values (N, G, g) of packed codes (N, G, g*bits/8)."""
        bits = self.mse_bits
        if 8 % bits:
            return centroids[unpack_bits(code_bytes, bits, g)]
        table = cached_on(code_bytes.device, ("byte_table", g, bits), lambda: byte_table(centroids, bits))
        vals = torch.nn.functional.embedding(code_bytes.int(), table)        # (N, G, bytes, 8/bits)
        return vals.reshape(*code_bytes.shape[:-1], g)

    def _decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.unrotate(self.decode_rotated(packed, head_dim))
