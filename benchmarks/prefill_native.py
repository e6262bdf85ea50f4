"""Prompt speed with the CPU's C prompt pieces off and on, in turn, in one process.

    python benchmarks/prefill_native.py [-m MODEL] [--pairs f16,q8_0,turbo4] [-d 0,4096] [-r 7]

The pieces: the DeltaNet layers' prompt recurrence (``kvslim/native/delta_rule.c``, else torch's
chunked form) and the rotated formats' Walsh-Hadamard butterfly (``kv_encode.c``'s loop, else
the torch butterfly). For each K=V type and depth: pp512 t/s, medians of the repetitions after
the first, for torch alone, the C recurrence alone and both, interleaved so that machine noise
falls on all three alike.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.bench.runner import FilledCache, time_pp  # noqa: E402
from kvslim.loading import default_model, load_model  # noqa: E402
from kvslim.native import delta_rule, kv_encode  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

MODES = {"torch": (False, False), "C recurrence": (True, False), "C both": (True, True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--pairs", default="f16,q8_0,turbo4", help="K=V cache types")
    ap.add_argument("-d", "--depths", default="0,4096")
    ap.add_argument("-r", "--repetitions", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_model(args.model or default_model())
    real = delta_rule.available, kv_encode.available
    off = lambda: False  # noqa: E731
    rows = []
    try:
        for t in args.pairs.split(","):
            for depth in (int(d) for d in args.depths.split(",")):
                fc = FilledCache(model, depth + 1024, 1, t, t, 512)
                fc.grow_to(depth)
                runs = {m: [] for m in MODES}
                for rep in range(args.repetitions):
                    for mode, (c_rule, c_rot) in MODES.items():
                        delta_rule.available = real[0] if c_rule else off
                        kv_encode.available = real[1] if c_rot else off
                        fc.restore()
                        seconds = time_pp(fc, 512)
                        if rep:
                            runs[mode].append(512 / seconds)
                med = {m: statistics.median(v) for m, v in runs.items()}
                rows.append([f"{t}/{t}", depth, *(f"{med[m]:.0f}" for m in MODES), f"{med['C both'] / med['torch']:.2f}"])
                print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    finally:
        delta_rule.available, kv_encode.available = real
    print(markdown_table(["K/V", "depth", *(f"pp512 {m}" for m in MODES), "both / torch"], rows,
                         ["l", "r", "r", "r", "r", "r"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
