"""``kvslim demo``: the bundled model end to end in well under a minute on two idle cores.

A streamed generation, then the same long-context retrieval prompt (a pass key
hidden in held-out text) answered with an f16 KV cache and with a compressed
K/V pair, side by side: answer, KV memory, and the median prompt and
generation speed of -r runs after a short warm-up run of each pair. Progress
goes to stderr.

On a machine busy with other work, -t 1 can be several times faster than the
default of one thread per core: the tiny model runs thousands of small ops per
token, and each waits for every thread, including one the OS has paused.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from .. import formats
from ..data import heldout_documents
from ..engine import load
from ..eval.needle import build_sample
from ..tables import human_bytes, markdown_table
from .common import add_load_args, apply_threads, load_kwargs

OPENING = "It is a truth universally acknowledged, that"
ANSWER_TOKENS = 16      # enough decode steps for a steady gen tok/s; the answer is read from the start
WARMUP_TOKENS = 256     # a warm-up prompt: long enough to touch every kernel a full prompt uses


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # f32 by default: on CPUs without native bf16 it prefills ~3x faster than the stored bf16
    add_load_args(p, dtype="f32")
    p.add_argument("-c", "--ctx-size", type=int, default=3072, help="length of the retrieval prompt (tokens)")
    p.add_argument("-ctk", "--cache-type-k", default="q8_0", help="K type of the compressed run")
    p.add_argument("-ctv", "--cache-type-v", default="turbo4", help="V type of the compressed run")
    p.add_argument("-n", "--n-predict", type=int, default=40, help="tokens of the opening generation")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed retrieval runs per K/V pair (median)")
    p.add_argument("--depth", type=float, default=0.5, help="where the pass key sits (0 = start, 1 = end)")
    p.add_argument("-s", "--seed", type=int, default=1)
    return p


def check_args(args) -> None:
    formats.get(args.cache_type_k), formats.get(args.cache_type_v)
    if args.ctx_size < 256:
        raise ValueError("-c must be at least 256 tokens for the retrieval prompt")
    if args.n_predict < 1 or args.repetitions < 1:
        raise ValueError("-n and -r must be at least 1")
    if not 0 <= args.depth <= 1:
        raise ValueError(f"--depth must be between 0 and 1, got {args.depth}")


def status(text: str) -> None:
    """Progress on stderr, so stdout holds only the generation and the table."""
    print(f"[demo] {text}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    apply_threads(args)
    started = time.perf_counter()
    status(f"loading {args.model or 'the bundled model'} ({args.dtype} weights, {torch.get_num_threads()} threads)")
    base = load(args.model, ctx=args.ctx_size + 64, device=args.device, backend=args.attn_backend, **load_kwargs(args))
    pairs = [("f16", "f16"), (args.cache_type_k, args.cache_type_v)]
    llms = [base] + [base.with_cache_types(*pair) for pair in pairs[1:]]
    stream_opening(base, args)
    sample = build_sample(heldout_documents(), random.Random(args.seed), args.depth, target_tokens=args.ctx_size,
                          count_tokens=lambda t: len(base.tokenize(t)), canonical=True)
    status(f"retrieval: a pass key at depth {args.depth:.0%} of a {args.ctx_size}-token prompt of held-out text; "
           f"expected{sample.answer}")
    rows = [retrieval_row(llm, pair, sample, args.repetitions) for llm, pair in zip(llms, pairs)]
    print(markdown_table(["K/V", "answer", "found", "KV bytes", "prompt tok/s", "gen tok/s"], rows,
                         ["l", "l", "l", "r", "r", "r"]))
    print(f"\nspeeds: median of {args.repetitions} run(s) per pair after a {WARMUP_TOKENS}-token warm-up; "
          f"{time.perf_counter() - started:.0f} s in all")
    return 0


def stream_opening(llm, args) -> None:
    """The opening sentence continued token by token as it is generated."""
    status(f"generating {args.n_predict} tokens")
    sys.stdout.write(OPENING)
    for chunk in llm.generate(OPENING, args.n_predict, stream=True, temperature=0.7, top_p=0.9, seed=args.seed):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    print("\n", flush=True)


def retrieval_row(llm, pair: tuple[str, str], sample, repetitions: int) -> list:
    """A short warm-up run (first calls pay for allocation and kernel selection), then ``repetitions``
    timed runs of the whole prompt; the answer is the same in every run (greedy), the speeds are medians."""
    name = f"{pair[0]}/{pair[1]}"
    ids = llm.tokenize(sample.prompt)
    warm = llm.generate(ids[:WARMUP_TOKENS], max_tokens=4, temperature=0)
    status(f"{name} warm-up: prompt {warm.prompt_tokens} tok {warm.prompt_tps:.0f} tok/s")
    runs = []
    for i in range(1, repetitions + 1):
        runs.append(llm.generate(ids, max_tokens=ANSWER_TOKENS, temperature=0))
        status(f"{name} run {i}/{repetitions}: prompt {runs[-1].prompt_tokens} tok {runs[-1].prompt_tps:.0f} tok/s, "
               f"gen {len(runs[-1].token_ids)} tok {runs[-1].gen_tps:.1f} tok/s")
    answer = runs[0].text.strip()
    found = answer.startswith(sample.answer.strip())
    return [name, repr(answer[:12]), "yes" if found else "no", human_bytes(runs[0].kv_bytes),
            f"{statistics.median(r.prompt_tps for r in runs):.0f}",
            f"{statistics.median(r.gen_tps for r in runs):.1f}"]
