"""KLD of K/V formats with the newest tokens kept in f16 (the cache's ``f16_window``, KIVI's residual).

    python benchmarks/kv_window.py -f TEXT [-c 4096] [--chunks 8] [-ub 16] nl3s:0 nl3s:64 q4_0:0

A config is ``K[/V]:W``: the formats and the window of W tokens per sequence that stay in
f16 before they are packed. Prompts are read in ubatches of ``-ub`` tokens, so every query
finds its W newest keys (up to one ubatch less) in the window, as it would while decoding;
with 512-token ubatches most queries would not. Scoring is kld_vs_llama_cpp's: chunks of
``-c`` tokens, first token BOS, rows c/2 .. c-2, KLD over the whole vocabulary against the
same model with an f16 cache read in the same ubatches. bits/value counts the window at
16 bits over a whole ``-c`` context.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kvslim
from kvslim import formats
from kvslim.eval.perplexity import bos_id, chunk_ids
from kld_vs_llama_cpp import compare  # noqa: E402  (same folder)


def scored_logits(text: str, ctx: int, n_chunks: int, ubatch: int, type_k: str, type_v: str, window: int):
    llm = kvslim.load(ctx=ctx, cache_type_k=type_k, cache_type_v=type_v, dtype="f32", n_ubatch=ubatch,
                      f16_window=window)
    chunks = chunk_ids(llm.tokenize(text), ctx, n_chunks, bos_id(llm))
    return np.concatenate([llm.logits(c)[ctx // 2 - 1:ctx - 2].numpy() for c in chunks])


def bits(type_k: str, type_v: str, window: int, ctx: int, head_dim: int = 128) -> float:
    packed = (formats.get(type_k).row_bytes(head_dim) + formats.get(type_v, role="v").row_bytes(head_dim)) * 4 / head_dim
    return (packed * (ctx - window) + 16 * window) / ctx


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-f", "--file", required=True)
    p.add_argument("-c", "--ctx", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("-ub", "--ubatch", type=int, default=16)
    p.add_argument("configs", nargs="+", help="K[/V]:W, e.g. nl3s:64 q8_0/turbo4:0")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    text = Path(args.file).read_text()
    base = scored_logits(text, args.ctx, args.chunks, args.ubatch, "f16", "f16", 0)
    print("| K/V | f16 window | bits/value | mean KLD | same top-1 |\n|---|--:|--:|--:|--:|")
    for config in args.configs:
        pair, window = config.rsplit(":", 1)
        type_k, _, type_v = pair.partition("/")
        type_v, window = type_v or type_k, int(window)
        t = time.time()
        kld, same = compare(base, scored_logits(text, args.ctx, args.chunks, args.ubatch, type_k, type_v, window))
        print(f"| {type_k}/{type_v} | {window} | {bits(type_k, type_v, window, args.ctx):.2f} | {kld.mean():.6f} "
              f"| {same.mean() * 100:.2f}% |", flush=True)
        print(f"  ({config}: {time.time() - t:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
