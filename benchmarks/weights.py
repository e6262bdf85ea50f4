"""Quantized weights: tokens/s and resident memory per weight type, beside llama.cpp on
the same GGUF files, and the matmul-path comparison behind ``kvslim.weights.matmul``.

    python benchmarks/weights.py [-m MODEL] [--types bf16,q8_0,q4_0,q4_k_m] [-p 512] [-n 128] [-r 3]
    python benchmarks/weights.py --matmul [-m MODEL]
    pip install -e '.[peer]'; python benchmarks/weights.py    # adds llama.cpp (kvslim.peer)

The model (default: the bundled one) is exported with kvslim's writer (f32, bf16, q8_0,
q4_0); q4_k_m is made from the f32 file by llama.cpp's own quantizer when the peer
(kvslim.peer: llama-cpp-py-sync or llama-cpp-python) is available. Every (engine, type)
runs in a fresh process so that its resident memory is
its own: RSS before loading, after loading, and after the pp and tg tests (memory-mapped
weights count once touched), the peak, and the weights' bytes as held. Before timing,
kvslim's greedy tokens at Q8_0 are compared with F16 (the issue asks for 32 equal).

--matmul times the paths one forward's linear layers could take, per layer shape of the
model's Q8_0 / Q4_0 files, at 1 token (decode) and 512 (prefill), median of repeats:
dense f32 (what caching the dequantized matrix would cost in time; it costs the dense
memory), kvslim's blocks-at-a-time path at several step sizes, and torch's packed int4
kernel for Q4_0 (exact: scale d, zero 0; but float32 scales and zeros, 0.75 B/weight).

Figures (2 CPU cores, AVX512; run with -t 1 while another job held the other core, so
spreads between runs are 10-30%; llama-cpp-python 0.3.36, flash attention on):

bundled model (8.4M weights, tied embeddings), -p 512 -n 128 -r 3. "resident" is what
unloading the model gives back after the run, less kvslim's KV cache and DeltaNet state
(llama.cpp's figure keeps its KV and compute buffers):

| engine    | weights | file tensors |  resident | resident/file |  pp512 t/s | tg128 t/s |
|-----------|---------|-------------:|----------:|--------------:|-----------:|----------:|
| kvslim    | f32     |    36.11 MiB | 36.01 MiB |          1.00 |  2849 ± 92 |   171 ± 5 |
| kvslim    | bf16    |    18.09 MiB | 17.87 MiB |          0.99 |  4606 ± 13 |  165 ± 23 |
| kvslim    | q8_0    |     9.64 MiB |  9.68 MiB |          1.00 | 2557 ± 344 |   85 ± 23 |
| kvslim    | q4_0    |     5.14 MiB |  5.17 MiB |          1.01 | 2605 ± 238 |    63 ± 5 |
| kvslim    | q4_k_m  |     5.94 MiB |  7.00 MiB |          1.18 |   2279 ± 9 |    35 ± 5 |
| llama.cpp | f32     |    36.11 MiB | 65.28 MiB |          1.81 |  4344 ± 34 |   738 ± 11 |
| llama.cpp | bf16    |    18.09 MiB | 47.83 MiB |          2.64 |  3794 ± 34 | 1165 ± 32 |
| llama.cpp | q8_0    |     9.64 MiB | 39.04 MiB |          4.05 |  4410 ± 14 | 2056 ± 16 |
| llama.cpp | q4_0    |     5.14 MiB | 39.58 MiB |          7.71 | 4859 ± 103 | 2205 ± 26 |
| llama.cpp | q4_k_m  |     5.94 MiB | 39.12 MiB |          6.58 | 4763 ± 387 |  2478 ± 5 |

kvslim's f32 and bf16 rows are dense modules (a float file loads as before); the others
keep the file's blocks (QuantLinear / QuantEmbedding).
At this size ~1 MiB is allocator noise (the q4_k_m row; its mapped file pages were
5.4 MiB of 5.9). A random 100M-weight model of the same family (hidden 1024, 8 layers),
-p 64 -n 16: kvslim resident/file 1.00 (Q8_0, 101 MiB) and 1.02 (Q4_0, 54 MiB), of
which only 31 / 19 MiB are resident before the first forward (the rest are pages of
the file, read when first used); tg 16.7 / 8.6 t/s against llama.cpp's 228 / 320,
pp64 285 / 234 against 521 / 597. Greedy tokens, bundled model, Q8_0 vs F16 weights:
64 of 64 identical on each of four prompts (Q4_0: 5, 64, 64, 5).

--matmul on the 100M model (ms of all linear layers per forward, median of 3):

| weights | path                       | 1 token | 512 tokens |
|---------|----------------------------|--------:|-----------:|
| q8_0    | dense f32 (cached dequant) |    23.2 |       1117 |
| q8_0    | blocks, 256 KiB steps      |    68.3 |       1275 |
| q8_0    | blocks, 1 MiB steps        |    42.4 |       1692 |
| q8_0    | blocks, 4 MiB steps        |    52.8 |       1321 |
| q4_0    | dense f32 (cached dequant) |    24.2 |       1289 |
| q4_0    | blocks, 256 KiB steps      |   192.3 |       1768 |
| q4_0    | blocks, 4 MiB steps        |    90.9 |       1209 |
| q4_0    | int4pack (float32)         |   168.9 |   (2.6 s for one 8192x256 matrix) |

In isolation larger steps win; inside a whole model they page-fault (see
kvslim/weights/matmul.py), which is why 256 KiB steps are the default.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvslim import weights as W  # noqa: E402
from kvslim.bench import FilledCache, Test, measure  # noqa: E402
from kvslim.bench.memory import reset_peak, rss_kib  # noqa: E402
from kvslim.gguf import tensor_bytes  # noqa: E402
from kvslim.loading import convert_hf_to_gguf, default_model, load_model  # noqa: E402
from kvslim.tables import human_bytes, markdown_table  # noqa: E402
from kvslim.weights import matmul  # noqa: E402

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
WRITER_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
LLAMA_FTYPES = ("q4_k_m", "q5_k_m", "q6_k")         # made by llama.cpp's quantizer


def llama_cpp_or_none():
    """kvslim.peer when a llama.cpp binding loads, else None."""
    from kvslim import peer
    return peer if peer.available() else None


# ----- files --------------------------------------------------------------------------
def make_gguf(folder: Path, out_dir: Path, kind: str) -> Path:
    """The model as a GGUF of ``kind``: kvslim's writer, or llama.cpp's quantizer for K-quant mixes."""
    path = out_dir / f"{folder.name}-{kind}.gguf"
    if path.exists():
        return path
    if kind in WRITER_TYPES:
        return convert_hf_to_gguf(folder, path, kind)
    peer = llama_cpp_or_none()
    if peer is None or kind not in LLAMA_FTYPES:
        raise SystemExit(f"{kind}: needs llama.cpp's quantizer (one of {', '.join(LLAMA_FTYPES)}; "
                         "pip install -e '.[peer]')")
    return peer.quantize(make_gguf(folder, out_dir, "f32"), path, kind)


# ----- one engine on one file, in its own process ------------------------------------------
def rss_bytes() -> int:
    """VmRSS after returning freed heap to the OS, so that what a run dropped is not counted."""
    gc.collect()
    reset_peak()
    return rss_kib() * 1024


def child_kvslim(path: Path, args) -> dict:
    load_model(path)                           # first load pays the imports and allocator warm-up
    before = rss_bytes()
    model, _, _ = load_model(path)
    loaded = rss_bytes()
    fc = FilledCache(model, args.n_prompt + args.n_gen + 16, 1, "f16", "f16", 512)
    pp = measure(fc, Test("pp", args.n_prompt, 0), args.repetitions)
    tg = measure(fc, Test("tg", args.n_gen, 0), args.repetitions)
    record = {"rss_before": before, "rss_loaded": loaded, "rss_after": rss_bytes(),
              "rss_peak": max(pp["peak_rss_bytes"], tg["peak_rss_bytes"]), "weights_bytes": W.weight_bytes(model),
              "cache_bytes": fc.kv_bytes + fc.state_bytes,
              "pp": pp["avg_ts"], "pp_sd": pp["stddev_ts"], "tg": tg["avg_ts"], "tg_sd": tg["stddev_ts"]}
    del model, fc
    return {**record, "rss_unloaded": rss_bytes()}


def child_llama(path: Path, args) -> dict:
    """llama.cpp on the file (f16 K/V, flash attention), fed token ids."""
    from vs_llama_cpp import LlamaCppRun
    peer = llama_cpp_or_none()
    peer.binding()                             # the libraries load before the baseline, as kvslim's imports do
    before = rss_bytes()
    llm = peer.open_peer(path, n_ctx=args.n_prompt + args.n_gen + 16, n_threads=args.threads, n_batch=512)
    loaded = rss_bytes()
    run = LlamaCppRun(llm, llm.n_vocab)
    pp = run.measure(Test("pp", args.n_prompt, 0), args.repetitions)
    tg = run.measure(Test("tg", args.n_gen, 0), args.repetitions)
    record = {"rss_before": before, "rss_loaded": loaded, "rss_after": rss_bytes(),
              "rss_peak": rss_kib("VmHWM") * 1024, "weights_bytes": None, "cache_bytes": None,
              "pp": pp["avg_ts"], "pp_sd": pp["stddev_ts"], "tg": tg["avg_ts"], "tg_sd": tg["stddev_ts"]}
    llm.close()
    del llm, run
    return {**record, "rss_unloaded": rss_bytes()}


def in_child(engine: str, path: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, str(path), "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", str(args.repetitions), "-t", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if out.returncode:
        raise SystemExit(f"{engine} on {path.name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----- the table ---------------------------------------------------------------------------
def greedy_agreement(f16: Path, q8: Path, n: int) -> int:
    from kvslim.engine import load
    a, b = (load(p, ctx=256, dtype="f32").generate(PROMPT, n, temperature=0).token_ids for p in (f16, q8))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def row(engine: str, kind: str, path: Path, r: dict) -> list:
    """Resident model memory = what unloading it gives back after the run: the weights as
    touched, the KV cache and DeltaNet state (kvslim: subtracted, it knows their bytes),
    and the engine's buffers (llama.cpp: its compute buffers and KV are included)."""
    file_bytes = tensor_bytes(path)
    resident = r["rss_after"] - r["rss_unloaded"] - (r["cache_bytes"] or 0)
    held = "-" if r["weights_bytes"] is None else human_bytes(r["weights_bytes"])
    return [engine, kind, human_bytes(file_bytes), held, human_bytes(r["rss_loaded"] - r["rss_before"]),
            human_bytes(resident), f"{resident / file_bytes:.2f}", human_bytes(r["rss_after"]),
            human_bytes(r["rss_peak"]), f"{r['pp']:.1f} ± {r['pp_sd']:.1f}", f"{r['tg']:.1f} ± {r['tg_sd']:.1f}"]


def model_table(args) -> None:
    folder = Path(args.model) if args.model else default_model()
    out_dir = Path(args.out_dir or tempfile.mkdtemp())
    kinds = args.types.split(",")
    files = {k: make_gguf(folder, out_dir, k) for k in kinds}
    agree = greedy_agreement(make_gguf(folder, out_dir, "f16"), make_gguf(folder, out_dir, "q8_0"), args.greedy)
    print(f"greedy tokens, Q8_0 vs F16 weights (f32 compute): first {agree} of {args.greedy} identical")
    engines = ["kvslim"] + (["llama.cpp"] if llama_cpp_or_none() is not None and not args.no_llama else [])
    rows = []
    for kind in kinds:
        for engine in engines:
            rows.append(row(engine, kind, files[kind], in_child(engine, files[kind], args)))
            print(" | ".join(rows[-1]), flush=True)
    headers = ["engine", "weights", "file tensors", "held", "RSS +load", "resident (- cache)", "resident/file",
               "RSS", "peak RSS", f"pp{args.n_prompt} t/s", f"tg{args.n_gen} t/s"]
    print(markdown_table(headers, rows, ["l", "l"] + ["r"] * 9))


# ----- matmul paths ----------------------------------------------------------------------
def int4pack(w: W.QuantTensor):
    """Q4_0 blocks -> torch's packed int4 weight and (scale = d, zero = 0) per 32 values: exact.
    The kernel needs rows in multiples of 16; smaller layers (DeltaNet's a/b) keep the blocks path."""
    if w.shape[0] % 16 or w.input_index is not None:
        return lambda x: W.quant_linear(x, w)
    blocks = w.data.reshape(-1, w.wtype.block_bytes)
    codes = torch.cat([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], dim=-1).reshape(w.shape[0], w.cols)
    d = blocks[:, :2].contiguous().view(torch.float16).float().reshape(w.shape[0], -1)     # (rows, cols / 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    scales_zeros = torch.stack([d.T, torch.zeros_like(d.T)], dim=-1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)


def with_step(step_bytes: int):
    def run(w: W.QuantTensor):
        def call(x):
            matmul.STEP_BYTES, matmul.STEP_MACS = step_bytes, 1
            return W.quant_linear(x, w)
        return call
    return run


PATHS = {
    "dense f32 (cached dequant)": lambda w: (lambda x, d=w.dequantize(): F.linear(x, d)),
    "blocks, 256 KiB steps": with_step(256 << 10),
    "blocks, 1 MiB steps": with_step(1 << 20),
    "blocks, 4 MiB steps": with_step(4 << 20),
    "blocks, whole matrix": with_step(1 << 40),
    "int4pack (Q4_0 only)": int4pack,
}


def forward_ms(fns: list, n_tokens: int) -> tuple[float, int]:
    """One pass over every layer's matmul at ``n_tokens`` tokens: (ms, minor page faults)."""
    xs = [torch.randn(n_tokens, cols) for _, cols in fns]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for (fn, _), x in zip(fns, xs):
        fn(x)
    return (time.perf_counter() - t0) * 1e3, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def matmul_table(args) -> None:
    """Per path: ms for all of one forward's quantized linear layers, at 1 and 512 tokens.
    Paths are timed in interleaved rounds (median per path) so that load from other
    processes falls on all of them alike."""
    folder = Path(args.model) if args.model else default_model()
    out_dir = Path(args.out_dir or tempfile.mkdtemp())
    default_step = matmul.STEP_BYTES, matmul.STEP_MACS
    cases = {}
    for kind in ("q8_0", "q4_0"):
        model, _, _ = load_model(make_gguf(folder, out_dir, kind))
        layers = [m.quant for m in model.modules() if isinstance(m, W.QuantLinear)]
        head = model.model.embed_tokens.quant if model.lm_head is None else model.lm_head.quant
        layers.append(W.QuantTensor(head.data, head.wtype, head.cols))
        for name, make in PATHS.items():
            if not (name.startswith("int4") and kind != "q4_0"):
                cases[kind, name] = [(make(w), w.cols) for w in layers]
    samples = {key: {1: [], 512: []} for key in cases}
    for _ in range(args.repetitions + 1):                             # round 0 warms up
        for key, fns in cases.items():
            for n in (1, 512):
                if not (key[1].startswith("int4") and n > 1):         # float32 int4pack: seconds per forward
                    samples[key][n].append(forward_ms(fns, n))
    matmul.STEP_BYTES, matmul.STEP_MACS = default_step
    rows = [[kind, name, *(summary(samples[kind, name][n][1:]) for n in (1, 512))] for kind, name in cases]
    headers = ["weights", "path", "@1 tok: ms (min-max), page faults", "@512 tok: ms (min-max), page faults"]
    print(markdown_table(headers, rows, ["l", "l", "r", "r"]))


def summary(runs: list[tuple[float, int]]) -> str:
    if not runs:
        return "-"
    ms = [t for t, _ in runs]
    return f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}), {statistics.median(f for _, f in runs):.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="HF folder (default: the bundled model)")
    ap.add_argument("--types", default="bf16,q8_0,q4_0" + (",q4_k_m" if llama_cpp_or_none() else ""))
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--greedy", type=int, default=32, help="tokens compared, Q8_0 vs F16")
    ap.add_argument("--out-dir", default=None, help="where the GGUF files go (default: a temporary folder)")
    ap.add_argument("--no-llama", action="store_true", help="kvslim only")
    ap.add_argument("--matmul", action="store_true", help="time the matmul paths instead")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "GGUF"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        engine, path = args.child
        record = (child_kvslim if engine == "kvslim" else child_llama)(Path(path), args)
        print(json.dumps(record))
    elif args.matmul:
        matmul_table(args)
    else:
        model_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
