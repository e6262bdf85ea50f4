"""Prefill attention on a CUDA GPU: the Triton kernel beside the torch block loop it replaces.

    python benchmarks/gpu_prefill.py [-d 4096,32768] [-n 512] [-p pairs] [-r 10] [--device cuda]

One attention layer shaped like Qwen3.6-35B-A3B's (2 KV heads, 8 query heads each, head_dim
256), one sequence whose last ``-n`` positions are a prompt chunk at depth ``-d`` (each of its
rows sees the history and the chunk up to itself), pages of 16 keys handed out shuffled. Prints
the median time of one call (CUDA events, after a warm-up that compiles the kernel) for the
torch block loop (``attention._scan_pages``) and ``kvslim.gpu.paged_prefill``, and the kernel's
TFLOP/s (4 * rows * keys seen * head_dim). Figures, not a test: the parity checks are
tests/test_triton_prefill.py. Dry run on the CPU (a test runs it):
``TRITON_INTERPRET=1 python benchmarks/gpu_prefill.py --device cpu -d 32 -n 16 -p q8_0/turbo4 -r 1``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.cache import attention  # noqa: E402
from kvslim.gpu import paged_prefill as gpu  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

from gpu_decode import GROUP, HEAD_DIM, N_KV, _inputs  # noqa: E402  (same folder)
from gpu_timing import check_device, median_ms  # noqa: E402


def _row(pair: str, depth: int, chunk: int, runs: int, device: str) -> list:
    name_k, name_v = pair.split("/")
    total = depth + chunk
    fmt_k, fmt_v, _, k_pool, v_pool, table, lengths = _inputs(name_k, name_v, total, 1, device)
    q = fmt_k.to_code_domain(torch.randn(N_KV, 1, GROUP * chunk, HEAD_DIM, device=device) * HEAD_DIM ** -0.5)
    q_pos = torch.arange(depth, total, device=device).repeat(GROUP)[None]        # row g*chunk + t
    per_block = attention._pages_per_block(N_KV, HEAD_DIM, k_pool.shape[2], 1, GROUP * chunk)

    def torch_loop():
        acc = attention._OnlineSoftmax(N_KV, 1, GROUP * chunk, HEAD_DIM, q.device)
        attention._scan_pages(fmt_k, fmt_v, k_pool, v_pool, table, q, q_pos, lengths, acc, per_block, HEAD_DIM,
                              unmasked_end=depth + 1)
    torch_ms = median_ms(torch_loop, runs, device)
    triton_ms = median_ms(lambda: gpu.prefill_state(fmt_k, fmt_v, q, q_pos, k_pool, v_pool, table, lengths), runs,
                           device)
    seen = chunk * depth + chunk * (chunk + 1) // 2                                # keys each row sees, summed
    flops = 4 * N_KV * GROUP * seen * HEAD_DIM
    return [pair, depth, chunk, f"{torch_ms:.2f}", f"{triton_ms:.2f}", f"{torch_ms / triton_ms:.1f}x",
            f"{flops / triton_ms / 1e9:.1f}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-d", "--depths", default="4096,32768")
    parser.add_argument("-n", "--chunk", type=int, default=512)
    parser.add_argument("-p", "--pairs", default="f16/f16,q8_0/q8_0,q4_0/q4_0,turbo4/turbo4,q8_0/turbo4,turbo3/turbo3")
    parser.add_argument("-r", "--runs", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only with TRITON_INTERPRET=1 (a dry run)")
    args = parser.parse_args(argv)
    check_device(args.device)
    rows = [_row(pair, int(d), args.chunk, args.runs, args.device) for pair in args.pairs.split(",")
            for d in args.depths.split(",")]
    print(markdown_table(["K/V", "depth", "chunk", "torch ms", "triton ms", "speedup", "triton TFLOP/s"], rows))


if __name__ == "__main__":
    main()
