"""Measured quality of K/V pairs: what the planner recommends at each bit budget.

Mean KL divergence of each pair's logits against the same engine's f16 cache, on the
bundled model (v2 weights, f32 compute) at -c 4096 over 8 chunks of held-out text that
is not in this repository (16,376 scored positions; `docs/eval-kld-formats.md` gives
the command, the text and the full table). Rankings come from these measurements, never
from names: at a given size the pair with the lowest measured KLD is recommended.
"""
from __future__ import annotations

from .. import formats

HEAD_DIM = 128   # the bundled model's, at which these were measured

# (type_k, type_v) -> mean KLD vs f16 (kvslim, 2026-11-24, one run of
# benchmarks/kld_vs_llama_cpp.py over all pairs). nl4s (4.25 bits) beats iq4_nl (4.5) by
# 18% and llama.cpp's rotated iq4_nl by 23%; nl4s/klt3 (3.5 bits) beats rotated q4_0 (4.5)
# by 46% but needs the model's KV calibration (the planner offers it only to a model
# that has one); nl4s/nl3s is the best pair under 4 bits that needs none.
MEASURED_KLD: dict[tuple[str, str], float] = {
    ("q8_0", "q8_0"): 0.0000040,
    ("iq4_nl", "iq4_nl"): 0.000569,
    ("nl4", "nl4"): 0.000591,
    ("nl4s", "nl4s"): 0.000464,
    ("q4_0", "q4_0"): 0.001007,
    ("nl4s", "klt3"): 0.000548,
    ("nl4s", "nl3s"): 0.001171,
    ("nl3", "nl3"): 0.003354,
    ("nl3s", "nl3s"): 0.002933,
}


def pair_bits(pair: tuple[str, str], head_dim: int = HEAD_DIM) -> float:
    """Mean stored bits per value of a K/V pair."""
    return (formats.get(pair[0]).bits_per_value(head_dim) + formats.get(pair[1]).bits_per_value(head_dim)) / 2


def ranked() -> list[tuple[str, str]]:
    """Measured pairs, lowest KLD first."""
    return sorted(MEASURED_KLD, key=MEASURED_KLD.get)


def best_at(bits: float, head_dim: int = HEAD_DIM) -> tuple[str, str] | None:
    """The measured pair with the lowest KLD among those at most ``bits`` bits per value."""
    fits = [p for p in ranked() if pair_bits(p, head_dim) <= bits + 1e-9]
    return fits[0] if fits else None


def ladder(head_dim: int = HEAD_DIM) -> list[tuple[tuple[str, str], float, float]]:
    """(pair, bits, KLD) of the measured pairs no smaller pair beats: the best at each budget,
    widest first."""
    rows = sorted(((p, pair_bits(p, head_dim), k) for p, k in MEASURED_KLD.items()), key=lambda r: (r[1], r[2]))
    out, best = [], float("inf")
    for row in rows:                                  # ascending bits: keep strict improvements
        if row[2] < best:
            out.append(row)
            best = row[2]
    return out[::-1]
