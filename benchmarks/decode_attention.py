"""Decode attention on packed pages: the C kernel beside the torch block loop, in one run.

    python benchmarks/decode_attention.py [-d 4096,16384] [--pairs f16/f16,q8_0/q8_0,...] [-r 9] [-t 2]

One attention layer of the bundled model's shape by default (4 query heads, 2 KV heads,
head_dim 128); one sequence decodes one token at the given depth. For each K/V pair the
kvslim decode path (``attention._attend_decode``) runs with the native kernel and with
``KVSLIM_NATIVE=0``'s torch path, interleaved so machine noise hits both alike; torch's
scaled_dot_product_attention over contiguous f16 K/V is the plain baseline. Medians of -r.
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
from kvslim.cache import KVCache, KVLayerSpec, attention  # noqa: E402
from kvslim.native import build  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

DEFAULT_PAIRS = "f16/f16,q8_0/q8_0,q4_0/q4_0,iq4_nl/iq4_nl,turbo4/turbo4,turbo3/turbo3,q8_0/turbo4"


def filled(pair, k, v) -> KVCache:
    depth, n_kv, dim = k.shape
    cache = KVCache(KVLayerSpec(n_kv, dim, *pair), ctx=depth, page_size=256)
    for s in range(0, depth, 4096):
        cache.append(0, k[s:s + 4096], v[s:s + 4096])
    return cache


def native_switch(on: bool) -> None:
    os.environ["KVSLIM_NATIVE"] = "1" if on else "0"
    build.clear()


def timed(fn, native: bool) -> float:
    native_switch(native)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-d", "--depths", default="4096,16384")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma list of K/V pairs TYPE_K/TYPE_V")
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=9)
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        k = torch.randn(depth, args.n_kv_heads, args.head_dim, generator=gen)
        v = torch.randn(depth, args.n_kv_heads, args.head_dim, generator=gen)
        q = torch.randn(1, args.n_heads, args.head_dim, generator=gen)
        kf, vf = (x.half().transpose(0, 1).unsqueeze(0).contiguous() for x in (k, v))
        qf = q.half().transpose(0, 1).unsqueeze(0)
        sdpa = [timed(lambda: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, enable_gqa=True), False)
                for _ in range(args.repetitions)]
        base = statistics.median(sdpa)
        for pair in (tuple(p.split("/")) for p in args.pairs.split(",")):
            cache = filled(pair, k, v)
            fn = lambda: attention._attend_decode(cache, [0], [depth - 1], q, None)  # noqa: E731
            timed(fn, True), timed(fn, False)                                 # warm-up both
            runs = {True: [], False: []}
            for _ in range(args.repetitions):
                for native in (True, False):
                    runs[native].append(timed(fn, native))
            nat, tor = statistics.median(runs[True]), statistics.median(runs[False])
            rows.append([depth, "/".join(pair), f"{cache.nbytes / 2**20:.1f}", f"{tor * 1e3:.2f}",
                         f"{nat * 1e3:.2f}", f"{tor / nat:.1f}x", f"{nat / base:.2f}"])
        print(f"depth {depth} done (sdpa f16 {base * 1e3:.2f} ms)", file=sys.stderr)
    native_switch(True)
    print(f"decode attention, 1 token, {args.n_heads} q heads / {args.n_kv_heads} kv heads x {args.head_dim}, "
          f"{args.threads} threads, median of {args.repetitions}, load {os.getloadavg()[0]:.1f}\n")
    print(markdown_table(["depth", "K/V", "KV MiB", "torch ms", "native ms", "native speedup", "native / sdpa f16"],
                         rows, ["r", "l", "r", "r", "r", "r", "r"]))


if __name__ == "__main__":
    main()
