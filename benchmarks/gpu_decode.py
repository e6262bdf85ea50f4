"""Decode attention on a CUDA GPU: the Triton kernel beside the torch block loop it replaces.

    python benchmarks/gpu_decode.py [-d 4096,32768] [-b 1,8] [-ctk/-ctv pairs] [-r 20]

One attention layer shaped like Qwen3.6-35B-A3B's (2 KV heads, 8 query heads each, head_dim
256), pages of 16 keys handed out shuffled, every sequence at the same depth. Prints the
median time of one call (CUDA events, after a warm-up that compiles the kernel) for the torch
block loop (``attention._scan_decode`` without the C kernel) and ``kvslim.gpu.paged_decode``,
and the kernel's speed in GB/s of packed K/V read. Figures, not a test: the parity checks are
tests/test_triton_attention.py.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvslim.gpu  # noqa: E402
from kvslim import formats  # noqa: E402
from kvslim.cache import attention  # noqa: E402
from kvslim.gpu import paged_decode as gpu  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

N_KV, GROUP, HEAD_DIM, PAGE = 2, 8, 256, 16


def _inputs(name_k: str, name_v: str, depth: int, batch: int):
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    per_seq = -(-depth // PAGE)
    pages = batch * per_seq + 1

    def pool(fmt):                                                   # encoded on the GPU, page by page
        rows = torch.randn(N_KV * pages * PAGE, HEAD_DIM, device="cuda")
        return fmt.encode(rows).reshape(N_KV, pages, PAGE, -1).contiguous()
    table = (torch.randperm(pages - 1, device="cuda")[:batch * per_seq] + 1).reshape(batch, per_seq).int()
    q = fmt_k.to_code_domain(torch.randn(N_KV, batch, GROUP, HEAD_DIM, device="cuda") * HEAD_DIM ** -0.5)
    n_keys = torch.full((batch,), depth, device="cuda")
    return fmt_k, fmt_v, q, pool(fmt_k), pool(fmt_v), table, n_keys


def _median_ms(fn, runs: int) -> float:
    fn()                                                             # compile, warm the caches
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _row(pair: str, depth: int, batch: int, runs: int) -> list:
    name_k, name_v = pair.split("/")
    args = _inputs(name_k, name_v, depth, batch)
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = args
    # the C kernel never takes CUDA tensors, and with TRITON off _scan_decode runs the torch block loop
    was, kvslim.gpu.TRITON = kvslim.gpu.TRITON, False
    try:
        torch_ms = _median_ms(lambda: attention._scan_decode(fmt_k, fmt_v, k_pool, v_pool, table, q, n_keys), runs)
    finally:
        kvslim.gpu.TRITON = was
    triton_ms = _median_ms(lambda: gpu.decode_state(*args), runs)
    read = batch * depth * N_KV * (k_pool.shape[3] + v_pool.shape[3])   # packed bytes of K and V
    return [pair, depth, batch, f"{torch_ms:.3f}", f"{triton_ms:.3f}", f"{read / triton_ms / 1e6:.0f}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-d", "--depths", default="4096,32768")
    parser.add_argument("-b", "--batches", default="1,8")
    parser.add_argument("-p", "--pairs", default="f16/f16,q8_0/q8_0,q4_0/q4_0,iq4_nl/iq4_nl,turbo4/turbo4,q8_0/turbo4")
    parser.add_argument("-r", "--runs", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not kvslim.gpu.available():
        sys.exit("needs a CUDA device and triton")
    rows = [_row(pair, int(d), int(b), args.runs) for pair in args.pairs.split(",")
            for d in args.depths.split(",") for b in args.batches.split(",")]
    print(markdown_table(["K/V", "depth", "batch", "torch ms", "triton ms", "triton GB/s"], rows))


if __name__ == "__main__":
    main()
