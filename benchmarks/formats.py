"""KV formats side by side with the PyPI `turboquant` package (when installed).

    python benchmarks/formats.py [--n 20000] [--head-dim 128] [-o md|json]

For every kvslim format and for turboquant 0.2.0's TurboQuantMSE / TurboQuantIP
at 2-4 bits, on the same N(0,1) vectors: the bits actually stored per value
(turboquant keeps one uint8 per index plus an fp32 norm), normalised MSE,
inner-product error and bias, and encode/decode throughput (best of -r runs;
the machine is shared, so read the ratios, not the absolute rates).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim import formats  # noqa: E402
from kvslim.formats.stats import inner_product_errors, measure  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402


def import_turboquant():
    """turboquant.core, or None with the reason. 0.2.0 calls np.trapz, which
    NumPy 2.4 removed; we alias it to np.trapezoid (same integral) so it runs."""
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid
    try:
        from turboquant import core
        return core, None
    except Exception as err:  # missing package or its own import failure
        return None, f"{type(err).__name__}: {err}"


def best_time(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_turboquant(core, bits, prod, x, q, repeats):
    """The same figures for turboquant's own quantizer objects, stored as it stores them."""
    n, d = x.shape
    quant = (core.TurboQuantIP if prod else core.TurboQuantMSE)(d, bits=bits, device="cpu", seed=0)
    stored = quant.quantize(x)
    x_hat = quant.dequantize(*stored)
    stored_bytes = sum(t.numel() * t.element_size() for t in stored)
    nmse = ((x - x_hat).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    rel, bias = inner_product_errors(x, x_hat, q)
    return {"type": f"turboquant-{'ip' if prod else 'mse'}{bits}", "head_dim": d,
            "bits_per_value": 8 * stored_bytes / x.numel(), "nmse": nmse, "ip_rel_err": rel, "ip_bias": bias,
            "encode_vps": n / best_time(lambda: quant.quantize(x), repeats),
            "decode_vps": n / best_time(lambda: quant.dequantize(*stored), repeats)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-o", "--output", choices=["md", "json"], default="md")
    args = ap.parse_args()
    torch.manual_seed(0)
    x, q = torch.randn(args.n, args.head_dim), torch.randn(256, args.head_dim)
    rows = [measure(formats.get(n), x, q, args.repetitions).as_dict()
            for n in ("q8_0", "q4_0", "iq4_nl", "turbo4", "turbo3", "turbo2", "turbo4p", "turbo3p")]
    core, why = import_turboquant()
    if core is not None:
        for bits in (4, 3, 2):
            rows.append(measure_turboquant(core, bits, False, x, q, args.repetitions))
        for bits in (4, 3):
            rows.append(measure_turboquant(core, bits, True, x, q, args.repetitions))
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return
    print(f"head_dim {args.head_dim}, {args.n} vectors N(0,1); best of {args.repetitions} timing runs\n")
    headers = ["type", "stored bits/value", "nmse", "ip rel err", "ip bias", "encode vec/s", "decode vec/s"]
    print(markdown_table(headers, [[r["type"], f"{r['bits_per_value']:.3f}", f"{r['nmse']:.6f}",
                                    f"{r['ip_rel_err']:.5f}", f"{r['ip_bias']:+.5f}",
                                    f"{r['encode_vps']:,.0f}", f"{r['decode_vps']:,.0f}"] for r in rows],
                         ["l"] + ["r"] * 6))
    if core is None:
        print(f"\nturboquant not measured: {why}")


if __name__ == "__main__":
    main()
