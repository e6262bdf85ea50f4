"""Needle in a haystack: pass-key retrieval over a grid of context lengths x needle depths.

Samples come from :mod:`kvslim.eval.needle` (canonical pass-key phrasing, real
filler documents), seeded per cell exactly as ``training/evaluate.py`` seeds
them, so the f16 row here is comparable with the model card. Every K/V pair is
scored on the same samples: greedy decoding through the engine (prefill and
decode read the compressed cache), and a sample passes when the generated text
starts with the pass key and no further digit follows it.
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

from ..engine.llm import LLM
from . import needle
from .perplexity import Progress

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def default_lengths(n_ctx: int) -> list[int]:
    """Powers of two from 1K (or n_ctx/4 when smaller) up to the context size."""
    lengths, n = [], n_ctx
    while n >= min(1024, n_ctx // 4) and len(lengths) < 6:
        lengths.append(n)
        n //= 2
    return sorted(lengths)


def build_samples(docs: Sequence[str], count_tokens: Callable[[str], int], lengths: Sequence[int],
                  depths: Sequence[float], samples: int, seed: int = 0) -> dict:
    """``{(length, depth): [NeedleSample, ...]}``; each sample holds at most ``length`` tokens."""
    if not docs:
        raise ValueError("niah needs filler documents: give a text file with -f")
    grid = {}
    for length in lengths:
        for depth in depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"needle depths must lie in [0, 1], got {depth}")
            grid[length, depth] = [
                needle.build_sample(docs, random.Random(f"kvslim-niah:{seed}:{length}:{depth:.3f}:{i}"), depth,
                                    kind=needle.CANONICAL_KIND, target_tokens=length, count_tokens=count_tokens,
                                    canonical=True)
                for i in range(samples)]
            check_fits(grid[length, depth], length, count_tokens)
    return grid


def check_fits(samples: Sequence[needle.NeedleSample], length: int, count_tokens: Callable[[str], int]) -> None:
    """build_sample cuts the filler, never the needle and question: below their size a "length"
    cell would score a bare question at some other length."""
    for sample in samples:
        n = count_tokens(sample.prompt + sample.answer)
        if n > length:
            raise ValueError(f"a context length of {length} tokens cannot hold the needle and its question "
                             f"({n} tokens); use longer --lengths")


def digits_prefix(text: str) -> str:
    """The run of digits the text starts with (after leading spaces)."""
    text = text.lstrip()
    end = 0
    while end < len(text) and text[end].isdigit():
        end += 1
    return text[:end]


def retrieve(llm: LLM, sample: needle.NeedleSample) -> tuple[bool, str]:
    """Greedy completion of the prompt; (passed, generated text)."""
    ids = llm.tokenize(sample.prompt)
    want = len(llm.tokenize(sample.answer, add_special=False))
    room = llm.ctx - len(ids)
    if room < 1:
        raise ValueError(f"a needle prompt of {len(ids)} tokens does not fit -c {llm.ctx}")
    out = llm.generate(ids, min(want + 1, room), temperature=0.0)
    return digits_prefix(out.text) == sample.answer.strip(), out.text


def run_grid(llm: LLM, samples: dict, progress: Progress | None = None) -> dict:
    """Pass rate per (length, depth) cell for ``llm``'s cache types."""
    lengths = sorted({length for length, _ in samples})
    depths = sorted({depth for _, depth in samples})
    rates, outputs = [], {}
    for length in lengths:
        row = []
        for depth in depths:
            hits = []
            for sample in samples[length, depth]:
                ok, text = retrieve(llm, sample)
                hits.append(ok)
                outputs.setdefault(f"{length}@{depth:.2f}", []).append(text)
                if progress:
                    progress(1)
            row.append(sum(hits) / len(hits) if hits else float("nan"))
        rates.append(row)
    flat = [r for row in rates for r in row]
    return {"type_k": llm.engine.type_k, "type_v": llm.engine.type_v, "lengths": lengths, "depths": depths,
            "pass_rate": rates, "overall": sum(flat) / len(flat), "samples_per_cell": len(next(iter(samples.values()))),
            "outputs": outputs}


def render_table(grid: dict) -> str:
    """Markdown: one row per context length, one column per needle depth, cells = pass rate (%)."""
    from ..tables import markdown_table

    headers = ["context"] + [f"depth {d:.2f}" for d in grid["depths"]] + ["all"]
    rows = [[str(length)] + [f"{100 * r:.0f}%" for r in row] + [f"{100 * sum(row) / len(row):.0f}%"]
            for length, row in zip(grid["lengths"], grid["pass_rate"])]
    return markdown_table(headers, rows, ["r"] * len(headers))


def plot_heatmaps(grids: list[dict], path, title: str = "") -> None:
    """One pass-rate heatmap per K/V pair, side by side, saved as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(grids)
    fig, axes = plt.subplots(1, n, figsize=(1.5 + 3.4 * n, 3.8), squeeze=False, layout="constrained")
    for ax, grid in zip(axes[0], grids):
        image = ax.imshow([[100 * r for r in row] for row in grid["pass_rate"]], vmin=0, vmax=100,
                          cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(grid["depths"])), [f"{d:.2f}" for d in grid["depths"]])
        ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
        ax.set_xlabel("needle depth")
        if ax is axes[0][0]:
            ax.set_ylabel("context (tokens)")
        ax.set_title(f"{grid['type_k']}/{grid['type_v']}: {100 * grid['overall']:.0f}%")
        for i, row in enumerate(grid["pass_rate"]):
            for j, r in enumerate(row):
                ax.text(j, i, f"{100 * r:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), label="pass rate (%)", shrink=0.9)
    fig.suptitle(title or "Needle in a haystack: pass-key retrieval")
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["DEFAULT_DEPTHS", "default_lengths", "build_samples", "digits_prefix", "retrieve", "run_grid",
           "render_table", "plot_heatmaps"]
