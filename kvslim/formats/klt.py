"""klt3: V rows coded in a calibrated Karhunen-Loeve basis (transform coding).

Why this exists: a layer's value vectors are not white. Per (layer, kv head) of the
bundled model, their variance is spread over directions so unevenly that ideal
transform coding gains 10-13 dB over coding every coordinate alike, and a random
rotation (turbo, the rotated ggml types) throws that away: it makes every coordinate
look the same. Transform coding keeps it: rotate into the eigenbasis of the values'
covariance, give each direction an integer number of bits by reverse water-filling on
its variance (0 to 8; the total per row is fixed), and code each direction with a grid
fitted to its own row-normalised distribution. One fp16 scale per row absorbs what the
calibration did not predict: how large this row is.

The error that matters is not |e|^2 but what reaches the residual stream: the model
reads V only through the output projection, ``o_proj(e)``. So the calibration first
weights rows by the square root of that projection's Gram matrix (per KV head, over the
query heads that read it) and takes the eigenbasis there; the basis is then not
orthogonal and decoding uses its inverse (``synthesis``). Measured on the bundled model,
this halves the KLD of plain (unweighted) transform coding and makes the calibration
robust to the text it was made on (docs/eval-kld-formats.md, session 13).

Row layout (head_dim D, a multiple of 64): fp16 row scale, then the codes of the D
directions in order, each ``bits[j]`` bits wide, least significant bit first, packed
little-endian; ``D * 2.625`` bits of codes, 2.75 bits per value with the scale at D=128.

The basis, means, spreads, bit allocation and grids come from a calibration, one per
model (``kvslim calibrate``, stored beside the weights as ``kv-calibration.safetensors``).
A format in the table is unbound (sizes only); the cache binds it to its layer's
calibration. Only V: keys coded this way lost to nl3s as soon as the calibration text
and the scored text differed (docs/eval-kld-formats.md), because a query reads every
direction of a key while the model reads V only through its output projection.

The code domain (what attention sums in) is ``(x - mean) @ basis`` per head, and
``y @ synthesis + mean`` takes it back (affine, so exact on an attention output); heads lead
in the code-domain hooks (the attention path holds heads first) and sit at -2 in
``encode`` / ``decode`` (rows as the cache stores them, ``(..., H, D)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from .base import FP16_MAX, KVFormat, check_float_input, fp16_bytes, fp16_from_bytes

MAX_BITS = 8                    # widest direction; its grid has 256 levels
LEVELS = 1 << MAX_BITS
CALIBRATION_FILE = "kv-calibration.safetensors"


# ----- calibration ----------------------------------------------------------------------
@dataclass
class LayerCalibration:
    """One attention layer's V statistics, per kv head: ``basis`` (H, D, D) takes a row
    (mean removed) to its code directions, as columns, strongest first; ``synthesis``
    (H, D, D) takes code directions back (the transpose of an orthogonal basis, the inverse
    of an output-weighted one); ``mean`` (H, D) is in the model's domain, ``spread`` (H, D)
    the standard deviation of each direction; ``tables[name]`` = (bits (H, D), grid
    (H, D, LEVELS)) for each klt format, grid levels in row-normalised units."""

    basis: torch.Tensor
    mean: torch.Tensor
    spread: torch.Tensor
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    synthesis: torch.Tensor | None = None

    def __post_init__(self):
        if self.synthesis is None:
            self.synthesis = self.basis.transpose(-1, -2).contiguous()

    @property
    def n_heads(self) -> int:
        return self.basis.shape[0]

    @property
    def head_dim(self) -> int:
        return self.basis.shape[-1]


@dataclass
class KVCalibration:
    """A model's calibration: one ``LayerCalibration`` per attention layer, in layer order."""

    layers: list[LayerCalibration]
    source: str = ""

    def layer(self, index: int) -> LayerCalibration:
        if not 0 <= index < len(self.layers):
            raise ValueError(f"the KV calibration covers {len(self.layers)} attention layers; "
                             f"layer {index} has none (was it made for another model?)")
        return self.layers[index]

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file
        tensors = {}
        for i, lay in enumerate(self.layers):
            tensors.update({f"layer{i}.basis": lay.basis, f"layer{i}.synthesis": lay.synthesis,
                            f"layer{i}.mean": lay.mean, f"layer{i}.spread": lay.spread})
            for name, (bits, grid) in lay.tables.items():
                tensors[f"layer{i}.{name}.bits"] = bits.to(torch.int8)
                tensors[f"layer{i}.{name}.grid"] = grid
        save_file({k: v.cpu().clone() for k, v in tensors.items()}, str(path),
                  metadata={"kvslim": "kv-calibration-1", "layers": str(len(self.layers)), "source": self.source})

    @classmethod
    def load(cls, path: str | Path) -> "KVCalibration":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("kvslim") != "kv-calibration-1":
                    raise ValueError(f"{path}: not a kvslim KV calibration file")
                t = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, RuntimeError, SafetensorError) as exc:
            raise ValueError(f"{path}: cannot read the KV calibration ({exc})") from None
        layers = []
        for i in range(int(meta["layers"])):
            names = {k.split(".")[1] for k in t if k.startswith(f"layer{i}.") and k.endswith(".grid")}
            tables = {n: (t[f"layer{i}.{n}.bits"].long(), _full_grid(t[f"layer{i}.{n}.grid"].float())) for n in names}
            synthesis = t.get(f"layer{i}.synthesis")
            layers.append(LayerCalibration(t[f"layer{i}.basis"].float(), t[f"layer{i}.mean"].float(),
                                           t[f"layer{i}.spread"].float(), tables,
                                           None if synthesis is None else synthesis.float()))
        return cls(layers, meta.get("source", ""))


def _full_grid(grid: torch.Tensor) -> torch.Tensor:
    """A grid padded to LEVELS levels (a direction's 2**bits, or a file's from a narrower MAX_BITS):
    unused codes repeat the top level."""
    if grid.shape[-1] > LEVELS:
        raise ValueError(f"the KV calibration's grids have {grid.shape[-1]} levels; this kvslim reads up to {LEVELS}")
    return torch.cat([grid, grid[..., -1:].expand(*grid.shape[:-1], LEVELS - grid.shape[-1])], -1)


def allocate(variance: torch.Tensor, mean_bits: float) -> torch.Tensor:
    """Integer bits per direction (0..MAX_BITS) summing to exactly ``mean_bits * D``: reverse
    water-filling, b_j = round(log2(sd_j) - t), with t bisected, then single bits moved from
    or to the directions whose rounding was closest so the total is exact (rows are fixed size)."""
    target = round(mean_bits * variance.numel())
    want = 0.5 * torch.log2(variance.double().clamp_min(1e-30))
    lo, hi = -200.0, 200.0
    for _ in range(100):
        t = (lo + hi) / 2
        if (want - t).round().clamp(0, MAX_BITS).sum() > target:
            lo = t
        else:
            hi = t
    bits = (want - hi).round().clamp(0, MAX_BITS)
    frac = want - hi - bits                                   # > 0: this direction wanted more
    while int(bits.sum()) != target:
        more = int(bits.sum()) < target
        room = (bits < MAX_BITS) if more else (bits > 0)
        j = int(torch.where(room, frac if more else -frac, torch.tensor(-math.inf, dtype=frac.dtype)).argmax())
        bits[j] += 1 if more else -1
        frac[j] -= 1 if more else -1
    return bits.long()


def _gaussian_grid(bits: int) -> torch.Tensor:
    """Equal-probability N(0,1) levels: the start of each direction's Lloyd iteration."""
    p = (torch.arange(1 << bits, dtype=torch.float64) + 0.5) / (1 << bits)
    return torch.distributions.Normal(0.0, 1.0).icdf(p)


def fit_grid(samples: torch.Tensor, bits: int, rounds: int = 30) -> torch.Tensor:
    """Lloyd-Max levels (2**bits, ascending) fitted to one direction's 1-D samples."""
    if bits == 0:
        return torch.zeros(1, dtype=torch.float64)
    g = _gaussian_grid(bits) * samples.std().clamp_min(1e-12)
    ones = torch.ones_like(samples)
    for _ in range(rounds):
        cell = torch.bucketize(samples, (g[1:] + g[:-1]) / 2)
        total = torch.zeros_like(g).index_add_(0, cell, samples)
        count = torch.zeros_like(g).index_add_(0, cell, ones)
        g = torch.where(count > 0, total / count.clamp_min(1), g).sort().values
    return g


def _row_scale(z: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """RMS of a row's coded directions (z: (..., H, D) in spread units; live (H, D) bool)."""
    n = live.sum(-1).clamp_min(1)
    return ((z * z * live).sum(-1) / n).sqrt()


def calibrate_layer(values: torch.Tensor, format_bits: dict[str, float],
                    weight: torch.Tensor | None = None) -> LayerCalibration:
    """Statistics of one layer's value rows ``(N, H, D)`` and the tables of each klt format
    (name -> mean code bits per value).

    ``weight`` (H, D, D), symmetric positive definite: the error measure is ``|e @ weight|^2``
    rather than ``|e|^2``. Pass the square root of the Gram matrix of each head's slice of the
    output projection (``engine.calibrate.output_weights``): the model reads V only through
    it, so bits go where an error reaches the residual stream, not where V is merely large.
    """
    x = values.double()
    n_heads, dim = x.shape[1:]
    w = torch.eye(dim, dtype=torch.float64).expand(n_heads, dim, dim) if weight is None else weight.double()
    basis, synthesis = torch.empty(n_heads, dim, dim), torch.empty(n_heads, dim, dim)
    mean, spread = torch.empty(n_heads, dim), torch.empty(n_heads, dim)
    for h in range(n_heads):
        mu = x[:, h].mean(0)
        lam, u = torch.linalg.eigh(torch.cov(((x[:, h] - mu) @ w[h]).T))
        u = u.flip(-1)                                        # strongest direction first
        a = w[h] @ u                                          # row -> code directions
        y = (x[:, h] - mu) @ a
        basis[h], synthesis[h] = a.float(), torch.linalg.inv(a).float()
        mean[h], spread[h] = mu.float(), y.std(0).clamp_min(1e-12).float()
    layer = LayerCalibration(basis, mean, spread, synthesis=synthesis)
    y = torch.einsum("nhd,hde->nhe", x - mean.double(), basis.double()) / spread.double()
    for name, mean_bits in format_bits.items():
        bits = torch.stack([allocate(spread[h].double() ** 2, mean_bits) for h in range(n_heads)])
        u = y / _row_scale(y, bits > 0).clamp_min(1e-12)[..., None]
        grid = torch.zeros(n_heads, dim, LEVELS)
        for h in range(n_heads):
            for j in range(dim):
                grid[h, j] = _full_grid(fit_grid(u[:, h, j].contiguous(), int(bits[h, j])).float())
        layer.tables[name] = (bits, grid)
    return layer


def random_calibration(name: str, n_heads: int, head_dim: int, seed: int = 1) -> LayerCalibration:
    """A calibration of the klt format ``name`` fitted on random N(0, 1) rows: for measuring its
    speed (``kvslim quant``, benchmarks/attention.py). Random rows are white, so the error it
    gives there says nothing about a model's values."""
    from . import get
    sample = torch.randn(8192, n_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return calibrate_layer(sample, {name: float(get(name).spec.code_bits)})


# ----- the format -------------------------------------------------------------------------
class _Consts(NamedTuple):
    """What coding needs from a bound calibration, built once per device."""
    basis: torch.Tensor         # (H, D, D) row -> code directions
    synthesis: torch.Tensor     # (H, D, D) code directions -> row
    mean: torch.Tensor          # (H, D)
    spread: torch.Tensor        # (H, D)
    live: torch.Tensor          # (H, D) bool: directions with bits
    mids: torch.Tensor          # (H, D, LEVELS - 1) grid midpoints, +inf past each direction's levels
    src_dir: torch.Tensor       # (H, n_bits): bit p of the stream belongs to this direction ...
    src_bit: torch.Tensor       # (H, n_bits): ... and is this bit of its code
    lo_byte: torch.Tensor       # (H, D): the code byte where each code starts, and the next one
    hi_byte: torch.Tensor       # (H, D): (a code spans at most two), both clamped to the last byte
    shift: torch.Tensor         # (H, D): the bit of lo_byte where the code starts
    mask: torch.Tensor          # (H, D): 2**bits - 1
    levels: torch.Tensor        # (H, D, LEVELS) each direction's levels in code-domain units
    n_bits: int


class KLTFormat(KVFormat):
    """Transform-coded V rows; unbound (sizes only) until ``bind`` gives it a layer's calibration."""

    calibrated = True

    def __init__(self, spec, role: str = "v", calibration: LayerCalibration | None = None):
        super().__init__(spec)
        self.role, self.cal = role, calibration
        self._consts: dict[str, _Consts] = {}

    @property
    def mean_code_bits(self) -> float:
        return float(self.spec.code_bits)

    def bind(self, calibration: LayerCalibration | None) -> "KLTFormat":
        if calibration is None:
            raise ValueError(f"-ctv {self.name} codes V in a basis calibrated for the model, and this model has "
                             f"no KV calibration: run `kvslim calibrate -m MODEL -f TEXT` (it writes "
                             f"{CALIBRATION_FILE} into the model folder), or choose another V type")
        if self.name not in calibration.tables:
            raise ValueError(f"the model's KV calibration has no tables for {self.name} "
                             f"(it has: {', '.join(sorted(calibration.tables)) or 'none'}); run `kvslim calibrate` again")
        return KLTFormat(self.spec, self.role, calibration)

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % 64:
            raise ValueError(f"{self.name}: head_dim {head_dim} is not a multiple of 64")
        if self.cal is not None and head_dim != self.cal.head_dim:
            raise ValueError(f"{self.name}: the calibration is for head_dim {self.cal.head_dim}, rows have {head_dim}")

    def _layout(self, head_dim: int) -> tuple[int, int]:
        return 1, head_dim                                    # the whole row is one block

    # ----- constants of the bound calibration, per device ---------------------------------
    def _tables(self, device) -> _Consts:
        key = str(device)
        if key not in self._consts:
            if self.cal is None:
                raise ValueError(f"{self.name} is not bound to a calibration: the cache binds it "
                                 f"(KVCache(..., calibration=...)) before coding rows")
            bits, grid = self.cal.tables[self.name]
            n_heads, dim = bits.shape
            mids = (grid[..., 1:] + grid[..., :-1]) / 2
            top = (1 << bits)[..., None] - 1                  # codes >= 2**bits never occur
            mids = torch.where(torch.arange(LEVELS - 1)[None, None] < top, mids, torch.tensor(math.inf))
            # the bit stream: position p holds bit src_bit[h, p] of direction src_dir[h, p]
            n_bits = int(bits[0].sum())
            src_dir = torch.stack([torch.repeat_interleave(torch.arange(dim), bits[h]) for h in range(n_heads)])
            starts = torch.cumsum(bits, -1) - bits
            src_bit = torch.arange(n_bits)[None] - starts.gather(-1, src_dir)
            levels = grid * self.cal.spread[..., None]        # in code-domain units
            # clamping to the last byte is harmless: the clamped bits are ones the mask drops,
            # or belong to 0-bit directions that start at the end of the stream
            last = n_bits // 8 - 1
            lo_byte, hi_byte = (starts // 8).clamp_max(last), (starts // 8 + 1).clamp_max(last)
            consts = (self.cal.basis, self.cal.synthesis, self.cal.mean, self.cal.spread, bits > 0, mids,
                      src_dir, src_bit, lo_byte, hi_byte, (starts % 8).int(), ((1 << bits) - 1).int(), levels)
            self._consts[key] = _Consts(*(c.to(device) for c in consts), n_bits)
        return self._consts[key]

    # ----- coding (rows (..., H, D)) -----------------------------------------------------------
    def _spread_units(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (..., H, D) -> (z in spread units of the basis, fp16-rounded row scale (..., H))."""
        t = self._tables(x.device)
        z = torch.einsum("...hd,hde->...he", x.float() - t.mean, t.basis) / t.spread
        return z, _row_scale(z, t.live).to(torch.float16).float()

    def _codes(self, z: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        u = z / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
        # index into each direction's grid: how many of its midpoints lie below (a batched
        # binary search over (H, D) grids; the rows go last for searchsorted)
        lead = u.shape[:-2]
        rows = u.reshape(-1, *u.shape[-2:]).permute(1, 2, 0).contiguous()             # (H, D, N)
        codes = torch.searchsorted(self._tables(z.device).mids, rows)
        return codes.permute(2, 0, 1).reshape(*lead, *u.shape[-2:])

    def _pack(self, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        t = self._tables(codes.device)
        stream = (codes.gather(-1, t.src_dir.expand(*codes.shape[:-1], -1)) >> t.src_bit) & 1
        stream = stream.reshape(*codes.shape[:-1], t.n_bits // 8, 8) << torch.arange(8, device=codes.device)
        return torch.cat([fp16_bytes(scale), stream.sum(-1).to(torch.uint8)], -1)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        z, scale = self._spread_units(x)
        return self._pack(scale, self._codes(z, scale))

    @staticmethod
    def _bad_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(T,) True where a row holds NaN/inf or its scale overflowed fp16."""
        return ~torch.isfinite(x.reshape(x.shape[0], -1)).all(-1) | ~torch.isfinite(scale.reshape(x.shape[0], -1)).all(-1)

    def encode_flagged(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, scale = self._spread_units(x)
        return self._pack(scale, self._codes(z, scale)), self._bad_rows(x, scale)

    def overflow_flag(self, x: torch.Tensor) -> torch.Tensor:
        return self._bad_rows(x, self._spread_units(x)[1])         # the scale alone: no codes, no packing

    def _unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., H, row) -> code-domain values without the row scale (..., H, D), scale (..., H)."""
        t = self._tables(packed.device)
        scale = fp16_from_bytes(packed[..., :2])
        # each code: the 16-bit little-endian word at its first byte, shifted and masked (codes
        # are at most 8 bits, so 16 always hold one). Bytes are gathered as uint8 and widened
        # after: gathering int64 costs 9x as much.
        body = packed[..., 2:]
        lo = body.gather(-1, t.lo_byte.expand(*body.shape[:-1], -1)).int()
        hi = body.gather(-1, t.hi_byte.expand(*body.shape[:-1], -1)).int()
        codes = ((lo | (hi << 8)) >> t.shift) & t.mask
        table = t.levels.expand(*codes.shape, LEVELS)                 # a view: no copy per row
        return table.gather(-1, codes.long().unsqueeze(-1)).squeeze(-1), scale

    def _decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        y, scale = self._unpack(packed)
        t = self._tables(packed.device)
        return torch.einsum("...he,hed->...hd", y * scale[..., None], t.synthesis) + t.mean

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The checked encode: the base's input checks, then one pass that refuses a row whose
        scale overflows fp16 (the base's value limit is in the model domain; this one is not)."""
        x = check_float_input(x, self.name)
        self.check_head_dim(x.shape[-1])
        packed, bad = self.encode_flagged(x)
        if bool(bad.any()):
            raise ValueError(f"{self.name}: a row is too large for the fp16 row scale (over {FP16_MAX:g} "
                             f"times its calibrated spread)")
        return packed

    # ----- attention hooks (heads first) ----------------------------------------------------------
    @property
    def transformed(self) -> bool:
        return True

    def to_code_domain(self, x: torch.Tensor) -> torch.Tensor:
        t = self._tables(x.device)
        return torch.einsum("h...d,hde->h...e", x.float() - _lead(t.mean, x), t.basis)

    def from_code_domain(self, y: torch.Tensor) -> torch.Tensor:
        """Affine: exact for an attention output, whose weights sum to one."""
        t = self._tables(y.device)
        return torch.einsum("h...e,hed->h...d", y, t.synthesis) + _lead(t.mean, y)

    def decode_code_domain(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        y, scale = self.decode_code_domain_scaled(packed, head_dim)
        return y * scale[..., None]

    def decode_code_domain_scaled(self, packed: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        y, scale = self._unpack(packed.movedim(0, -2))
        return y.movedim(-2, 0), scale.movedim(-1, 0)


def _lead(per_head: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(H, D) shaped to broadcast over ``like`` (H, ..., D)."""
    return per_head.reshape(per_head.shape[0], *([1] * (like.dim() - 2)), per_head.shape[-1])


__all__ = ["KLTFormat", "KVCalibration", "LayerCalibration", "CALIBRATION_FILE", "allocate", "fit_grid",
           "calibrate_layer", "random_calibration"]
