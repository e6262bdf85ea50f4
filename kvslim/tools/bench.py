"""``kvslim bench``: llama-bench's pp/tg measurements, swept over depth and K/V types."""
from __future__ import annotations

import argparse
import itertools
import re
import sys

import torch

from .. import formats
from ..bench import FilledCache, Test, measure
from ..bench.report import markdown, model_facts, plot, record
from ..cache import CacheConfig
from ..engine.config import resolve_device
from ..loading import load_model
from ..tables import render_records
from .common import add_load_args, apply_threads, check_output, load_kwargs

RANGE = re.compile(r"^(\d+)-(\d+)(?:([+*])(\d+))?$")


def int_list(text: str) -> list[int]:
    """llama-bench's number lists: ``1,2,4``, ranges ``0-16384+4096`` and ``512-4096*2``."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        m = RANGE.match(part)
        if m:
            n, last, op, step = int(m[1]), int(m[2]), m[3] or "+", int(m[4] or 1)
            if step < 1 or (op == "*" and (step < 2 or n < 1)):
                raise ValueError(f"range {part!r} never advances")
            while n <= last:
                out.append(n)
                n = n + step if op == "+" else n * step
        elif re.fullmatch(r"-?\d+", part):
            out.append(int(part))
        else:
            raise ValueError(f"cannot read {part!r} as a number or a range like 0-16384+4096")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim bench", description=__doc__)
    add_load_args(p)
    p.add_argument("-p", "--n-prompt", default="512", help="prompt tokens for pp tests (list; 0 skips pp)")
    p.add_argument("-n", "--n-gen", default="128", help="generated tokens for tg tests (list; 0 skips tg)")
    p.add_argument("-pg", action="append", default=[], metavar="PP,TG",
                   help="a prompt of PP tokens then TG decoded, timed together as one test (repeatable; "
                        "t/s counts both, as llama-bench's -pg)")
    p.add_argument("-d", "--n-depth", default="0", help="depths to fill first (list or range)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs after one warm-up")
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="K types (comma list): " + ", ".join(formats.names()))
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="V types (comma list)")
    p.add_argument("--pairs", default=None, help="explicit K/V pairs instead of every combination, e.g. f16/f16,q8_0/turbo4")
    p.add_argument("-np", "--n-parallel", default="1", help="sequences decoded together in tg (list)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-o", "--output", choices=["md", "csv", "json", "jsonl"], default="md")
    p.add_argument("--plot", default=None, help="write tokens/s against depth to this PNG")
    p.add_argument("--no-progress", action="store_true")
    return p


def kv_pairs(args) -> list[tuple[str, str]]:
    if args.pairs:
        pairs = []
        for item in args.pairs.split(","):
            k, _, v = item.partition("/")
            pairs.append((formats.get(k.strip()).name, formats.get((v or k).strip()).name))
        return pairs
    ks = [f.name for f in formats.parse_list(args.cache_type_k)]
    vs = [f.name for f in formats.parse_list(args.cache_type_v)]
    if not ks or not vs:                     # "-ctk ," would print an empty table and exit 0
        raise ValueError("-ctk and -ctv need at least one cache type each")
    return list(itertools.product(ks, vs))


def tests_for(args) -> list[Test]:
    depths = sorted(set(int_list(args.n_depth)))
    prompts, gens = int_list(args.n_prompt), int_list(args.n_gen)
    for flag, values in (("-p", prompts), ("-n", gens), ("-d", depths)):
        if any(n < 0 for n in values):       # 0 skips a test; a negative count is a typo, not a skip
            raise ValueError(f"{flag} takes counts of 0 or more, got {min(values)}")
    pp = [n for n in prompts if n > 0]
    tg = [n for n in gens if n > 0]
    pg = [pair for pair in map(pg_pair, args.pg) if any(pair)]   # llama-bench skips -pg 0,0
    if not (pp or tg or pg):
        raise ValueError("at least one of -p / -n / -pg must be positive")
    return [test for d in depths for test in [Test("pp", n, d) for n in pp] + [Test("tg", n, d) for n in tg]
            + [pg_test(p_, g, d) for p_, g in pg]]


def pg_test(n_prompt: int, n_gen: int, depth: int) -> Test:
    """-pg PP,TG as a test; with one count 0 it is the plain pp or tg test (llama-bench labels it so)."""
    if n_prompt and n_gen:
        return Test("pg", n_prompt, depth, n_gen)
    return Test("pp", n_prompt, depth) if n_prompt else Test("tg", n_gen, depth)


def pg_pair(text: str) -> tuple[int, int]:
    """-pg's ``512,128`` -> (512, 128); either may be 0 (then it is a plain pp or tg test)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(re.fullmatch(r"\d+", x.strip()) for x in parts):
        raise ValueError(f"-pg takes two counts of 0 or more, PP,TG, got {text!r}")
    return int(parts[0]), int(parts[1])


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.repetitions < 1 or args.ubatch_size < 1:
        raise ValueError("-r and -ub must be at least 1")
    apply_threads(args)
    pairs, tests, nps = kv_pairs(args), tests_for(args), int_list(args.n_parallel)
    if any(n < 1 for n in nps):
        raise ValueError("-np must be at least 1")
    check_output(args.plot, "--plot")         # written after every test has run: refuse a bad path first
    model, _, _ = load_model(args.model, device=resolve_device(args.device), **load_kwargs(args))
    facts = model_facts(model, torch.get_num_threads())
    records = run_all(model, facts, pairs, tests, nps, args)
    emit(records, args)
    return 0


def run_all(model, facts, pairs, tests, nps, args) -> list[dict]:
    from tqdm import tqdm

    ctx = max(t.n_depth for t in tests) + max(t.n_prompt + t.n_generated for t in tests) + 1
    bar = tqdm(total=max(t.n_depth for t in tests) * len(pairs) * sum(nps), desc="filling depth", unit="tok", disable=args.no_progress,
               file=sys.stderr)
    records = []
    for (type_k, type_v), n_par in itertools.product(pairs, nps):
        cache = CacheConfig(ctx, n_par, type_k, type_v, backend=args.attn_backend, f16_window=args.f16_window,
                            device=model.model.embed_tokens.weight.device)
        fc = FilledCache(model, ctx, n_par, type_k, type_v, args.ubatch_size, cache_config=cache,
                         compile=args.compile, native=getattr(args, "native", True),
                         cuda_graphs=getattr(args, "cuda_graphs", None))
        case = {"type_k": type_k, "type_v": type_v, "n_parallel": n_par, "n_ubatch": args.ubatch_size,
                "f16_window": args.f16_window}
        for test in tests:
            if test.kind != "tg" and n_par > 1:
                continue                                             # -np applies to decode
            if test.n_depth != fc.depth:
                fc.grow_to(test.n_depth, bar)
            result = measure(fc, test, args.repetitions)          # the step's path as it ran (graphs may fall back)
            records.append(record(facts, test, {**case, "decode": fc.decode.path}, result))
        graphed = fc.decode.graphed
        if graphed is not None and graphed.why_eager:
            print(f"[bench] {type_k}/{type_v}: {graphed.why_eager}; decode steps ran eagerly after it", file=sys.stderr)
    bar.close()
    return records


def emit(records: list[dict], args) -> None:
    if args.plot:
        plot(records, args.plot)
    print(render_records(records, args.output, markdown))
