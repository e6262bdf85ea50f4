"""What an importance matrix buys llama.cpp's low-bit mixes: KLD, top-1 and perplexity against
the f32 model, for each mix made with three matrices:

- measured: ``kvslim imatrix``'s, on the held-out classics and Bible text;
- ones: no preference among columns;
- shuffled: the measured values with each tensor's columns permuted (right values, wrong
  columns: the control that shows the order is what matters).

Scored on chunks of the held-out Austen text (never in the calibration text). Needs the peer
(llama.cpp's quantizer). Prints a markdown table.

    python benchmarks/imatrix_quality.py --mixes iq1_m,iq2_xxs,iq2_m,iq3_xxs,q2_k
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvslim import peer  # noqa: E402
from kvslim.data import HELDOUT_TEXT  # noqa: E402
from kvslim.loading import convert_hf_to_gguf, default_model, load_model, measure_importance  # noqa: E402
from kvslim.models import Batch  # noqa: E402
from kvslim.tools.imatrix import calibration_text  # noqa: E402


def chunk_logits(path: Path, n_chunks: int, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(all positions' logits, next-token targets) over the first chunks of the Austen text."""
    model, tokenizer, _ = load_model(path, "f32")
    ids = tokenizer.encode(HELDOUT_TEXT.read_text(encoding="utf-8"), add_special=False)
    logits, targets = [], []
    with torch.inference_mode():
        for i in range(n_chunks):
            chunk = ids[i * n_ctx:(i + 1) * n_ctx]
            cache = model.make_cache(n_ctx, 1, "f16", "f16")
            logits.append(model(Batch.build([(0, chunk, 0)]), cache, all_logits=True).float()[:-1])
            targets.append(torch.tensor(chunk[1:]))
    return torch.cat(logits), torch.cat(targets)


def scores(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """(mean KLD(ref || got), top-1 agreement, perplexity of got)."""
    ref_lp, lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kld = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    ppl = (-lp.gather(1, targets[:, None]).mean()).exp()
    return float(kld), float(top1), float(ppl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="Hugging Face folder (default: the bundled model)")
    ap.add_argument("--mixes", default="iq1_m,iq2_xxs,iq2_m,iq3_xxs,q2_k", help="llama.cpp file types")
    ap.add_argument("--chunks", type=int, default=8, help="Austen chunks scored")
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("--calibration-chunks", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    folder = Path(args.model) if args.model else default_model()
    tmp = Path(tempfile.mkdtemp())
    source = convert_hf_to_gguf(folder, tmp / "f32.gguf", "f32")
    text, name = calibration_text(None)
    entries, ran = measure_importance(folder, text, args.ctx_size, args.calibration_chunks)
    print(f"importance measured on {ran} chunks of {args.ctx_size} tokens of {name}")
    rng = np.random.default_rng(0)
    matrices = {"measured": {k: e.means() for k, e in entries.items()},
                "ones": {k: np.ones_like(e.means()) for k, e in entries.items()},
                "shuffled": {k: rng.permutation(e.means()) for k, e in entries.items()}}
    ref, targets = chunk_logits(source, args.chunks, args.ctx_size)
    print(f"f32: ppl {scores(ref, ref, targets)[2]:.2f} on {args.chunks} chunks of {args.ctx_size} Austen tokens\n")
    print("| mix | matrix | mean KLD | top-1 | ppl | MiB |\n|---|---|--:|--:|--:|--:|")
    for mix in args.mixes.split(","):
        for label, matrix in matrices.items():
            out = peer.quantize(source, tmp / f"{mix}-{label}.gguf", mix, 2, matrix)
            kld, top1, ppl = scores(ref, chunk_logits(out, args.chunks, args.ctx_size)[0], targets)
            print(f"| {mix.upper()} | {label} | {kld:.4f} | {top1:.3f} | {ppl:.2f} | {out.stat().st_size / 2**20:.2f} |")


if __name__ == "__main__":
    main()
