"""Where a decode step's time goes: torch's profiler over kvslim's tg at depth.

    python benchmarks/profile_decode.py [-m MODEL] [-d 0,4096] [--pairs f16/f16,q8_0/q8_0] [-n 32]

For each K/V pair and depth the cache is filled with real prefill, then ``-n``
decode steps run under ``torch.profiler``.  Printed per case: wall ms/token,
aten operator calls per token (nested calls counted), the share of wall time
spent inside operators (the rest is Python and dispatch between them), and
the operators that took the most self time.  This is the profile behind
the decode ratios of ``benchmarks/vs_llama_cpp.py`` before the native step: on a small model a
torch decode step is many short operator calls, and a quantized cache adds its decode to every
step. It profiles the torch step (``native=False``); the native step is one C call per token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.bench import FilledCache  # noqa: E402
from kvslim.bench.runner import time_tg  # noqa: E402
from kvslim.loading import default_model, load_model  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402
from kvslim.tools.bench import int_list  # noqa: E402


def profile_case(fc: FilledCache, n: int, top: int) -> dict:
    fc.restore()
    time_tg(fc, 4)                                        # warm-up outside the profile
    fc.restore()
    wall_plain = time_tg(fc, n)
    fc.restore()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall_profiled = time_tg(fc, n)
    # Self time excludes nested calls (an aten::linear's excludes its addmm),
    # so the sum over all operators counts every microsecond once.
    self_us = {ev.key: ev.self_cpu_time_total for ev in prof.key_averages()}
    calls = {ev.key: ev.count for ev in prof.key_averages()}
    op_us = sum(self_us.values())
    top_ops = sorted(self_us.items(), key=lambda kv: -kv[1])[:top]
    return {
        "ms_per_token": 1000 * wall_plain / n,
        # The profiler slows every call, so operator time is compared with the
        # profiled run's own wall time, not the plain one.
        "op_share": op_us / 1e6 / max(wall_profiled, 1e-9),
        "calls_per_token": sum(calls.values()) / n,
        "top": [(name, us / 1000 / n, calls[name] / n) for name, us in top_ops],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="model path (default: the bundled model)")
    p.add_argument("-d", "--depths", default="0,4096", help="depths to fill before decoding")
    p.add_argument("--pairs", default="f16/f16,q8_0/q8_0,q4_0/q4_0,turbo4/turbo4")
    p.add_argument("-n", "--n-gen", type=int, default=32, help="profiled decode steps")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=8, help="operators listed per case")
    p.add_argument("--dtype", default=None, help="weights dtype: f32, bf16, f16 (default: as stored)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _, _ = load_model(args.model or default_model(), args.dtype)
    depths = int_list(args.depths)
    dtype = next(model.parameters()).dtype
    print(f"# decode profile: {args.n_gen} steps, {args.threads} threads, weights {dtype}, "
          f"torch {torch.__version__}\n")
    summary = []
    for pair in args.pairs.split(","):
        type_k, type_v = pair.split("/")
        fc = FilledCache(model, max(depths) + args.n_gen + 16, 1, type_k, type_v, 512, native=False)
        for depth in depths:
            fc.grow_to(depth)
            r = profile_case(fc, args.n_gen, args.top)
            summary.append((pair, depth, r))
            print(f"## {pair} @ d{depth}: {r['ms_per_token']:.2f} ms/token, "
                  f"{r['calls_per_token']:.0f} aten calls/token (nested counted), "
                  f"{r['op_share']:.0%} of wall time inside operators\n")
            print(markdown_table(["operator", "self ms/token", "calls/token"],
                                 [[f"`{name}`", f"{ms:.3f}", f"{n_calls:.1f}"] for name, ms, n_calls in r["top"]],
                                 ["l", "r", "r"]) + "\n")
    print(markdown_table(["K/V", "depth", "ms/token", "aten calls/token", "inside operators"],
                         [[pair, depth, f"{r['ms_per_token']:.2f}", f"{r['calls_per_token']:.0f}",
                           f"{r['op_share']:.0%}"] for pair, depth, r in summary],
                         ["l", "r", "r", "r", "r"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
