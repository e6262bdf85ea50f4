"""Quantized weights on a CUDA GPU: the Triton GEMV/GEMM over GGUF blocks against torch's dense matmul.

    python benchmarks/gpu_weights.py [-t q8_0,q4_k] [-s 4096x4096,14336x4096,4096x14336] [-m 512] [-r 20] [-o md|json]

For each type and W shape (N outputs x K inputs): the decode GEMV at M = 1 and the prefill GEMM
at M = 512 (``kvslim.gpu.quant_matmul``), against torch's matmul of the same matrix dequantized
ahead of time to f16 and bf16 (what a GPU runtime without packed weights would hold, at 2 bytes
a value). x is in the row's dtype; the Triton GEMM's tl.dot takes that dtype too. Median of
``-r`` CUDA-event timings after a warm-up (which compiles). GB/s: the weight bytes each kernel
reads (packed blocks, or 2 bytes a value), for the GEMV; TFLOP/s: 2MNK per second, for the GEMM.
Weights are random blocks with sane fp16 scales (speed does not depend on the values).
Figures, not a test: the parity checks are tests/test_triton_weights.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim import weights  # noqa: E402
from kvslim.gpu import quant_matmul as gpu  # noqa: E402
from kvslim.tables import markdown_table, to_json  # noqa: E402

from gpu_decode import _median_ms  # noqa: E402  (same folder)

DTYPES = {"f16": (torch.float16, "fp16"), "bf16": (torch.bfloat16, "bf16")}   # torch dtype, Triton dot
HEADERS = ["type", "N x K", "M", "dtype", "triton ms", "torch ms", "triton", "torch"]


def random_blocks(name: str, n: int, k: int) -> weights.QuantTensor:
    """(n, k) blocks of ``name`` on the GPU: random bytes, each fp16 scale field set to 0.002-0.02."""
    wtype = weights.get(name)
    blocks = torch.randint(0, 256, (n * k // wtype.block_size, wtype.block_bytes), dtype=torch.uint8, device="cuda")
    at = 0
    for field, size in wtype.fields:
        if field in ("d", "dmin"):
            scale = torch.empty(blocks.shape[0], device="cuda").uniform_(0.002, 0.02).half()
            blocks[:, at:at + size] = scale.view(torch.uint8).reshape(-1, 2)
        at += size
    return weights.QuantTensor(blocks.reshape(n, -1), wtype, k)


def _rows(name: str, n: int, k: int, gemm_rows: int, runs: int) -> list[list]:
    """GEMV (M = 1) and GEMM rows, one per dtype, for one type and shape."""
    w = random_blocks(name, n, k)
    ggml_type, rows = w.wtype.ggml_type, []
    for label, (dtype, dot) in DTYPES.items():
        dense = w.dequantize().to(dtype)                             # (n, k): torch's side, made ahead of time
        for m in (1, gemm_rows):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            if m == 1:
                triton_ms = _median_ms(lambda: gpu.gemv(x, w.data, ggml_type), runs)
            else:
                triton_ms = _median_ms(lambda: gpu.gemm(x, w.data, ggml_type, dot), runs)
            torch_ms = _median_ms(lambda: x @ dense.T, runs)
            rows.append([name, f"{n}x{k}", m, label, f"{triton_ms:.4f}", f"{torch_ms:.4f}",
                         _speed(m, n, k, w.nbytes, triton_ms), _speed(m, n, k, 2 * n * k, torch_ms)])
        del dense
    return rows


def _speed(m: int, n: int, k: int, weight_bytes: int, ms: float) -> str:
    """GB/s of weight bytes for the GEMV, TFLOP/s for the GEMM."""
    if m == 1:
        return f"{weight_bytes / ms / 1e6:.0f} GB/s"
    return f"{2 * m * n * k / ms / 1e9:.1f} TFLOP/s"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-t", "--types", default="q8_0,q4_0,q4_k,q5_k,q6_k")
    parser.add_argument("-s", "--shapes", default="4096x4096,14336x4096,4096x14336", help="N x K of W")
    parser.add_argument("-m", "--gemm-rows", type=int, default=512)
    parser.add_argument("-r", "--runs", type=int, default=20)
    parser.add_argument("-o", "--output", choices=["md", "json"], default="md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not gpu.available():
        print("gpu_weights: needs a CUDA device and triton", file=sys.stderr)
        sys.exit(2)
    rows = [row for name in args.types.split(",") for shape in args.shapes.split(",")
            for row in _rows(name, *map(int, shape.split("x")), args.gemm_rows, args.runs)]
    if args.output == "json":
        print(to_json([dict(zip(HEADERS, row)) for row in rows]))
    else:
        print(markdown_table(HEADERS, rows, ["l", "l", "r", "l", "r", "r", "r", "r"]))


if __name__ == "__main__":
    main()
