"""Prompt speed and logits with the float32 matmuls in bf16x3 and in plain float32, in one process.

    python benchmarks/f32_matmul.py [-m MODEL] [--weights f32,q8_0,q4_0] [-d 0,4096] [-r 7]

``kvslim/models/matmul_precision.py`` runs a prompt forward's float32 matmuls in oneDNN's bf16x3
mode where the CPU has bf16 dot products; ``KVSLIM_F32_MATMUL=ieee`` keeps plain float32. For
each weight type (the bundled model's matrices as loaded, or quantized at load) and depth:
pp512 t/s with an f16 cache, medians of the repetitions after the first, the two modes
interleaved so that machine noise falls on both alike; then, over a 512-token chunk of text,
the largest logit difference and the mean KL divergence of bf16x3's logits from plain float32's.
Figures, not a test: tests/test_matmul_precision.py holds the mode to its switches.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.bench.runner import FilledCache, time_pp  # noqa: E402
from kvslim.loading import default_model, load_model  # noqa: E402
from kvslim.models import Batch  # noqa: E402
from kvslim.models.matmul_precision import native_bf16  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

MODES = ("ieee", "bf16x3")


def logits_in(mode: str, model, ids: list[int]) -> torch.Tensor:
    os.environ["KVSLIM_F32_MATMUL"] = mode
    cache = model.make_cache(len(ids) + 1, 1, "f16", "f16")
    return model(Batch.build([(0, ids, 0)]), cache, all_logits=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--weights", default="f32,q8_0,q4_0", help="f32 (dense) or a block type to quantize to at load")
    ap.add_argument("-d", "--depths", default="0,4096")
    ap.add_argument("-r", "--repetitions", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    if not native_bf16():
        sys.exit("this CPU has no bf16 dot products (avx512_bf16 / amx_bf16): both modes are plain float32")
    torch.set_num_threads(args.threads)
    was = os.environ.get("KVSLIM_F32_MATMUL")
    speed, quality = [], []
    try:
        for weights in args.weights.split(","):
            model, tok, _ = load_model(args.model or default_model(), "f32",
                                       weights=None if weights == "f32" else weights)
            for depth in (int(d) for d in args.depths.split(",")):
                fc = FilledCache(model, depth + 1024, 1, "f16", "f16", 512)
                fc.grow_to(depth)
                runs = {m: [] for m in MODES}
                for rep in range(args.repetitions):
                    for mode in MODES:
                        os.environ["KVSLIM_F32_MATMUL"] = mode
                        fc.restore()
                        seconds = time_pp(fc, 512)
                        if rep:
                            runs[mode].append(512 / seconds)
                med = {m: statistics.median(v) for m, v in runs.items()}
                speed.append([weights, depth, *(f"{med[m]:.0f}" for m in MODES), f"{med['bf16x3'] / med['ieee']:.2f}"])
                print(" | ".join(map(str, speed[-1])), file=sys.stderr, flush=True)
            text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
            ids = tok.encode(text)[:512]
            ref, got = (logits_in(m, model, ids) for m in MODES)
            kld = (ref.log_softmax(-1).exp() * (ref.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
            same = (ref.argmax(-1) == got.argmax(-1)).float().mean()
            quality.append([weights, f"{(ref - got).abs().max():.2e}", f"{kld.mean():.1e}", f"{100 * same:.2f}%"])
    finally:
        if was is None:
            os.environ.pop("KVSLIM_F32_MATMUL", None)
        else:
            os.environ["KVSLIM_F32_MATMUL"] = was
    print(markdown_table(["weights", "depth", "pp512 ieee", "pp512 bf16x3", "ratio"], speed))
    print()
    print(markdown_table(["weights", "max logit diff", "mean KLD", "same top-1"], quality))
    return 0


if __name__ == "__main__":
    sys.exit(main())
