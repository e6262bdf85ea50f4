"""The KV format record and the input checks every codec shares.

A format is data (one row of the preset table in ``kvslim.formats``) plus two
functions, ``encode`` and ``decode``. Sizes are derived from the row, never
stored twice, so the cache allocator, the planner and ``--help`` agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FP16_MAX = 65504.0


@dataclass(frozen=True)
class FormatSpec:
    """One row of the preset table.

    Attributes:
        name: the name users type (``-ctk q8_0``).
        family: ``float``, ``ggml``, ``turbo`` (MSE TurboQuant) or ``turbo_prod``.
        block_size: values per block; for turbo formats the largest group, a
            smaller head dimension forms a single smaller group.
        code_bits: payload bits per value inside a block (a fraction only where a format
            spreads a fixed bit budget unevenly over a row: klt).
        block_header_bytes: bytes of scales/norms per block.
        summary: one line for ``--help`` and the README.
        experimental: shown as such in listings.
        rotated: ggml types only: Hadamard-rotated before quantizing, as llama.cpp
            does by default since PR #21038 (the bytes are plain ggml blocks of the
            rotated vector); the ``-norot`` rows store the vector as it is.
    """

    name: str
    family: str
    block_size: int
    code_bits: int | float
    block_header_bytes: int
    summary: str
    experimental: bool = False
    rotated: bool = False

    def bytes_for_block(self, values: int) -> int:
        """Bytes of a block of ``values`` values (header plus packed codes)."""
        return self.block_header_bytes + int(values * self.code_bits) // 8

    @property
    def block_bytes(self) -> int:
        """Bytes of one full block."""
        return self.bytes_for_block(self.block_size)

    @property
    def nominal_bits_per_value(self) -> float:
        """Bits per value for a full block (head_dim a multiple of block_size)."""
        return 8.0 * self.block_bytes / self.block_size


class KVFormat:
    """A named KV format: sizes from its spec, coding from its subclass.

    Subclasses implement ``_layout``, ``_encode`` and ``_decode``; this class
    does the argument checking so every codec refuses bad input the same way.
    """

    def __init__(self, spec: FormatSpec):
        self.spec = spec

    # ----- sizes (derived) -------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    def blocks(self, head_dim: int) -> tuple[int, int]:
        """(blocks per row, values per block) for a row of ``head_dim`` values."""
        self.check_head_dim(head_dim)
        return self._layout(head_dim)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes that one vector of ``head_dim`` values occupies when encoded."""
        n_blocks, block = self.blocks(head_dim)
        return n_blocks * self.spec.bytes_for_block(block)

    def bits_per_value(self, head_dim: int) -> float:
        """Stored bits per value, headers included."""
        return 8.0 * self.row_bytes(head_dim) / head_dim

    # A calibrated format (klt) needs per-layer statistics: the table's instance has sizes
    # only, and the cache binds it to its layer's calibration before coding rows.
    calibrated = False

    def bind(self, calibration) -> "KVFormat":
        return self

    def kernel_row(self, head_dim: int) -> "KernelRow | None":
        """How a kernel reads this format's rows without its Python codec (the C and Triton
        attention kernels read this, not the format's class), or None: no table form."""
        return None

    def kernel_encoder(self, head_dim: int) -> "KernelEncoder | None":
        """How a kernel writes this format's rows without its Python codec (the C decode step's
        and the Triton append kernel's encoders read this, not the format's class), or None:
        no kernel encoder (the torch ``encode`` is the only one)."""
        return None

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError if this format cannot store rows of ``head_dim``."""
        if not isinstance(head_dim, (int, np.integer)) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ValueError(f"{self.name}: head_dim must be a positive integer, got {head_dim!r}")
        self._check_head_dim(int(head_dim))

    # ----- coding ------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode float vectors.

        Args:
            x: float tensor ``(..., head_dim)`` on any device.
        Returns:
            ``torch.uint8`` tensor ``(..., row_bytes(head_dim))`` on the same device.
        """
        x = check_float_input(x, self.name)
        self.check_head_dim(x.shape[-1])
        limit = self._max_abs()
        if limit is not None:                                           # on the values the blocks store
            big = self._stored(x).abs().amax().item()
            if big > limit:
                raise ValueError(f"{self.name}: a value of magnitude {big:.6g} exceeds what the "
                                 f"format's fp16 fields can represent (about {limit:.6g})")
        return self._encode(x)

    def decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Decode packed rows back to float32 ``(..., head_dim)``."""
        self.check_head_dim(head_dim)
        packed = check_packed_input(packed, self.row_bytes(head_dim), self.name, head_dim)
        return self._decode(packed, head_dim)

    # ----- the cache's hot path: no checks, no host sync ---------------------------
    def encode_unchecked(self, x: torch.Tensor) -> torch.Tensor:
        """``encode`` without validation (no ``.item()``)."""
        return self._encode(x)

    def encode_flagged(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's hot path: unchecked codes of ``x`` (T, ..., head_dim) and its per-row
        :meth:`overflow_flag`, sharing the work both need (a rotated format rotates once)."""
        if not self.codes_code_domain:
            return self._encode(x), self.overflow_flag(x)
        y = self.to_code_domain(x.float())
        return self._encode_code_domain(y), self._row_flags(y)

    def overflow_flag(self, x: torch.Tensor) -> torch.Tensor:
        """Per token row of ``x`` (T, ..., head_dim): a (T,) bool tensor on x's device, True
        where the row holds NaN/inf or values past what the format stores. Computed on the
        device; nobody waits for it (the engine reads the flags once per step)."""
        return self._row_flags(self._stored(x))

    def _row_flags(self, y: torch.Tensor) -> torch.Tensor:
        flat = y.reshape(y.shape[0], -1)
        bad = ~torch.isfinite(flat).all(dim=-1)
        limit = self._max_abs()
        if limit is not None:
            bad = bad | (flat.abs().amax(dim=-1) > limit)
        return bad

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        """The values the blocks hold: ``x`` in the code domain for block codecs (a rotated
        q4_0 quantizes the rotated row, so its range limit applies there)."""
        return self.to_code_domain(x.float()) if self.codes_code_domain else x

    # ----- attention hooks ------------------------------------------------------------
    # Attention works in a "code domain" that may differ from the model's by an
    # orthogonal transform (a rotation): scores <R q, R k> = <q, k>, and a weighted sum of
    # values rotated by R is unrotated once at the end. Kernels and the torch backend
    # use only these hooks, never the format's family.
    @property
    def transformed(self) -> bool:
        """True when the code domain differs from the model's (to_code_domain is not identity)."""
        return False

    def to_code_domain(self, x: torch.Tensor) -> torch.Tensor:
        """Model domain -> code domain, (..., head_dim): applied to queries (K format) and to
        unpacked values joining the sum (V format)."""
        return x

    def from_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        """Code domain -> model domain: applied once to the attention output (V format)."""
        return y

    def code_rotation(self, head_dim: int, device) -> "CodeRotation | None":
        """The code domain as data, where it is a rotation of each run of values (so a kernel can
        apply it: ``gpu.rotation``); None where it is the model domain or not such a rotation."""
        return None

    def decode_code_domain(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Unchecked decode of packed rows into the code domain, float32 (..., head_dim)."""
        return self._decode(packed, head_dim)

    def decode_code_domain_scaled(self, packed: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values, row_scale): rows equal ``values * row_scale[..., None]``. A format with one
        scale per row returns it apart, so attention multiplies T scores instead of T x D
        values (keys: scale the scores; values: scale the probabilities). Default: no split."""
        return self.decode_code_domain(packed, head_dim), None

    def row_layout(self, head_dim: int) -> "RowLayout":
        """Byte layout of one packed row (fields per block), for codecs and kernels."""
        return RowLayout.of(self, head_dim)

    # ----- what subclasses provide ---------------------------------------------
    def _layout(self, head_dim: int) -> tuple[int, int]:
        return head_dim // self.spec.block_size, self.spec.block_size

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.spec.block_size:
            raise ValueError(f"{self.name}: head_dim {head_dim} is not a multiple of the "
                             f"block size {self.spec.block_size}")

    def _max_abs(self) -> float | None:
        """Largest input magnitude the format stores without overflow (None: no limit)."""
        return None

    def header_fields(self) -> tuple[tuple[str, int, int], ...]:
        """(name, offset, width) of each header field of a block; the codes follow."""
        if self.spec.block_header_bytes == 0:
            return ()
        if self.spec.block_header_bytes == 2:
            return (("scale", 0, 2),)
        return (("scale", 0, 2), ("min", 2, 2))

    # Block codecs (ggml types, nl grids) set this and implement _encode_code_domain: they
    # quantize the row as it stands in the code domain (after the rotation, if any).
    codes_code_domain = False

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._encode_code_domain(self.to_code_domain(x.float()))

    def _encode_code_domain(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"KVFormat({self.name!r}, {self.spec.nominal_bits_per_value:g} bits/value)"


@dataclass(frozen=True)
class RowField:
    """One field of a block: ``name`` at byte ``offset`` within the block, ``width`` bytes."""

    name: str
    offset: int
    width: int


@dataclass(frozen=True)
class RowLayout:
    """A packed row: ``n_blocks`` blocks of ``block_values`` values, ``block_bytes`` each,
    laid out back to back; each block is ``fields`` (header fields first, then codes).
    (It overlaps ``KernelRow``, which the kernels read: the same block sizes, plus the codes'
    meaning. This one names every header field, q4_1's min and the QJL norm included.)"""

    n_blocks: int
    block_values: int
    block_bytes: int
    fields: tuple[RowField, ...]

    @property
    def row_bytes(self) -> int:
        return self.n_blocks * self.block_bytes

    @classmethod
    def of(cls, fmt: "KVFormat", head_dim: int) -> "RowLayout":
        n_blocks, block = fmt.blocks(head_dim)
        spec = fmt.spec
        fields = tuple(RowField(name, off, width) for name, off, width in fmt.header_fields())
        code_bytes = spec.bytes_for_block(block) - spec.block_header_bytes
        fields += (RowField("codes", spec.block_header_bytes, code_bytes),)
        return cls(n_blocks, block, spec.bytes_for_block(block), fields)


@dataclass(frozen=True, eq=False)
class CodeRotation:
    """A format's code domain: each run of ``size`` values rotated, by H / sqrt(size) (Sylvester's
    Hadamard matrix, its own inverse) where ``matrix`` is None, else by the orthogonal ``matrix``
    R (size, size), float32: into the code domain x -> x R^T, back y -> y R."""

    size: int
    matrix: torch.Tensor | None = None


@dataclass(frozen=True)
class KernelRow:
    """A row as the kernels decode it. ``kind`` "f32"/"f16"/"bf16": float values. Otherwise
    blocks of ``block_values`` values, each [f16 scale][rungs][codes] with value = scale *
    ladder[rung] * table[code]: "int8" (the code is the value), "nibble" (32-value blocks, byte
    j = code j | code j+16 << 4), "packed" (``bits``-bit codes, 8 per ``bits`` bytes,
    little-endian). Rungs (``sub_bits`` each, one per ``sub_values`` values) only where
    ``sub_values``. ggml's q5_x blocks are "nibble" with ``bits`` 5: their codes start with a
    little-endian u32 whose bit j is bit 4 of code j, then the nibbles (a table of 32 values).
    ``offset_at``: the byte of an f16 in the header added to every value (q4_1/q5_1's block
    minimum: value = scale * table[code] + offset); 0 for none."""

    kind: str
    bits: int
    block_values: int = 1
    table: tuple[float, ...] = ()
    header_bytes: int = 2
    sub_values: int = 0
    sub_bits: int = 0
    ladder: tuple[float, ...] = ()
    offset_at: int = 0

    @property
    def block_bytes(self) -> int:
        if self.kind in ("f32", "f16", "bf16"):
            return self.bits // 8
        return self.header_bytes + self.block_values * self.bits // 8


@dataclass(frozen=True, eq=False)
class KernelEncoder:
    """A row as the kernels encode it: first into the code domain (blocks of ``rot`` values
    through H / sqrt(rot) as a butterfly when ``hadamard``, else y = ``rot_matrix`` @ x), then by
    ``kind``: "float" (the row cast to ``float_type`` f32/f16/bf16), "q8_0", "q4_0", "iq4_nl"
    (ggml's reference quantizers, blocks of 32; iq4_nl's grid in ``centroids``), "turbo" (per
    group of ``block`` values: the norm, the unit vector rotated, each value's bucket among
    ``boundaries``, scale norm / |centroids[codes]|), "grid" (per ``block``: a scale searched over
    ``tries`` x amax / max|grid|, refit by least squares, codes by ``boundaries`` = the grid's
    midpoints) or "grid_sub" (the same with a ``ladder`` rung per ``sub_values``). A row overflows
    where it holds NaN/inf or, when ``limit`` > 0, a code-domain value (turbo: a group norm)
    past ``limit``. Tables are float32 CPU tensors, the ones the torch encoder searches."""

    kind: str
    block: int = 1
    bits: int = 0
    float_type: str = ""
    rot: int = 0
    hadamard: bool = False
    rot_matrix: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    centroids: torch.Tensor | None = None
    tries: torch.Tensor | None = None
    ladder: torch.Tensor | None = None
    sub_values: int = 0
    limit: float = 0.0


def check_float_input(x, name: str) -> torch.Tensor:
    """Validate an encode input; numpy arrays are accepted and converted."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: expected a tensor of shape (..., head_dim), got a scalar")
    if x.numel() == 0:
        raise ValueError(f"{name}: cannot encode an empty tensor of shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name}: input holds {n_bad} NaN or infinite value(s); refusing to encode")
    return x


def check_packed_input(packed, row_bytes: int, name: str, head_dim: int) -> torch.Tensor:
    """Validate a decode input: uint8, last dimension equal to the row size."""
    if isinstance(packed, np.ndarray):
        packed = torch.from_numpy(packed)
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"{name}: expected packed bytes as a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed data must be torch.uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != row_bytes:
        got = "a scalar" if packed.dim() == 0 else f"{packed.shape[-1]} bytes per row"
        raise ValueError(f"{name}: head_dim {head_dim} needs {row_bytes} bytes per row, got {got}")
    return packed


_DEVICE_CACHE: dict[tuple, torch.Tensor] = {}


def cached_on(device, key: tuple, build):
    """``build()`` moved to ``device``, built once per (key, device): rotations,
    codebooks and lookup tables are constants that every call would otherwise rebuild."""
    full = (*key, str(device))
    if full not in _DEVICE_CACHE:
        _DEVICE_CACHE[full] = build().to(device)
    return _DEVICE_CACHE[full]


def bucketize(v: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """torch.bucketize(v, boundaries) (ascending): on float32 CPU tensors outside autograd the C
    count (``kv_encode.bucketize``: the same codes, NaN included; 25x torch's binary search on a
    prompt chunk's turbo values), elsewhere torch's."""
    from ..native import kv_encode                # formats import before native: import at use
    if kv_encode.serves_bucketize(v, boundaries):
        return kv_encode.bucketize(v, boundaries)
    return torch.bucketize(v.contiguous(), boundaries)


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 (...,) -> (..., 2) uint8, little-endian IEEE half (round to nearest even).
    Flattened before the byte view: inductor may lay an (N, 1) result out with strides (1, N),
    which counts as contiguous, and torch 2.11 (the GPU image's) then refuses the view."""
    return v.to(torch.float16).reshape(-1).view(torch.uint8).reshape(*v.shape, 2)


def fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (...,) float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["FormatSpec", "KVFormat", "KernelRow", "KernelEncoder", "RowLayout", "RowField", "FP16_MAX", "fp16_bytes",
           "fp16_from_bytes", "check_float_input", "check_packed_input", "is_power_of_two", "ceil_div", "cached_on"]
