"""Quality by depth: KL divergence and top-1 agreement against the reference, per band of context depth.

Quantization error in K/V accumulates with the number of cached tokens a query
attends over, so averages over a 4K chunk hide what happens at 16K. Here every
row of long windows is scored (row ``j`` has ``j`` earlier tokens in context)
and the per-token statistics of :mod:`kvslim.eval.perplexity` are grouped by
depth band, e.g. 0-1K, 1K-4K, 4K-16K.
"""
from __future__ import annotations

import math

import numpy as np

from .perplexity import Comparison, mean_and_uncertainty

DEFAULT_EDGES = (0, 1024, 4096, 16384)


def bands(n_ctx: int, edges=DEFAULT_EDGES) -> list[tuple[int, int]]:
    """``[lo, hi)`` depth bands from ascending edges, the last one cut at ``n_ctx``
    (rows run to ``n_ctx - 2``: the last token is never a query with a next token)."""
    edges = sorted({int(e) for e in edges if 0 <= int(e) < n_ctx - 1} | {0})
    edges.append(n_ctx)
    return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


def band_label(lo: int, hi: int) -> str:
    def k(n):
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)
    return f"{k(lo)}-{k(hi)}"


def band_stats(c: Comparison, lo: int, hi: int) -> dict:
    """Mean KLD, top-1 agreement and both perplexities of the tokens scored at rows [lo, hi)."""
    pick = (c.positions >= lo) & (c.positions < hi)
    kld, kld_unc = mean_and_uncertainty(c.kld[pick])
    same = float(c.same_top[pick].mean())
    n = int(pick.sum())
    return {"band": band_label(lo, hi), "lo": lo, "hi": hi, "tokens": n,
            "kld_mean": kld, "kld_unc": kld_unc,
            "kld_p99": float(np.quantile(c.kld[pick], 0.99)),
            "same_top": same, "same_top_unc": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
            "ppl": math.exp(c.nll[pick].mean()), "ppl_base": math.exp(c.nll_base[pick].mean())}


def depth_profile(c: Comparison, n_ctx: int, edges=DEFAULT_EDGES) -> list[dict]:
    """One record per band for a comparison made with ``first=0`` (every row scored)."""
    return [{"type_k": c.type_k, "type_v": c.type_v, **band_stats(c, lo, hi)} for lo, hi in bands(n_ctx, edges)]


def depth_curve(c: Comparison, n_ctx: int, n_bins: int = 24) -> dict:
    """Mean KLD and top-1 agreement in log-spaced depth bins (for the plot)."""
    edges = np.unique(np.geomspace(16, n_ctx - 1, n_bins).astype(int))
    edges = np.concatenate([[0], edges])
    centers, kld, same = [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        pick = (c.positions >= lo) & (c.positions < hi)
        if pick.any():
            centers.append(float(np.sqrt(max(lo, 1) * hi)))
            kld.append(float(c.kld[pick].mean()))
            same.append(float(c.same_top[pick].mean()))
    return {"type_k": c.type_k, "type_v": c.type_v, "depth": centers, "kld": kld, "same_top": same}


def plot_depth(curves: list[dict], path, title: str = "") -> None:
    """Mean KLD (log scale) and top-1 agreement against depth, one line per K/V pair."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kld, ax_top) = plt.subplots(1, 2, figsize=(11, 4.2))
    for curve in curves:
        label = f"{curve['type_k']}/{curve['type_v']}"
        ax_kld.plot(curve["depth"], curve["kld"], marker=".", label=label)
        ax_top.plot(curve["depth"], [100 * s for s in curve["same_top"]], marker=".", label=label)
    for ax in (ax_kld, ax_top):
        ax.set_xscale("log")
        ax.set_xlabel("depth (tokens of context before the predicted token)")
        ax.grid(True, which="both", alpha=0.3)
    if any(min(c["kld"]) > 0 for c in curves if c["kld"]):
        ax_kld.set_yscale("log")
    ax_kld.set_ylabel("mean KL divergence vs reference")
    ax_top.set_ylabel("same top-1 token (%)")
    ax_kld.legend(fontsize=8)
    fig.suptitle(title or "KV cache quality by depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["DEFAULT_EDGES", "bands", "band_label", "band_stats", "depth_profile", "depth_curve", "plot_depth"]
