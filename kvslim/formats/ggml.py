"""ggml block formats (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl), byte-identical to
llama.cpp's C reference quantizers (``quantize_row_*_ref`` in ggml-quants.c).

Each block holds 32 values. Encoding works on all blocks at once; the only
loops run over the 32 positions of a block (iq4_nl's scale search) so that
float32 sums accumulate in the same order as the C code and round the same.
"""
from __future__ import annotations

import torch

from .base import FP16_MAX, CodeRotation, KernelEncoder, KernelRow, KVFormat, cached_on, fp16_bytes, fp16_from_bytes
from .rotation import hadamard_blocks, llama_rot_size

QK = 32  # values per ggml block

# iq4_nl's fixed non-linear grid (llama.cpp's kvalues_iq4nl).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4NL_TRIES = 7          # scale candidates on each side of the starting one
GROUP_MAX_EPS = 1e-15    # blocks below this magnitude are stored as zeros
ENCODE_CHUNK = 1 << 14   # blocks encoded per step


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round to nearest, ties away from zero, exact for every float."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.copysign(fl + (a - fl >= 0.5).to(x.dtype), x)


def c_int_cast(x: torch.Tensor) -> torch.Tensor:
    """C's float -> int conversion as x86 performs it: truncate toward zero, and a
    non-finite value (from 1/d overflowing on subnormal blocks) becomes 0."""
    return torch.where(torch.isfinite(x), torch.trunc(x), torch.zeros_like(x))


def signed_absmax(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(|max|, signed max) per block, the first one on ties as the C loop keeps it."""
    idx = blocks.abs().argmax(dim=-1, keepdim=True)  # argmax returns the first maximum
    mx = blocks.gather(-1, idx).squeeze(-1)
    return mx.abs(), mx


def safe_inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1/d : 0`` in float32."""
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, 32) codes 0..15 -> (N, 16) bytes: value j in the low nibble, j+16 in the high."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) bytes -> (N, 32) codes, inverse of ``pack_nibbles``."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """(N, 32) 5-bit codes -> (N, 4) bytes: bit 4 of value j at bit j of a little-endian u32."""
    bits = ((q.to(torch.int64) >> 4) & 1).view(-1, 4, 8)
    return (bits << torch.arange(8, device=q.device)).sum(-1).to(torch.uint8)


def unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(N, 4) bytes -> (N, 32) values 0/1."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


# ---------------------------------------------------------------------------
# Per-type block codecs: (N, 32) float32 <-> (N, block_bytes) uint8
# ---------------------------------------------------------------------------
def encode_q8_0(x: torch.Tensor) -> torch.Tensor:
    amax, _ = signed_absmax(x)
    d = amax / 127.0
    q = c_int_cast(round_half_away(x * safe_inverse(d).unsqueeze(-1))).to(torch.int8)
    return torch.cat([fp16_bytes(d), q.view(torch.uint8)], dim=-1)


def decode_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = fp16_from_bytes(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d.unsqueeze(-1)


def encode_q4_0(x: torch.Tensor) -> torch.Tensor:
    _, mx = signed_absmax(x)
    d = mx / -8.0
    xq = x * safe_inverse(d).unsqueeze(-1) + 8.5
    q = c_int_cast(xq).clamp(max=15)  # MIN(15, (int8_t)(x * id + 8.5f))
    return torch.cat([fp16_bytes(d), pack_nibbles(q)], dim=-1)


def decode_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = fp16_from_bytes(b[:, :2])
    return (unpack_nibbles(b[:, 2:]).float() - 8.0) * d.unsqueeze(-1)


def _min_max_scale(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, min, codes) for the asymmetric q4_1/q5_1 quantizers."""
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    d = (hi - lo) / float(levels)
    xq = (x - lo.unsqueeze(-1)) * safe_inverse(d).unsqueeze(-1) + 0.5
    return d, lo, c_int_cast(xq).clamp(max=levels)


def encode_q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_max_scale(x, 15)
    return torch.cat([fp16_bytes(d), fp16_bytes(lo), pack_nibbles(q)], dim=-1)


def decode_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = fp16_from_bytes(b[:, :2]), fp16_from_bytes(b[:, 2:4])
    return unpack_nibbles(b[:, 4:]).float() * d.unsqueeze(-1) + m.unsqueeze(-1)


def encode_q5_0(x: torch.Tensor) -> torch.Tensor:
    _, mx = signed_absmax(x)
    d = mx / -16.0
    q = c_int_cast(x * safe_inverse(d).unsqueeze(-1) + 16.5).clamp(max=31)
    return torch.cat([fp16_bytes(d), pack_high_bits(q), pack_nibbles(q.to(torch.int64) & 0x0F)], dim=-1)


def decode_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = fp16_from_bytes(b[:, :2])
    q = unpack_nibbles(b[:, 6:]) | (unpack_high_bits(b[:, 2:6]) << 4)
    return (q.float() - 16.0) * d.unsqueeze(-1)


def encode_q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _min_max_scale(x, 31)
    return torch.cat([fp16_bytes(d), fp16_bytes(lo), pack_high_bits(q),
                      pack_nibbles(q.to(torch.int64) & 0x0F)], dim=-1)


def decode_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = fp16_from_bytes(b[:, :2]), fp16_from_bytes(b[:, 2:4])
    q = unpack_nibbles(b[:, 8:]) | (unpack_high_bits(b[:, 4:8]) << 4)
    return q.float() * d.unsqueeze(-1) + m.unsqueeze(-1)


# ----- iq4_nl -----------------------------------------------------------------
def _iq4nl_grid(device) -> torch.Tensor:
    return cached_on(device, ("iq4_nl grid",), lambda: torch.tensor(IQ4NL_VALUES, dtype=torch.float32))


def iq4nl_nearest(al: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """llama.cpp's ``best_index_int8``: nearest grid index, the upper one on exact ties."""
    mu = torch.searchsorted(grid, al.contiguous(), right=True).clamp(1, len(grid) - 1)
    lower = (al - grid[mu - 1]) < (grid[mu] - al)
    idx = torch.where(lower, mu - 1, mu)
    idx = torch.where(al <= grid[0], torch.zeros_like(idx), idx)
    return torch.where(al >= grid[-1], torch.full_like(idx, len(grid) - 1), idx)


def _weighted_fit(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w*q*x) and sum(w*q*q) over the block, accumulated left to right in float32
    as the C loop does (a different order would round differently in rare blocks).

    x, w: (N, 32); q: (N, K, 32) for K candidate scales. Returns two (N, K) tensors.
    """
    sumqx = torch.zeros(q.shape[:2], dtype=torch.float32, device=x.device)
    sumq2 = torch.zeros_like(sumqx)
    qt = q.permute(2, 0, 1).contiguous()                    # (32, N, K): contiguous per position
    xt, wt = x.T.unsqueeze(-1).contiguous(), w.T.unsqueeze(-1).contiguous()
    for j in range(qt.shape[0]):
        wq = wt[j] * qt[j]
        sumqx = sumqx + wq * xt[j]
        sumq2 = sumq2 + wq * qt[j]
    return sumqx, sumq2


def _iq4nl_scale(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """The reference's scale search (ntry = 7), all 16 candidates evaluated at once.

    Candidate 0 starts from d = max / 127; candidates 1..15 use 1/d = (itry - 127) / max.
    Each is refit by weighted least squares (weights x^2) and kept if strictly better.
    """
    amax, mx = signed_absmax(x)
    live = amax >= GROUP_MAX_EPS
    mx = torch.where(live, mx, torch.ones_like(mx))
    tries = torch.arange(-IQ4NL_TRIES, IQ4NL_TRIES + 1, device=x.device, dtype=torch.float32)
    inv = torch.cat([(1.0 / (mx / -grid[0])).unsqueeze(-1),
                     (tries + IQ4NL_VALUES[0]).unsqueeze(0) / mx.unsqueeze(-1)], dim=-1)   # (N, 16)
    q = grid[iq4nl_nearest(x.unsqueeze(1) * inv.unsqueeze(-1), grid)]                      # (N, 16, 32)
    sumqx, sumq2 = _weighted_fit(x, x * x, q)
    d = sumqx[:, 0] / sumq2[:, 0]
    best = d * sumqx[:, 0]
    for k in range(1, inv.shape[1]):
        sx, s2 = sumqx[:, k], sumq2[:, k]
        better = (s2 > 0) & (sx * sx > best * s2)
        d_try = sx / torch.where(s2 > 0, s2, torch.ones_like(s2))
        d = torch.where(better, d_try, d)
        best = torch.where(better, d_try * sx, best)
    return torch.where(live, d, torch.zeros_like(d))


def encode_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    grid = _iq4nl_grid(x.device)
    d = _iq4nl_scale(x, grid)
    # Final codes use the float32 scale, not its fp16 rounding, like the reference.
    codes = iq4nl_nearest(x * safe_inverse(d).unsqueeze(-1), grid)
    return torch.cat([fp16_bytes(d), pack_nibbles(codes)], dim=-1)


def decode_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = fp16_from_bytes(b[:, :2])
    return _iq4nl_grid(b.device)[unpack_nibbles(b[:, 2:]).long()] * d.unsqueeze(-1)


CODECS = {
    "q8_0": (encode_q8_0, decode_q8_0, 127.0),
    "q4_0": (encode_q4_0, decode_q4_0, 8.0),
    "q4_1": (encode_q4_1, decode_q4_1, 1.0),  # the block minimum itself is an fp16 field
    "q5_0": (encode_q5_0, decode_q5_0, 16.0),
    "q5_1": (encode_q5_1, decode_q5_1, 1.0),
    "iq4_nl": (encode_iq4_nl, decode_iq4_nl, 127.0),
}


NOROT = "-norot"   # name suffix of the unrotated rows


class GgmlFormat(KVFormat):
    """A ggml block type; bytes are llama.cpp's blocks in order along the row.

    A rotated row (the default names, as in llama.cpp since PR #21038) holds the
    blocks of the Hadamard-rotated vector; its code domain is the rotated one, so
    attention rotates the query (K) or the output (V) once instead of every row.
    ``role`` ("k" or "v") picks llama.cpp's block size of the rotation.
    """

    def __init__(self, spec, role: str = "k"):
        super().__init__(spec)
        if role not in ("k", "v"):
            raise ValueError(f"{spec.name}: role must be 'k' or 'v', got {role!r}")
        self.role = role

    @property
    def ggml_name(self) -> str:
        """The ggml type the blocks are in (``q4_0`` for both ``q4_0`` and ``q4_0-norot``)."""
        return self.name.removesuffix(NOROT)

    def rot_size(self, head_dim: int) -> int:
        """Hadamard block size used for rows of ``head_dim`` (0: not rotated)."""
        return llama_rot_size(head_dim, self.role) if self.spec.rotated else 0

    def _max_abs(self) -> float | None:
        # The fp16 scale is roughly max/levels: past this it would overflow to inf.
        return FP16_MAX * CODECS[self.ggml_name][2] * 0.999

    def kernel_row(self, head_dim: int) -> KernelRow:
        """The blocks as the kernels read them (rotated or not: the same blocks): q8_0 int8
        codes; the others nibbles under one scale, q4_1/q5_1 with the block minimum added and
        q5_x with a 5th bit per code ([d][(m)][codes: (qh)][nibbles])."""
        if self.ggml_name == "q8_0":
            return KernelRow("int8", 8, 32)
        table = {"q4_0": range(-8, 8), "iq4_nl": IQ4NL_VALUES, "q4_1": range(16), "q5_0": range(-16, 16),
                 "q5_1": range(32)}[self.ggml_name]
        offset = 2 if self.ggml_name in ("q4_1", "q5_1") else 0
        return KernelRow("nibble", self.spec.code_bits, 32, tuple(float(v) for v in table), header_bytes=2 + offset,
                         offset_at=offset)

    def kernel_encoder(self, head_dim: int) -> KernelEncoder | None:
        """Every ggml type, after the Hadamard butterfly (rotated rows): its reference quantizer."""
        grid = _iq4nl_grid("cpu") if self.ggml_name == "iq4_nl" else None
        rot = self.rot_size(head_dim)
        return KernelEncoder(self.ggml_name, QK, self.spec.code_bits, rot=rot, hadamard=rot > 0, centroids=grid,
                             limit=self._max_abs())

    # ----- attention hooks: the rotation, if any ---------------------------------------
    @property
    def transformed(self) -> bool:
        return self.spec.rotated

    def to_code_domain(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard_blocks(x, self.rot_size(x.shape[-1]))

    def from_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        return hadamard_blocks(y, self.rot_size(y.shape[-1]))      # H / sqrt(n) is its own inverse

    def code_rotation(self, head_dim: int, device) -> CodeRotation | None:
        size = self.rot_size(head_dim) if self.transformed else 0
        return CodeRotation(size) if size else None

    def decode_code_domain(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        blocks = packed.reshape(-1, self.spec.block_bytes)
        return CODECS[self.ggml_name][1](blocks).reshape(*packed.shape[:-1], head_dim)

    # ----- coding -----------------------------------------------------------------------
    codes_code_domain = True                  # blocks of the (rotated) row; the range check applies there

    def _encode_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        blocks = y.float().reshape(-1, QK)  # (N, 32)
        encode = CODECS[self.ggml_name][0]
        # Bounded chunks keep iq4_nl's (N, 16, 32) candidate tensors small.
        out = torch.cat([encode(part) for part in blocks.split(ENCODE_CHUNK)])
        return out.reshape(*y.shape[:-1], -1)

    def _decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.from_code_domain(self.decode_code_domain(packed, head_dim))
