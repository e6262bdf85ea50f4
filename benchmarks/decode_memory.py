"""Peak extra memory of one decode step at several depths: is it independent of depth?

    python benchmarks/decode_memory.py [--root CHECKOUT] [-d 4096,16384,32768] [--pairs f16/f16,turbo4/turbo4]

For each K/V pair and depth the bundled model's cache is filled, two decode steps
warm up, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``, Linux),
and one decode step runs: its peak extra memory is the new high-water mark minus
the resident size before the step (the cache itself is already resident, so this
is the step's workspace). The script re-runs itself with glibc's mmap threshold at
64 KiB, so every large temporary is mapped when made and unmapped when freed and
the high-water mark sees it, instead of reused heap that is already resident.
``--root`` imports another checkout, so the code before and after a change are
measured by the same script.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_peak_kib(fc, time_tg) -> int:
    fc.restore()
    time_tg(fc, 2)                                           # warm-up: workspaces, lookup tables
    fc.restore()
    Path("/proc/self/clear_refs").write_text("5")           # reset VmHWM to the current RSS
    before = status_kib("VmRSS")
    time_tg(fc, 1)
    return status_kib("VmHWM") - before


def main(argv=None) -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"       # glibc reads it at start: re-exec
        os.execv(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(HERE), help="the kvslim checkout to import (default: this one)")
    p.add_argument("-d", "--depths", default="4096,16384,32768")
    p.add_argument("--pairs", default="f16/f16,q8_0/q8_0,turbo4/turbo4")
    p.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args(argv)
    sys.path.insert(0, args.root)
    torch.set_num_threads(args.threads)
    from kvslim.bench.runner import FilledCache, time_tg
    from kvslim.loading import default_model, load_model

    model, _, _ = load_model(default_model())
    depths = [int(d) for d in args.depths.split(",")]
    print(f"# peak extra RSS of one decode step (KiB), {args.root}\n")
    print("| K/V | " + " | ".join(f"d{d}" for d in depths) + " |")
    print("|---|" + "--:|" * len(depths))
    for pair in args.pairs.split(","):
        type_k, type_v = pair.split("/")
        fc = FilledCache(model, max(depths) + 16, 1, type_k, type_v, 512)
        row = []
        for depth in depths:
            fc.grow_to(depth)
            row.append(step_peak_kib(fc, time_tg))
        print(f"| {pair} | " + " | ".join(str(v) for v in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
