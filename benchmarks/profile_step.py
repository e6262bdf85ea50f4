"""One decode step of ``-np`` sequences under torch's profiler: how many attention calls,
aten calls and host syncs it makes. Runs against any kvslim tree (``--root``), so the
same command profiles the code before and after a change side by side:

    python benchmarks/profile_step.py --root /path/to/old/kvslim-checkout -np 4 -d 4096
    python benchmarks/profile_step.py -np 4 -d 4096

Printed per K/V pair: attention entry calls per step (model -> cache; one per layer
per step is the goal), aten calls per step, ``aten::_local_scalar_dense`` calls per
step (every ``.item()``/``bool()``/``tolist()`` of a tensor: a host sync on a GPU),
and wall ms per step.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parents[1]


def count_attention_calls(kvslim_root) -> dict:
    """Wrap the model's attention entry point (whichever this tree has) to count its calls."""
    counter = {"calls": 0}
    from kvslim.cache import kv
    from kvslim.models import layers

    def counted(fn):
        def wrapper(*a, **k):
            counter["calls"] += 1
            return fn(*a, **k)
        return wrapper

    if hasattr(kv.KVCache, "forward"):                     # one call per layer per step
        kv.KVCache.forward = counted(kv.KVCache.forward)
    else:                                                  # older trees: one attend per sequence
        layers.attend = counted(layers.attend)
    return counter


def profile_steps(fc, time_tg, n_steps: int) -> dict:
    fc.restore()
    time_tg(fc, 2)                                         # warm-up
    fc.restore()
    t0 = time.perf_counter()
    time_tg(fc, n_steps)
    wall = time.perf_counter() - t0
    fc.restore()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_tg(fc, n_steps)
    calls = {ev.key: ev.count for ev in prof.key_averages()}
    return {"ms_per_step": 1000 * wall / n_steps, "aten_per_step": sum(calls.values()) / n_steps,
            "syncs_per_step": calls.get("aten::_local_scalar_dense", 0) / n_steps,
            "items_per_step": calls.get("aten::item", 0) / n_steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(HERE), help="the kvslim checkout to import (default: this one)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="sequences decoded together")
    p.add_argument("-d", "--depth", type=int, default=4096)
    p.add_argument("--pairs", default="f16/f16,q8_0/q8_0,turbo4/turbo4")
    p.add_argument("-n", "--n-steps", type=int, default=8)
    p.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args(argv)
    sys.path.insert(0, args.root)
    torch.set_num_threads(args.threads)
    from kvslim.bench.runner import FilledCache, time_tg
    from kvslim.loading import default_model, load_model

    counter = count_attention_calls(args.root)
    model, _, _ = load_model(default_model())
    n_attn = sum(1 for t in model.config.cache_layout("f16", "f16") if type(t).__name__ == "KVLayerSpec")
    print(f"# {args.root}: -np {args.parallel} @ d{args.depth}, {args.n_steps} steps, {args.threads} threads, "
          f"{n_attn} attention layers\n")
    print("| K/V | attention calls/step | aten calls/step | _local_scalar_dense/step | ms/step |")
    print("|---|--:|--:|--:|--:|")
    for pair in args.pairs.split(","):
        type_k, type_v = pair.split("/")
        fc = FilledCache(model, args.depth + 4 * args.n_steps + 8, args.parallel, type_k, type_v, 512)
        fc.grow_to(args.depth)
        counter["calls"] = 0
        r = profile_steps(fc, time_tg, args.n_steps)
        attn = counter["calls"] / (2 + 2 * args.n_steps)    # warm-up + timed + profiled steps
        print(f"| {pair} | {attn:.1f} | {r['aten_per_step']:.0f} | {r['syncs_per_step']:.1f} | "
              f"{r['ms_per_step']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
