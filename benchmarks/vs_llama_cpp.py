"""kvslim beside llama.cpp on the same model, machine, depths and cache types.

    pip install -e '.[peer]'
    python benchmarks/vs_llama_cpp.py [-m MODEL] [-d 0,4096,16384] [-p 512] [-n 128] [-r 3]

The model (default: the bundled one) is exported to GGUF with kvslim's own
writer, then both engines run llama-bench's pp/tg tests at each depth with
f16, q8_0 and q4_0 K/V. Each depth is filled once per engine and restored
before every repetition (llama.cpp: llama_state_get/set; kvslim: the bench
snapshot). Before timing, both engines' greedy tokens for a fixed prompt are
compared at f16. llama.cpp comes through ``kvslim.peer``: llama-cpp-py-sync (the
``peer`` extra, b11739 prebuilt) or else llama-cpp-python.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.bench import FilledCache, Test, measure  # noqa: E402
from kvslim.cache import CacheConfig  # noqa: E402
from kvslim.engine import load  # noqa: E402
from kvslim.loading import default_model, load_model  # noqa: E402
from kvslim.models.matmul_precision import prompt_mode  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402
from kvslim.tools.bench import int_list  # noqa: E402
from kvslim.tools.convert import LLAMA_QUANTIZE, convert  # noqa: E402

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def peer_module():
    from kvslim import peer
    try:
        print(f"peer: {peer.describe()}")
    except peer.PeerUnavailable as err:
        sys.exit(f"{err}\ninstall the peer with: pip install -e '.[peer]'")
    return peer


def open_llama(peer, path: Path, ctx: int, type_k: str, type_v: str, threads: int, ubatch: int):
    return peer.open_peer(path, n_ctx=ctx, type_k=type_k, type_v=type_v, n_threads=threads, n_batch=ubatch)


class LlamaCppRun:
    """llama.cpp filled to a depth, restorable with its own state save/load."""

    def __init__(self, llm, vocab: int, seed: int = 0):
        self.llm, self.vocab, self.depth, self.state = llm, vocab, 0, None
        self.gen = torch.Generator().manual_seed(seed)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def grow_to(self, depth: int) -> None:
        self.restore()
        self.llm.eval(self.tokens(depth - self.depth))
        self.depth, self.state = depth, self.llm.save_state()

    def restore(self) -> None:
        if self.state is None:
            self.llm.reset()
        else:
            self.llm.load_state(self.state)

    def measure(self, test: Test, repetitions: int) -> dict:
        samples = []
        for rep in range(repetitions + 1):
            self.restore()
            toks = self.tokens(test.n_tokens)
            t0 = time.perf_counter()
            if test.kind == "pp":
                self.llm.eval(toks)
            else:
                for t in toks:
                    self.llm.eval([t])
            if rep:
                samples.append(test.n_tokens / (time.perf_counter() - t0))
        return {"avg_ts": statistics.mean(samples), "stddev_ts": statistics.stdev(samples) if len(samples) > 1
                else 0.0}


def kvslim_weights(gguf_type: str) -> str | None:
    """The type kvslim keeps the matrices in: the GGUF's, so both engines read the same bytes
    per token (f32 compute either way); an f32 GGUF is kvslim's dense f32 model. K-quant mixes
    (q4_k = Q4_K_M, ...) are made by llama.cpp's quantizer, and kvslim reads that same file."""
    return None if gguf_type == "f32" or gguf_type in LLAMA_QUANTIZE else gguf_type


def kvslim_source(gguf_type: str, model_path: Path, gguf: Path) -> Path:
    """What kvslim loads: the folder (quantized at load to the GGUF's type), or for K-quant
    mixes the GGUF itself."""
    return gguf if gguf_type in LLAMA_QUANTIZE else model_path


def greedy_check(peer, gguf: Path, model_path, n: int, threads: int, weights: str | None
                 ) -> tuple[list[int], list[int]]:
    kv = load(model_path, ctx=512, cache_type_k="f16", cache_type_v="f16", dtype="f32", weights=weights)
    ours = kv.generate(PROMPT, max_tokens=n, temperature=0).token_ids
    with open_llama(peer, gguf, 512, "f16", "f16", threads, 512) as llm:
        prompt = llm.tokenize(PROMPT, add_special=True)
        if prompt != kv.tokenize(PROMPT):
            print(f"note: tokenizers differ on the prompt: llama.cpp {prompt[:12]} kvslim {kv.tokenize(PROMPT)[:12]}")
        theirs = llm.greedy(kv.tokenize(PROMPT), n, stop=kv.tokenizer.eog_ids())
    return ours, theirs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--depths", default="0,4096,16384")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0,q4_0", help="K=V cache types to compare")
    ap.add_argument("--gguf-type", default="f16",
                    help="weight type of the exported GGUF; kvslim keeps its matrices in the same type "
                         "(f16, bf16, q8_0, q4_0; f32: dense; q4_k, q5_k, q6_k: llama-quantize's mixes, "
                         "which kvslim reads from the same file; iq3_s, iq3_xxs, and with --imatrix iq2_*, "
                         "iq1_*: llama.cpp's i-quant mixes)")
    ap.add_argument("--imatrix", default=None, help="llama-imatrix's GGUF file, for the IQ1/IQ2 mixes")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="kvslim decodes through torch.compile (--compile)")
    ap.add_argument("--attn-backend", default="torch",
                    help="kvslim's attention backend, comma-separated to time several side by side (torch, bf16)")
    args = ap.parse_args()
    peer = peer_module()
    start = time.perf_counter()
    try:
        peer.check_cache_types(args.types.split(","))
    except ValueError as err:
        sys.exit(f"--types: {err}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machines skew t/s)")
    torch.set_num_threads(args.threads)
    model_path = Path(args.model) if args.model else default_model()
    gguf = Path(tempfile.mkdtemp()) / f"{model_path.name}-{args.gguf_type}.gguf"
    convert(model_path, gguf, args.gguf_type, args.threads, Path(args.imatrix) if args.imatrix else None)
    source = kvslim_source(args.gguf_type, model_path, gguf)
    print(f"exported {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB)")
    print(f"kvslim weights: {kvslim_weights(args.gguf_type) or ('as the file stores them' if args.gguf_type in LLAMA_QUANTIZE else 'f32 (dense)')}, f32 compute; prompts' f32 matmuls: "
          f"{prompt_mode()} (KVSLIM_F32_MATMUL=ieee for plain float32)")
    ours, theirs = greedy_check(peer, gguf, source, args.greedy_tokens, args.threads,
                                kvslim_weights(args.gguf_type))
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"greedy tokens at f16: kvslim {len(ours)}, llama.cpp {len(theirs)}, identical prefix "
          f"{next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))}, "
          f"same positions {same}")
    rows = run_both(peer, gguf, source, args)
    backends = args.attn_backend.split(",")
    heads = [f"kvslim {b} t/s" if len(backends) > 1 else "kvslim t/s" for b in backends]
    ratios = [f"{b} / llama.cpp" if len(backends) > 1 else "kvslim / llama.cpp" for b in backends]
    print(markdown_table(["test", "type_k/v", "llama.cpp t/s", *heads, *ratios], rows,
                         ["l", "l", "r"] + ["r"] * 2 * len(backends)))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"wall time {time.perf_counter() - start:.0f} s")
    return 0


def run_both(peer, gguf, model_path, args) -> list[list]:
    depths = sorted(set(int_list(args.depths)))
    tests = [Test(k, n, d) for d in depths for k, n in (("pp", args.n_prompt), ("tg", args.n_gen))]
    ctx = max(depths) + max(args.n_prompt, args.n_gen) + 16
    model, _, _ = load_model(model_path, "f32", weights=kvslim_weights(args.gguf_type))
    rows, device = [], model.model.embed_tokens.weight.device
    for t in args.types.split(","):
        theirs = LlamaCppRun(open_llama(peer, gguf, ctx, t, t, args.threads, 512), model.config.vocab_size)
        ours = [FilledCache(model, ctx, 1, t, t, 512, compile=args.compile,
                            cache_config=CacheConfig(ctx, 1, t, t, backend=b, device=device))
                for b in args.attn_backend.split(",")]
        for test in tests:
            if theirs.depth != test.n_depth:
                theirs.grow_to(test.n_depth)
                for run in ours:
                    run.grow_to(test.n_depth)
            a = theirs.measure(test, args.repetitions)
            bs = [measure(run, test, args.repetitions) for run in ours]     # in turn, in one run: same load
            rows.append([test.label, f"{t}/{t}", f"{a['avg_ts']:.1f} ± {a['stddev_ts']:.1f}",
                         *[f"{b['avg_ts']:.1f} ± {b['stddev_ts']:.1f}" for b in bs],
                         *[f"{b['avg_ts'] / a['avg_ts']:.2f}" for b in bs]])
            print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
