"""What tf32 products in the DeltaNet prompt kernel do to a float32 model's logits, on the CPU.

    python benchmarks/tf32_delta_rule.py [-n 297]

fla-core's chunked gated-delta-rule kernel takes tf32 products on sm_80 and later GPUs (it sets
no float32 precision for most of its tl.dot, and asks tf32 for its triangular solve). tf32 keeps
10 bits of mantissa, float32 23. Session 41's H200 run found the tiny float32 models' logits,
with the kernels on, up to 0.01 from the CPU's on 8-12% of values, and the bundled model's up to
0.037 on 22.5%. This runs the bundled model (float32) on a prompt of ``-n`` tokens, with its
DeltaNet prompts through kvslim's torch chunked form twice: as it is, and with every matmul's
and triangular solve's operands rounded to tf32 (round to nearest even, as the tensor cores
take them), and prints the largest logit difference and the share of logits past the CUDA
tests' tolerance (2e-3 + 1e-3 |x|). Session 42: 0.0083 and 0.2% at 297 tokens, well under the
H200's 0.037 and 22.5%; the same rounding on the tiny qwen3_5, qwen3_5_moe and qwen3_next models
(a throwaway run of the CUDA test's prompt) gave 0.006-0.010 on 3-8%, near their H200 figures.
So operand rounding alone explains the tiny models' differences, not the bundled model's:
fla-core's own algorithm in tf32 (its triangular inverse in chained tf32 products) may lose more,
or another kernel adds to it. ``kvslim.gpu.delta_rule.serves`` leaves float32 models to the
torch form either way; a lease's kernels-on CUDA tests tell whether that was all. A figure, not
a test.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvslim  # noqa: E402
from kvslim.models import qwen3_5  # noqa: E402
from kvslim.models.delta_rule import chunk_gated_delta_rule  # noqa: E402

ROUNDED = {torch.matmul, torch.Tensor.__matmul__, torch.bmm, torch.linalg.solve_triangular}


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 x with its mantissa rounded to 10 bits, to nearest even (inf and NaN kept)."""
    bits = x.contiguous().view(torch.int32)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return torch.where(torch.isfinite(x), rounded.view(torch.float32), x)


class TF32Products(TorchFunctionMode):
    """Float32 operands of matmuls and triangular solves rounded to tf32 first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in ROUNDED:
            args = tuple(tf32(a) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args)
        return func(*args, **(kwargs or {}))


def chunk_in_tf32(*args, **kwargs):
    with TF32Products():
        return chunk_gated_delta_rule(*args, **kwargs)


def logits(llm, ids: list[int], rule) -> torch.Tensor:
    """The model's logits for ``ids`` with its DeltaNet prompts through ``rule``."""
    chosen = qwen3_5.chunk_rule
    qwen3_5.chunk_rule = lambda device, dtype=None: rule
    try:
        llm.engine.cache.clear(0)
        return llm.logits(ids).float()
    finally:
        qwen3_5.chunk_rule = chosen


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--tokens", type=int, default=297, help="prompt length (the CUDA test's: 297)")
    args = ap.parse_args(argv)
    llm = kvslim.load(ctx=max(512, args.tokens + 8), dtype="f32", device="cpu")
    ids = list(range(3, 3 + args.tokens))
    want = logits(llm, ids, chunk_gated_delta_rule)
    got = logits(llm, ids, chunk_in_tf32)
    diff = (got - want).abs()
    past = (diff > 2e-3 + 1e-3 * want.abs()).float().mean().item()
    print(f"bundled model, f32, {args.tokens}-token prompt: DeltaNet prompts with tf32 products against float32 ones")
    print(f"largest logit difference {diff.max().item():.4f}; {100 * past:.1f}% of logits past 2e-3 + 1e-3 |x|")


if __name__ == "__main__":
    main()
