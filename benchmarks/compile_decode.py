"""Eager against compiled decode (``--compile``) on the bundled model, side by side in one run.

For each K/V pair and depth: one cache filled once, then tg runs alternating between the
eager and the compiled decode step (each restores the same snapshot), medians reported.
The compiled step's first-token cost is measured in fresh processes: cold (an empty
inductor cache directory) and warm (the same directory again: inductor's on-disk cache
hit, dynamo tracing still paid).

    python benchmarks/compile_decode.py -d 0,4096 -n 32 -r 5 --pairs f16/f16,q8_0/q8_0,turbo4/turbo4
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from kvslim.bench import FilledCache
from kvslim.bench.runner import time_tg
from kvslim.engine.decode_step import DecodeStep
from kvslim.loading import load_model


def first_token_s(type_k: str, type_v: str, threads: int) -> float:
    """In a fresh process: seconds from building a compiled DecodeStep to its first token."""
    code = ("import sys, time, torch; from kvslim.bench import FilledCache; from kvslim.loading import load_model;"
            f"torch.set_num_threads({threads}); m, _, _ = load_model(None, 'f32');"
            f"fc = FilledCache(m, 64, 1, '{type_k}', '{type_v}', 512, compile=True, native=False); fc.grow_to(8);"
            "t0 = time.perf_counter(); fc.decode([0], [1], [8]); print(time.perf_counter() - t0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def compare(model, fc: FilledCache, n: int, reps: int) -> tuple[list[float], list[float]]:
    eager, compiled = DecodeStep(model, fc.caches, compile=False, native=False), fc.decode
    rates = {"eager": [], "compiled": []}
    for rep in range(reps + 1):                                  # rep 0 warms both up
        for name, step in (("eager", eager), ("compiled", compiled)):
            fc.decode = step
            fc.restore()
            seconds = time_tg(fc, n)
            if rep:
                rates[name].append(n / seconds)
    fc.decode = compiled
    return rates["eager"], rates["compiled"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-d", "--depths", default="0,4096")
    ap.add_argument("-n", type=int, default=32, help="tokens decoded per run")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--pairs", default="f16/f16,q8_0/q8_0,turbo4/turbo4")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvslim-inductor-")   # cold
    torch.set_num_threads(args.threads)
    model, _, _ = load_model(None, "f32")
    depths = [int(d) for d in args.depths.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print("| K/V | depth | eager t/s | compiled t/s | ratio | first token cold s | warm s |")
    print("|---|--:|--:|--:|--:|--:|--:|")
    for index, pair in enumerate(args.pairs.split(",")):
        type_k, type_v = pair.split("/")
        fc = FilledCache(model, max(depths) + args.n + 2, 1, type_k, type_v, 512, compile=True, native=False)
        for depth in depths:
            fc.grow_to(depth)
            first = depth == depths[0] and index == 0                 # compile cost: the first pair only
            cold = first_token_s(type_k, type_v, args.threads) if first else float("nan")   # empty cache dir
            warm = first_token_s(type_k, type_v, args.threads) if first else float("nan")   # its files reused
            eager, compiled = compare(model, fc, args.n, args.repetitions)
            e, c = statistics.median(eager), statistics.median(compiled)
            print(f"| {pair} | {depth} | {e:.1f} | {c:.1f} | {c / e:.2f}x | {cold:.1f} | {warm:.1f} |", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
