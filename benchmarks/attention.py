"""Decode attention over a filled cache, every K/V pair beside f16 SDPA, in one run.

    python benchmarks/attention.py [-d 1024,8192,32768] [-ctk/-ctv pairs] [-r 7]
    python benchmarks/attention.py --device cuda -d 32768,131072 -b 1,8   # gpu_decode.py's table, each
        # pair as a decode step launches it on the bf16 backend (the device's tuned file, else the default)

One attention layer shaped like Qwen3.6-35B-A3B's (16 query heads, 2 KV heads,
head_dim 256) by default. For each depth: time per decoded token (median of
-r runs, interleaved across types so machine noise hits all alike) and the
peak extra resident memory during one attention call (Linux VmHWM after
resetting it; noisy at the MiB level). The baseline is torch's
scaled_dot_product_attention over contiguous f16 K/V, the full-precision cache
a plain implementation would keep.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim import formats  # noqa: E402
from kvslim.cache import KVCache, KVLayerSpec, attend  # noqa: E402
from kvslim.formats.klt import random_calibration  # noqa: E402
from kvslim.bench.memory import PeakRSS  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

DEFAULT_PAIRS = "f16/f16,q8_0/q8_0,q4_0/q4_0,turbo4/turbo4,turbo3/turbo3,q8_0/turbo4,q8_0/turbo3"


def peak_extra_mib(fn) -> float:
    """Peak resident memory above the starting point while ``fn`` runs (Linux only)."""
    with PeakRSS() as peak:
        fn()
    return peak.extra_bytes / 2**20 if peak.extra_bytes >= 0 else float("nan")


def build(pairs, depth, n_kv, head_dim, gen):
    k = torch.randn(depth, n_kv, head_dim, generator=gen)
    v = torch.randn(depth, n_kv, head_dim, generator=gen)
    caches = {}
    for tk, tv in pairs:
        cal = random_calibration(tv, n_kv, head_dim) if formats.get(tv).calibrated else None   # speed only
        cache = KVCache(KVLayerSpec(n_kv, head_dim, tk, tv), ctx=depth, page_size=256, calibration=cal)
        for s in range(0, depth, 4096):
            cache.append(0, k[s:s + 4096], v[s:s + 4096])
        caches[f"{tk}/{tv}"] = cache
    return k.half().transpose(0, 1).contiguous(), v.half().transpose(0, 1).contiguous(), caches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-d", "--depths", default="1024,8192,32768")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma list of K/V pairs TYPE_K/TYPE_V")
    ap.add_argument("--n-heads", type=int, default=16)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("-r", "--repetitions", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cpu",
                    help="cuda[:N]: the GPU table (gpu_decode.py --kernels served: SDPA flash, each pair as a decode step "
                         "launches it, bandwidth)")
    ap.add_argument("-b", "--batches", default="1,8", help="sequences per step (--device cuda only)")
    args = ap.parse_args()
    if args.device != "cpu":                      # the GPU has its own script; same layer, same flags
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_decode
        return gpu_decode.main(["-d", args.depths, "-b", args.batches, "-p", args.pairs, "-r", str(args.repetitions),
                                "--device", args.device, "--kernels", "served", "--no-loop"])
    torch.set_num_threads(args.threads)
    pairs = [tuple(p.split("/")) for p in args.pairs.split(",")]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        kf, vf, caches = build(pairs, depth, args.n_kv_heads, args.head_dim, gen)
        q = torch.randn(1, args.n_heads, args.head_dim, generator=gen)
        qf = q.half().transpose(0, 1).unsqueeze(0)
        runs = {"sdpa f16": lambda: torch.nn.functional.scaled_dot_product_attention(
            qf, kf.unsqueeze(0), vf.unsqueeze(0), enable_gqa=True)}
        runs.update({name: (lambda c=c: attend(c, 0, q)) for name, c in caches.items()})
        times = {name: [] for name in runs}
        for fn in runs.values():
            fn()                                                          # warm-up
        for _ in range(args.repetitions):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["sdpa f16"])
        for name, fn in runs.items():
            kv_mib = (kf.numel() * 4 / 2**20) if name == "sdpa f16" else caches[name].nbytes / 2**20
            med = statistics.median(times[name])
            rows.append([depth, name, f"{kv_mib:.1f}", f"{med * 1e3:.2f}", f"{med / base:.2f}",
                         f"{peak_extra_mib(fn):.1f}"])
        print(f"depth {depth} done", file=sys.stderr)
    print(f"decode attention, 1 token, {args.n_heads} q heads / {args.n_kv_heads} kv heads x {args.head_dim}, "
          f"{args.threads} threads, median of {args.repetitions}; pid {os.getpid()}\n")
    print(markdown_table(["depth", "K/V", "KV MiB", "ms/token", "x sdpa f16", "peak extra MiB"], rows,
                         ["r", "l", "r", "r", "r", "r"]))


if __name__ == "__main__":
    main()
