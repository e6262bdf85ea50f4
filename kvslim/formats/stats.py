"""Error and throughput measurements of a KV format on sample vectors.

Used by ``kvslim quant`` and ``benchmarks/formats.py``; kept here so both print
figures computed the same way.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from .base import KVFormat


@dataclass
class FormatStats:
    """What one format does to one set of vectors (names are the JSON keys)."""

    type: str
    head_dim: int
    bits_per_value: float
    nmse: float          # mean ||x - x_hat||^2 / ||x||^2
    ip_rel_err: float    # RMS(<q, x_hat> - <q, x>) / RMS(<q, x>)
    ip_bias: float       # least-squares slope of <q, x_hat> on <q, x>, minus 1
    encode_vps: float    # vectors encoded per second
    decode_vps: float    # vectors decoded per second

    def as_dict(self) -> dict:
        return asdict(self)


def inner_product_errors(x: torch.Tensor, x_hat: torch.Tensor, queries: torch.Tensor) -> tuple[float, float]:
    """(relative RMS error, multiplicative bias) of inner products against ``queries``."""
    exact = (x @ queries.T).double()
    approx = (x_hat @ queries.T).double()
    rel = ((approx - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    slope = ((approx * exact).sum() / exact.pow(2).sum()).item()
    return rel, slope - 1.0


def _best_rate(fn, n_vectors: int, repeats: int) -> float:
    """Vectors per second, from the fastest of ``repeats`` runs (the least disturbed one)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n_vectors / max(best, 1e-9)


def measure(fmt: KVFormat, x: torch.Tensor, queries: torch.Tensor, repeats: int = 3) -> FormatStats:
    """Measure ``fmt`` on vectors ``x`` (N, head_dim) with query vectors (M, head_dim)."""
    head_dim = x.shape[-1]
    packed = fmt.encode(x)
    x_hat = fmt.decode(packed, head_dim)
    nmse = ((x - x_hat).pow(2).sum(-1) / x.pow(2).sum(-1).clamp_min(1e-30)).mean().item()
    rel, bias = inner_product_errors(x, x_hat, queries)
    return FormatStats(
        type=fmt.name, head_dim=head_dim, bits_per_value=fmt.bits_per_value(head_dim),
        nmse=nmse, ip_rel_err=rel, ip_bias=bias,
        encode_vps=_best_rate(lambda: fmt.encode(x), len(x), repeats),
        decode_vps=_best_rate(lambda: fmt.decode(packed, head_dim), len(x), repeats),
    )
