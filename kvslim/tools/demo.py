"""``kvslim demo``: the bundled model end to end in one minute.

A short generation, then the same long-context retrieval prompt (a pass key
hidden in held-out text) answered with an f16 KV cache and with a compressed
K/V pair, side by side: answer, KV memory, prompt and generation speed.
"""
from __future__ import annotations

import argparse
import random

from .. import formats
from ..data import heldout_documents
from ..engine import load
from ..eval.needle import build_sample
from .common import human_bytes, markdown_table

OPENING = "It is a truth universally acknowledged, that"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim demo", description=__doc__)
    p.add_argument("-m", "--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("-c", "--ctx-size", type=int, default=3072, help="length of the retrieval prompt (tokens)")
    p.add_argument("-ctk", "--cache-type-k", default="q8_0", help="K type of the compressed run")
    p.add_argument("-ctv", "--cache-type-v", default="turbo4", help="V type of the compressed run")
    p.add_argument("-n", "--n-predict", type=int, default=40, help="tokens of the opening generation")
    p.add_argument("--depth", type=float, default=0.5, help="where the pass key sits (0 = start, 1 = end)")
    p.add_argument("-s", "--seed", type=int, default=1)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    formats.get(args.cache_type_k), formats.get(args.cache_type_v)
    if args.ctx_size < 256:
        raise ValueError("-c must be at least 256 tokens for the retrieval prompt")
    pairs = [("f16", "f16"), (args.cache_type_k, args.cache_type_v)]
    first = load(args.model, ctx=args.ctx_size + 64, device=args.device)          # f16/f16; one copy of the weights
    llms = [first, first.with_cache_types(*pairs[1])]
    opening = llms[0].generate(OPENING, args.n_predict, temperature=0.7, top_p=0.9, seed=args.seed)
    print(f"{OPENING}{opening.text}\n")
    sample = build_sample(heldout_documents(), random.Random(args.seed), args.depth,
                          target_tokens=args.ctx_size, count_tokens=lambda t: len(llms[0].tokenize(t)),
                          canonical=True)
    print(f"Retrieval: a pass key at depth {args.depth:.0%} of a {args.ctx_size}-token prompt of held-out text; "
          f"expected{sample.answer}\n")
    rows = [retrieval_row(llm, k, v, sample) for llm, (k, v) in zip(llms, pairs)]
    print(markdown_table(["K/V", "answer", "found", "KV bytes", "prompt tok/s", "gen tok/s"], rows,
                         ["l", "l", "l", "r", "r", "r"]))
    return 0


def retrieval_row(llm, type_k: str, type_v: str, sample) -> list:
    done = llm.generate(sample.prompt, max_tokens=len(llm.tokenize(sample.answer)) + 2, temperature=0)
    found = done.text.strip().startswith(sample.answer.strip())
    return [f"{type_k}/{type_v}", repr(done.text.strip()[:12]), "yes" if found else "no",
            f"{human_bytes(done.kv_bytes)}", f"{done.prompt_tps:.0f}", f"{done.gen_tps:.1f}"]
