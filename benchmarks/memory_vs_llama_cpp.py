"""Resident memory of kvslim and llama.cpp decoding at depth, each in its own process.

    pip install -e '.[peer]'
    python benchmarks/memory_vs_llama_cpp.py [-d 16384] [-n 32] [--types f16,q8_0,q4_0] [--gguf-type f16]

The bundled model is exported to GGUF (f16 by default); llama.cpp loads that file and
kvslim keeps its matrices in the same type (``--weights f16``, f32 compute). Each engine
runs in a fresh process, so one's libraries and heap do not count in the other's figures.
RSS is read after each stage (Linux ``VmRSS``; ``VmHWM`` for the peak):
  runtime  the engine's libraries imported (torch for kvslim, the llama.cpp library)
  model    weights loaded
  cache    a context of depth + n + 16 tokens allocated
  filled   the cache filled to the depth
  decoded  n tokens decoded one at a time
kvslim's own accounting (weights, KV bytes in use, DeltaNet state) is printed beside it
in MiB, so what is left is the torch runtime's, the allocator's and the workspaces' share.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.tables import markdown_table  # noqa: E402
from vs_llama_cpp import kvslim_weights  # noqa: E402  (the same weight type rule as the speed side-by-side)

STAGES = ("runtime", "model", "cache", "filled", "decoded")

KVSLIM = """
import json, sys, torch
from kvslim.bench.memory import rss_kib
out = {"runtime": rss_kib()}
from kvslim.bench import FilledCache
from kvslim.loading import load_model
from kvslim.weights import weight_bytes
torch.set_num_threads(2)
depth, n, kv, weights = {depth}, {n}, "{kv}", {weights!r}
model, _, _ = load_model(None, "f32", weights=weights)
out["model"] = rss_kib()
fc = FilledCache(model, depth + n + 16, 1, kv, kv, 512)
out["cache"] = rss_kib()
fc.grow_to(depth)
out["filled"] = rss_kib()
for i in range(n):
    fc.decode([0], [1], [depth + i])
out["decoded"], out["peak"] = rss_kib(), rss_kib("VmHWM")
out["weights_bytes"] = weight_bytes(model)
out["kv_bytes"], out["state_bytes"] = fc.kv_bytes, fc.state_bytes
print(json.dumps(out))
"""

# kvslim.peer is loaded as a lone file: importing the kvslim package would bring torch along
# and count its runtime in llama.cpp's figures.
LLAMA = """
import importlib.util, json, random
def rss_kib(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
spec = importlib.util.spec_from_file_location("kvslim_peer", "{peer_file}")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
peer.binding()
out = {"runtime": rss_kib()}
depth, n, kv = {depth}, {n}, "{kv}"
llm = peer.open_peer("{gguf}", n_ctx=depth + n + 16, type_k=kv, type_v=kv, n_threads=2, n_batch=512)
out["model"] = out["cache"] = rss_kib()
rng = random.Random(0)
llm.eval([rng.randrange(1000) for _ in range(depth)])
out["filled"] = rss_kib()
for _ in range(n):
    llm.eval([rng.randrange(1000)])
out["decoded"], out["peak"] = rss_kib(), rss_kib("VmHWM")
print(json.dumps(out))
"""


def fill(template: str, **values) -> str:
    """The template with each {name} replaced (str.format would trip on the code's dict braces)."""
    for name, value in values.items():
        template = template.replace("{" + name + "}", str(value)).replace("{" + name + "!r}", repr(value))
    return template


def run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"engine process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mib(kib) -> str:
    return f"{kib / 1024:.0f}" if kib is not None and kib >= 0 else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-d", "--depth", type=int, default=16384)
    ap.add_argument("-n", type=int, default=32, help="tokens decoded after filling")
    ap.add_argument("--types", default="f16,q8_0,q4_0", help="K=V cache types")
    ap.add_argument("--gguf-type", default="f16", help="weight type of the GGUF (kvslim keeps the same)")
    args = ap.parse_args()
    from kvslim import peer
    try:
        peer.check_cache_types(args.types.split(","))
    except ValueError as err:
        ap.error(f"--types: {err}")
    from kvslim.loading import convert_hf_to_gguf, default_model
    gguf = Path(tempfile.mkdtemp()) / f"model-{args.gguf_type}.gguf"
    convert_hf_to_gguf(default_model(), gguf, args.gguf_type)
    weights = kvslim_weights(args.gguf_type)
    rows = []
    for kv in args.types.split(","):
        fields = dict(depth=args.depth, n=args.n, kv=kv)
        peer_file = Path(__file__).resolve().parents[1] / "kvslim" / "peer.py"
        for engine, code in (("llama.cpp", fill(LLAMA, gguf=gguf, peer_file=peer_file, **fields)),
                             ("kvslim", fill(KVSLIM, weights=weights, **fields))):
            r = run(code)
            own = [f"{r[k] / 2**20:.1f}" if k in r else "" for k in ("weights_bytes", "kv_bytes", "state_bytes")]
            rows.append([engine, f"{kv}/{kv}", *(mib(r[s]) for s in STAGES), mib(r["peak"]), *own])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(f"resident MiB after each stage, depth {args.depth}, {args.n} decoded tokens, "
          f"weights {args.gguf_type} ({gguf.stat().st_size / 2**20:.1f} MiB file)\n")
    print(markdown_table(["engine", "K/V", *STAGES, "peak", "kvslim: weights", "KV", "DeltaNet state"], rows,
                         ["l", "l"] + ["r"] * 9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
