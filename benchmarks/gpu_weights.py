"""Quantized weights on a CUDA GPU: the Triton GEMV/GEMM over GGUF blocks against torch's dense matmul.

    python benchmarks/gpu_weights.py [-t q8_0,q4_k] [-s 4096x4096,14336x4096,4096x14336] [-m 512] [-r 20] [-o md|json]
        [--experts 256x2048x512x8] [--expert-tokens 1,16,512] [--device cuda]

For each type and W shape (N outputs x K inputs): the decode GEMV at M = 1 and the prefill GEMM
at M = 512 (``kvslim.gpu.quant_matmul``), against torch's matmul of the same matrix dequantized
ahead of time to f16 and bf16 (what a GPU runtime without packed weights would hold, at 2 bytes
a value). x is in the row's dtype; the Triton GEMM's tl.dot takes that dtype too. Median of
``-r`` CUDA-event timings after a warm-up (which compiles). At M = 1 every time is a CUDA
graph's replay (``gpu_timing.device_ms``: the GPU's own time, as the engine's decode steps run;
"eager ms" is the Triton GEMV launched from Python, host included, as session 41 timed all of
them: 0.07-0.13 ms whatever the shape, the host's launch and not the kernel); the GEMM's, a
prompt's, are eager, as the engine runs prompts. "per-value ms": the GEMV with every
value read on its own (``blockwise=False``), the path Q8_0, Q4_0 and Q6_K took before
session 31. "session 32 ms": the GEMV as it was before session 33, each chunk's products summed
across the tile (``terms=False``) and K split for 264 programs, not GEMV_PROGRAMS. "8-bit x
ms": Q4_0's, Q4_K's and Q6_K's GEMV on x rounded to 8 bits, products by dp4a (``q8=True``;
session 39). GB/s: the
weight bytes each kernel reads (packed blocks, or 2 bytes a value), for the GEMV; TFLOP/s:
2MNK per second, for the GEMM.
Weights are random blocks with sane fp16 scales (speed does not depend on the values).
Figures, not a test: the parity checks are tests/test_triton_weights.py.

Then one mixture layer's routed experts (``--experts`` E x hidden x intermediate x top-k; default
Qwen3.6-35B-A3B's) in each type, a batch of ``--expert-tokens`` tokens routed at random:
``QuantExperts.grouped`` (the expert GEMV for up to 128 pairs, else the pairs sorted on the
device and one grouped GEMM) against ``QuantExperts.loop`` (the host learns the chosen experts,
then one GEMV/GEMM pair per expert), both on the same packed blocks and eager (the loop cannot
be captured: the host reads the ids). "grouped graph ms": the GEMV's pairs (a decode step's)
replayed from a CUDA graph, as a decode step runs them.

Dry run on the CPU (a test runs it): ``TRITON_INTERPRET=1 python benchmarks/gpu_weights.py
--device cpu -t q4_0 -s 64x64 -m 32 -r 1 --experts 8x64x32x2 --expert-tokens 1,80`` (bf16 tl.dot
is wrong under the interpreter: the figures of a dry run mean nothing, the code paths run).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim import gpu as kvslim_gpu  # noqa: E402
from kvslim import weights  # noqa: E402
from kvslim.gpu import quant_matmul as gpu  # noqa: E402
from kvslim.tables import markdown_table, to_json  # noqa: E402

from gpu_timing import check_device, device_ms, median_ms, progress, step_ms  # noqa: E402  (same folder)

DTYPES = {"f16": (torch.float16, "fp16"), "bf16": (torch.bfloat16, "bf16")}   # torch dtype, Triton dot
HEADERS = ["type", "N x K", "M", "dtype", "triton ms", "per-value ms", "session 32 ms", "8-bit x ms", "torch ms", "triton",
           "torch", "eager ms"]
SESSION_32_PROGRAMS = 264       # the GEMV's program target until session 33 (quant_matmul.GEMV_PROGRAMS)


def random_blocks(name: str, n: int, k: int, device: str) -> weights.QuantTensor:
    """(n, k) blocks of ``name`` on ``device``: random bytes, each fp16 scale field set to 0.002-0.02."""
    wtype = weights.get(name)
    blocks = torch.randint(0, 256, (n * k // wtype.block_size, wtype.block_bytes), dtype=torch.uint8, device=device)
    at = 0
    for field, size in wtype.fields:
        if field in ("d", "dmin"):
            scale = torch.empty(blocks.shape[0], device=device).uniform_(0.002, 0.02).half()
            blocks[:, at:at + size] = scale.view(torch.uint8).reshape(-1, 2)
        at += size
    return weights.QuantTensor(blocks.reshape(n, -1), wtype, k)


def _rows(name: str, n: int, k: int, gemm_rows: int, runs: int, device: str, dtypes: list[str]) -> list[list]:
    """GEMV (M = 1) and GEMM rows, one per dtype, for one type and shape."""
    w = random_blocks(name, n, k, device)
    ggml_type, rows = w.wtype.ggml_type, []
    for label in dtypes:
        dtype, dot = DTYPES[label]
        dense = w.dequantize().to(dtype)                             # (n, k): torch's side, made ahead of time
        for m in (1, gemm_rows):
            x = torch.randn(m, k, device=device, dtype=dtype)
            # decode's GEMV as a decode step runs it (a graph's replay), a prompt's GEMM eagerly
            timed = (lambda fn: device_ms(fn, runs, device)) if m == 1 else (lambda fn: median_ms(fn, runs, device))
            per_value = before = q8 = eager = ""
            if m == 1:
                eager, triton_ms = step_ms(lambda: gpu.gemv(x, w.data, ggml_type), runs, device)
                eager = f"{eager:.4f}"
                if ggml_type in gpu.BLOCKWISE:                       # the others have one path
                    per_value = f"{timed(lambda: gpu.gemv(x, w.data, ggml_type, blockwise=False)):.4f}"
                splits = gpu.split_count(k, n, gpu.gemv_config(1), SESSION_32_PROGRAMS)
                before = f"{timed(lambda: gpu.gemv(x, w.data, ggml_type, splits, terms=False)):.4f}"
                if gpu.q8_config({}, ggml_type, 1, True):
                    q8 = f"{timed(lambda: gpu.gemv(x, w.data, ggml_type, q8=True)):.4f}"
            else:
                triton_ms = timed(lambda: gpu.gemm(x, w.data, ggml_type, dot))
            torch_ms = timed(lambda: x @ dense.T)
            rows.append([name, f"{n}x{k}", m, label, f"{triton_ms:.4f}", per_value, before, q8, f"{torch_ms:.4f}",
                         _speed(m, n, k, w.nbytes, triton_ms), _speed(m, n, k, 2 * n * k, torch_ms), eager])
        dense = None                                             # freed before the next dtype's copy
    return rows


def _interprets_bf16() -> bool:
    """Whether Triton's interpreter takes bf16 (3.9's does; 3.6's, the device image's, has no bf16 type)."""
    from triton.runtime.interpreter import InterpreterBuilder
    return hasattr(InterpreterBuilder, "get_bf16")


EXPERT_HEADERS = ["type", "E x H x I, top-k", "tokens", "grouped ms", "loop ms", "grouped speed-up",
                  "grouped graph ms"]


def _expert_rows(name: str, shape: str, tokens: list[int], runs: int, device: str,
                 dtype: torch.dtype = torch.bfloat16) -> list[list]:
    """Grouped vs loop for one type: a QuantExperts of random blocks, bf16 activations (f16 where
    --dtypes leaves bf16 out)."""
    from kvslim.weights.modules import QuantExperts
    n_experts, hidden, inter, top_k = map(int, shape.split("x"))
    gate_up = random_blocks(name, n_experts * 2 * inter, hidden, device)
    down = random_blocks(name, n_experts * hidden, inter, device)
    module = QuantExperts(weights.QuantTensor(gate_up.data.view(n_experts, 2 * inter, -1), gate_up.wtype, hidden),
                          weights.QuantTensor(down.data.view(n_experts, hidden, -1), down.wtype, inter))
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden, device=device, dtype=dtype)
        probs = torch.rand(n, n_experts, device=device).softmax(-1)
        w, experts = probs.topk(top_k, dim=-1)
        grouped_ms = median_ms(lambda: module.grouped(x, w, experts), runs, device)
        loop_ms = median_ms(lambda: module.loop(x, w, experts), runs, device)
        graphed = ""                            # a decode step's pairs (the GEMV's): the graph's time, as it runs
        if experts.numel() <= gpu.MAX_GEMV_PAIRS:
            graphed = f"{device_ms(lambda: module.grouped(x, w, experts), runs, device):.3f}"
        rows.append([name, shape, n, f"{grouped_ms:.3f}", f"{loop_ms:.3f}", f"{loop_ms / grouped_ms:.2f}x", graphed])
    return rows


def _speed(m: int, n: int, k: int, weight_bytes: int, ms: float) -> str:
    """GB/s of weight bytes for the GEMV, TFLOP/s for the GEMM."""
    if m == 1:
        return f"{weight_bytes / ms / 1e6:.0f} GB/s"
    return f"{2 * m * n * k / ms / 1e9:.1f} TFLOP/s"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-t", "--types", default="q8_0,q4_0,q4_k,q5_k,q6_k,iq3_xxs,iq2_xxs")
    parser.add_argument("-s", "--shapes", default="4096x4096,14336x4096,4096x14336", help="N x K of W")
    parser.add_argument("-m", "--gemm-rows", type=int, default=512)
    parser.add_argument("-r", "--runs", type=int, default=20)
    parser.add_argument("-o", "--output", choices=["md", "json"], default="md")
    parser.add_argument("--experts", default="256x2048x512x8", help="E x hidden x intermediate x top-k; '' skips")
    parser.add_argument("--expert-tokens", default="1,16,512")
    parser.add_argument("--dtypes", default="f16,bf16", help="the activations' types: f16, bf16")
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only with TRITON_INTERPRET=1 (a dry run)")
    args = parser.parse_args(argv)
    check_device(args.device)
    dtypes = args.dtypes.split(",")
    if any(d not in DTYPES for d in dtypes):
        sys.exit(f"--dtypes {args.dtypes}: expected some of {', '.join(DTYPES)}")
    if args.device == "cpu" and "bf16" in dtypes and not _interprets_bf16():
        print("dry run: this Triton's interpreter has no bf16 (3.6's): f16 rows only", file=sys.stderr)
        dtypes.remove("bf16")
    kvslim_gpu.TRITON = True                       # the loop's per-expert products take the kernels too
    rows = [progress(row) for name in args.types.split(",") for shape in args.shapes.split(",")
            for row in _rows(name, *map(int, shape.split("x")), args.gemm_rows, args.runs, args.device, dtypes)]
    tokens = [int(n) for n in args.expert_tokens.split(",")]
    experts = [progress(row) for name in args.types.split(",") if args.experts
               for row in _expert_rows(name, args.experts, tokens, args.runs, args.device,
                                       DTYPES["bf16" if "bf16" in dtypes else dtypes[0]][0])]
    if args.output == "json":
        print(to_json({"weights": [dict(zip(HEADERS, row)) for row in rows],
                       "experts": [dict(zip(EXPERT_HEADERS, row)) for row in experts]}))
    else:
        print(markdown_table(HEADERS, rows, ["l", "l", "r", "l"] + ["r"] * 8))
        if experts:
            print()
            print(markdown_table(EXPERT_HEADERS, experts, ["l", "l"] + ["r"] * 5))


if __name__ == "__main__":
    main()
