"""Candidate KV formats per bit: grid fitting and normalised MSE on N(0,1) and real K/V rows.

    python benchmarks/format_study.py --fit                 # fit the nl grids, print them
    python benchmarks/format_study.py -f TEXT [-c 4096]     # NMSE table: N(0,1) and the bundled
                                                            # model's K and V rows on TEXT

NMSE = sum ||x - x_hat||^2 / sum ||x||^2 over all rows. Real rows are the keys
(after norm and RoPE) and values that the bundled model's attention layers append to
their cache while it reads ``-c`` tokens of TEXT. Candidates that are not formats of
the table are built from a FormatSpec on the spot (same code, other block sizes).
"""
from __future__ import annotations

import argparse
import time

import torch

from kvslim import formats
from kvslim.formats.base import FormatSpec
from kvslim.formats.grid import GRIDS, GridFormat, nearest_code, search_scale


# ----- grid fitting -----------------------------------------------------------------------
def lloyd_max_gaussian(bits: int, samples: torch.Tensor, iters: int = 60) -> torch.Tensor:
    """Lloyd-Max levels for the empirical distribution ``samples`` (a starting grid)."""
    k = 1 << bits
    grid = torch.quantile(samples[:200_000], (torch.arange(k) + 0.5) / k)
    for _ in range(iters):
        codes = nearest_code(samples, grid)
        grid = torch.stack([samples[codes == i].mean() for i in range(k)])
    return grid


def fit_grid(bits: int, block: int, n_blocks: int = 60_000, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Grid fitted jointly with the encoder's scale search on N(0,1) blocks.

    Alternates: per-block scale search with the current grid, then each grid point
    becomes the mean of the scaled values assigned to it; symmetrised, normalised to
    max 1 (only the shape matters: the scale absorbs the rest).
    """
    x = torch.randn(n_blocks, block, generator=torch.Generator().manual_seed(seed))
    grid = lloyd_max_gaussian(bits, x.flatten())
    grid = grid / grid.abs().max()
    for _ in range(iters):
        d, codes = search_scale(x, grid)
        u = (x / d[:, None]).flatten()
        c = codes.flatten()
        grid = torch.stack([u[c == i].mean() for i in range(len(grid))])
        grid = 0.5 * (grid - grid.flip(0))                     # symmetric
        grid = grid / grid.abs().max()
    return grid


# ----- candidates --------------------------------------------------------------------------
def grid_candidate(bits: int, block: int, role: str) -> GridFormat:
    spec = FormatSpec(f"nl{bits}/{block}", "nl", block, bits, 2, "study candidate")
    return GridFormat(spec, role)


def candidates(role: str) -> list[tuple[str, object]]:
    """(label, format) pairs: table formats, then nl grids at other block sizes."""
    out = [(n, formats.get(n, role=role)) for n in
           ("q8_0", "q5_0", "q4_1", "iq4_nl", "q4_0", "iq4_nl-norot", "q4_0-norot", "turbo4", "turbo3", "turbo2",
            "nl4s", "nl3s")]
    for bits, block in ((4, 32), (4, 64), (4, 128), (3, 32), (3, 64), (2, 32)):
        if GRIDS.get(bits):
            out.append((f"nl{bits} b{block}", grid_candidate(bits, block, role)))
    return out


def nmse(fmt, x: torch.Tensor) -> float:
    y = fmt.decode(fmt.encode(x), x.shape[-1])
    return float(((y - x) ** 2).sum() / (x ** 2).sum())


# ----- real rows ------------------------------------------------------------------------------
def model_rows(path: str, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K rows, V rows), each (N, head_dim) float32, from the bundled model reading ``path``."""
    from kvslim.cache.kv import KVCache
    from kvslim.engine.llm import load

    seen_k, seen_v = [], []
    forward = KVCache.forward                   # the model's one call per attention layer

    def spy(self, batch, q, k, v):
        seen_k.append(k.detach().float().reshape(-1, k.shape[-1]))
        seen_v.append(v.detach().float().reshape(-1, v.shape[-1]))
        return forward(self, batch, q, k, v)

    llm = load(None, ctx=n_ctx, cache_type_k="f32", cache_type_v="f32", dtype=torch.float32)
    ids = llm.tokenize(open(path, encoding="utf-8").read())[:n_ctx]
    KVCache.forward = spy
    try:
        llm.logits(ids)
    finally:
        KVCache.forward = forward
    return torch.cat(seen_k), torch.cat(seen_v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="fit the nl grids and print them")
    p.add_argument("-f", "--file", default=None, help="text for real K/V rows")
    p.add_argument("-c", "--ctx", type=int, default=2048)
    p.add_argument("--rows", type=int, default=20000, help="N(0,1) rows of 128")
    args = p.parse_args()
    if args.fit:
        for bits, block in ((4, 64), (3, 32), (2, 32)):
            t = time.time()
            g = fit_grid(bits, block)
            print(f"{bits}-bit grid (block {block}, {time.time() - t:.0f} s):",
                  "(" + ", ".join(f"{v:.6f}" for v in g.tolist()) + ")")
        return
    gauss = torch.randn(args.rows, 128, generator=torch.Generator().manual_seed(1))
    rows = {"N(0,1)": (gauss, gauss)}
    if args.file:
        rows["model"] = model_rows(args.file, args.ctx)
    print("| candidate | bits/value | NMSE N(0,1) | NMSE K rows | NMSE V rows |")
    print("|---|--:|--:|--:|--:|")
    for (label, fk), (_, fv) in zip(candidates("k"), candidates("v")):
        cells = [f"{nmse(fk, gauss):.5f}"]
        if args.file:
            k, v = rows["model"]
            cells += [f"{nmse(fk, k):.5f}", f"{nmse(fv, v):.5f}"]
        print(f"| {label} | {fk.bits_per_value(128):.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
