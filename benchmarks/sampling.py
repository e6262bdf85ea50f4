"""Per-step cost of sampling: the engine's batched shortlist path against the chain over the
whole vocabulary (``distribution_reference`` + a draw per row, which is what kvslim did before).

    python benchmarks/sampling.py [--vocab 248320] [--rows 1,4] [--device cpu] [--runs 30]

A step samples every predicting sequence, so for ``-np 4`` the cost is paid four times per
token on the reference path. Logits are synthetic and shaped like a language model's (a dozen
likely tokens over a flat tail); the cost of both paths depends on the vocabulary and the
settings, not on the values. Settings: llama.cpp's defaults (top-k 40, top-p 0.95, min-p
0.05, temperature 0.8), greedy, the defaults with a repetition penalty, and top-k off.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.devices import synchronize  # noqa: E402
from kvslim.engine.sampling import (Sampler, SamplingParams, distribution_reference, penalized,  # noqa: E402
                                   sample_rows)
from kvslim.tables import markdown_table  # noqa: E402

SETTINGS = {"defaults": SamplingParams(), "greedy": SamplingParams(temperature=0),
            "defaults + repeat 1.1": SamplingParams(repeat_penalty=1.1),
            "top-k off": SamplingParams(top_k=0)}


def logits_like_a_model(rows: int, vocab: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g) * 2
    x[:, torch.randint(0, vocab, (rows, 12), generator=g)] += 12 * torch.rand(rows, 12, generator=g)
    return x.to(device)


def reference_step(samplers, logits, histories) -> list[int]:
    """What kvslim did before: a row at a time, greedy as the argmax, else the whole chain and a draw."""
    return [int(penalized(s._masked(logits[i]), histories[i], s.params).argmax()) if s.params.greedy else
            int(torch.multinomial(distribution_reference(s, logits[i], histories[i]), 1, generator=s.generator))
            for i, s in enumerate(samplers)]


def median_ms(fn, runs: int, device: str) -> float:
    times = []
    for _ in range(runs + 2):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[2:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248320, help="Qwen3.5/3.6's vocabulary (Qwen3: 151936)")
    ap.add_argument("--rows", default="1,4", help="sequences sampled per step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args(argv)
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        logits = logits_like_a_model(rows, args.vocab, args.device)
        histories = [list(range(100 * i, 100 * i + 64)) for i in range(rows)]
        for name, params in SETTINGS.items():
            samplers = [Sampler(params) for _ in range(rows)]
            ref = median_ms(lambda: reference_step(samplers, logits, histories), args.runs, args.device)
            fast = median_ms(lambda: sample_rows(samplers, logits, histories), args.runs, args.device)
            table.append([rows, name, f"{ref:.2f}", f"{fast:.2f}", f"{ref / fast:.1f}x"])
    print(f"vocabulary {args.vocab:,}, device {args.device}, {torch.get_num_threads()} threads, "
          f"median of {args.runs} steps\n")
    print(markdown_table(["rows", "settings", "reference ms/step", "batched ms/step", "speed-up"], table,
                         ["r", "l", "r", "r", "r"]))


if __name__ == "__main__":
    main()
