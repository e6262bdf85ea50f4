"""8-bit activations in decode's GEMV (the K-quants' default; ``KVSLIM_Q8_ACTIVATIONS=0`` turns
them off): what they gain in speed and what they change in the model's predictions.

    python benchmarks/q8_activations.py [--gguf FILE | --types q4_k,q8_0,q4_0] [-n 512] [--runs 31] [--skip-gemv]

1. GEMV: one activation row and four, per type, float and 8-bit activations alternated in one
   process (medians; the machine is shared, so read the ratio).
2. Predictions: a GGUF (default: the bundled model as Q4_K_M through llama.cpp's quantizer, which
   needs the peer, as Q8_0 and as Q4_0) reads N tokens of the held-out Austen text one decode step at a time, once
   with float activations and once with 8-bit ones, each with its own cache; per position the
   KL divergence between the two next-token distributions, whether their top-1 agree, and each
   run's perplexity. The prompt's positions (the first one) go through prefill's float GEMM in
   both, so every scored position after it is a decode step.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvslim import weights as W  # noqa: E402
from kvslim.weights.activations import TYPES  # noqa: E402
from kvslim.loading import default_model, load_model  # noqa: E402
from kvslim.models import Batch  # noqa: E402
from kvslim.native import block_linear  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

SHAPES = [(2048, 2048), (8192, 4096)]
TEXT = Path(__file__).resolve().parents[1] / "kvslim" / "data" / "text" / "austen-heldout.txt"


def median_us(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def gemv_rows(runs: int) -> list[list]:
    from test_weights import random_matrix
    rows = []
    for name in [t for t in TYPES if block_linear.q8_activations(t)]:
        for n, k in SHAPES:
            w = random_matrix(W.get(name), n, k, seed=1).data
            for m in (1, 4):
                x = torch.randn(m, k)
                times = {False: [], True: []}
                for _ in range(runs):                      # alternated, so that both see the same load
                    for q8 in times:
                        times[q8].append(median_us(lambda: block_linear.block_linear(x, w, name, q8=q8), 1))
                f, q = (statistics.median(times[q8]) for q8 in (False, True))
                rows.append([name, f"{n}x{k}", m, f"{f:.0f}", f"{q:.0f}", f"{q / f:.2f}",
                             f"{w.numel() / q / 1e3:.1f}"])
    return rows


def bundled_files(types: list[str]) -> list[Path]:
    """The bundled model as a GGUF of each type (``kvslim convert``'s names: q4_k is llama-quantize's
    Q4_K_M mix, which needs the peer)."""
    from kvslim.tools.convert import convert
    out = Path(tempfile.mkdtemp())
    return [convert(default_model(), out / f"bundled-{t}.gguf", t) for t in types]


def step_logits(model, ids: list[int], q8: str) -> torch.Tensor:
    """Next-token log-probabilities after each of ids[1:] fed one decode step at a time (the first
    token is the prompt) with KVSLIM_Q8_ACTIVATIONS=q8 -> (len(ids) - 1, V)."""
    os.environ["KVSLIM_Q8_ACTIVATIONS"] = q8
    cache = model.make_cache(len(ids) + 1, 1, "f16", "f16")
    out = []
    with torch.inference_mode():
        model(Batch.build([(0, ids[:1], 0)]), cache)
        for pos in range(1, len(ids)):
            out.append(model(Batch.build([(0, ids[pos:pos + 1], pos)]), cache).float().log_softmax(-1))
    return torch.cat(out)


def prediction_rows(gguf: Path, n: int) -> list[list]:
    model, tokenizer, _ = load_model(gguf, "f32")
    ids = tokenizer.encode(TEXT.read_text())[:n + 1]
    floats, q8 = step_logits(model, ids, "0"), step_logits(model, ids, "1")
    targets = torch.tensor(ids[2:])
    kl = (floats.exp() * (floats - q8)).sum(-1)[:-1]
    nll = {k: -v[:-1].gather(1, targets.unsqueeze(1)).mean().item() for k, v in (("float", floats), ("q8", q8))}
    same = (floats.argmax(-1) == q8.argmax(-1)).float().mean().item()
    return [[gguf.name, len(ids) - 2, f"{kl.mean():.2e}", f"{kl.max():.2e}", f"{100 * same:.1f}%",
             f"{math.exp(nll['float']):.3f}", f"{math.exp(nll['q8']):.3f}"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="a GGUF to read the text with (default: the bundled model as each --types)")
    ap.add_argument("--types", default="q4_k,q8_0,q4_0", help="the bundled model's files (q4_k: llama.cpp's Q4_K_M)")
    ap.add_argument("-n", type=int, default=512, help="tokens of text read one decode step at a time")
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--skip-gemv", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if not block_linear.q8_activations("q4_k"):
        sys.exit("this build multiplies float activations (no C compiler, or no AVX2)")
    if not args.skip_gemv:
        print(f"GEMV, {torch.get_num_threads()} threads, {block_linear.build.default_variant()} build, "
              f"medians of {args.runs}:\n")
        print(markdown_table(["type", "n x k", "rows", "float us", "8-bit us", "8-bit/float", "GB/s (8-bit)"],
                             gemv_rows(args.runs)))
    print(f"\nDecode predictions, {args.n} tokens of {TEXT.name}, float vs 8-bit activations:\n")
    print(markdown_table(["file", "positions", "mean KL", "max KL", "same top-1", "ppl float", "ppl 8-bit"],
                         [row for f in ([Path(args.gguf)] if args.gguf else bundled_files(args.types.split(",")))
                          for row in prediction_rows(f, args.n)]))


if __name__ == "__main__":
    main()
