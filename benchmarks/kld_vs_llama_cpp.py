"""Mean KLD / top-1 of KV cache types, kvslim and llama.cpp side by side, each against its own f16.

    python benchmarks/kld_vs_llama_cpp.py -f TEXT -c 4096 --chunks 8 \
        --kvslim q4_0,iq4_nl,nl4,q8_0/q4_0 --llama q4_0,iq4_nl,q8_0/q4_0 [--gguf FILE]
    (engines in separate runs: --save A.npz / --save B.npz, then --load A.npz --load B.npz)

Both engines read the same token ids (kvslim's tokenizer), cut as llama-perplexity
cuts them: chunks of ``-c`` tokens, the first replaced by BOS, rows ``c/2 .. c-2``
scored (2,047 per chunk at -c 4096). KLD is over the whole vocabulary, computed in
float64 from each engine's logits with a cache type against the same engine's logits
with an f16 cache. f32 compute on both sides (kvslim --dtype f32; an f32 GGUF exported
with kvslim's writer). llama.cpp comes from ``kvslim.peer`` (llama-cpp-py-sync b11739);
its quantized caches are rotated unless LLAMA_ATTN_ROT_DISABLE=1 is set.
Prints one markdown row per engine and type, plus paired per-chunk ratios to a
chosen row (``--versus``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvslim.engine.llm import load
from kvslim.eval.perplexity import bos_id, chunk_ids, with_cache_types
from kvslim import formats


def log_softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(base: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position KL(base || other) and same-argmax flags, from (n, vocab) logits."""
    lp, lq = log_softmax64(base), log_softmax64(other)
    kld = (np.exp(lp) * (lp - lq)).sum(-1)
    return kld, lp.argmax(-1) == lq.argmax(-1)


@contextlib.contextmanager
def llama_query():
    """Attend as llama.cpp's CPU flash attention does: it converts each query to the key cache's
    dot-product type first (f16 for an f16 cache, q8_0 for q8_0 / q4_0 / iq4_nl), in the rotated
    domain. kvslim keeps the query in f32; this isolates what is the formats' and what is the
    peer's arithmetic. Patches the attention entry point for the duration (a measurement aid)."""
    from kvslim.cache import attention

    plain = attention.attend_pages
    q8_0 = formats.get("q8_0-norot")                 # ggml's q8_0 blocks, already in the code domain

    def converted(cache, slots, q, *args, **kwargs):
        fk = cache.fmt_k
        if fk.name in ("f16", "f32"):
            q = q.half().float()
        else:
            q_code = fk.to_code_domain(q.float())
            q = fk.from_code_domain(q8_0.decode(q8_0.encode(q_code), q_code.shape[-1]))
        return plain(cache, slots, q, *args, **kwargs)

    holders = [m for m in list(sys.modules.values()) if getattr(m, "attend_pages", None) is plain]
    for m in holders:
        m.attend_pages = converted
    try:
        yield
    finally:
        for m in holders:
            m.attend_pages = plain


class KvslimRunner:
    def __init__(self, n_ctx: int, llama_query: bool = False):
        self.llm = load(None, ctx=n_ctx, dtype=torch.float32)
        self.llama_query = llama_query

    def logits(self, pair: tuple[str, str], ids: list[int], first: int) -> np.ndarray:
        llm = with_cache_types(self.llm, *pair)
        with llama_query() if self.llama_query else contextlib.nullcontext():
            return llm.logits(ids)[first:].numpy()


class LlamaRunner:
    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        from kvslim import peer
        self.peer, self.gguf, self.n_ctx, self.threads = peer, gguf, n_ctx, threads

    def logits(self, pair: tuple[str, str], ids: list[int], first: int) -> np.ndarray:
        with self.peer.open_peer(self.gguf, self.n_ctx, pair[0], pair[1], self.threads, 512,
                                 flash_attn=True, all_logits=True) as ctx:
            return ctx.eval(ids)[first:]


def parse_pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        k, _, v = item.partition("/")
        out.append((k, v or k))
    return out


def run(engine: str, runner, pairs, chunks, first: int, save=None) -> list[dict]:
    """One row per pair: per-position KLD and top-1 flags over all chunks; ``save(rows)``
    after each pair so that a long run leaves what it finished."""
    base = [None] * len(chunks)
    rows = []
    for pair in [("f16", "f16")] + pairs:
        t, klds, same, per_chunk = time.time(), [], [], []
        for i, ids in enumerate(chunks):
            lg = runner.logits(pair, ids, first)[:-1]            # rows c/2 .. c-2
            if pair == ("f16", "f16"):
                base[i] = lg
                continue
            k, s = compare(base[i], lg)
            klds.append(k), same.append(s), per_chunk.append(k.mean())
        if pair != ("f16", "f16"):
            rows.append({"engine": engine, "pair": pair, "kld": np.concatenate(klds),
                         "same": np.concatenate(same), "chunks": np.array(per_chunk)})
            print(f"  {engine} {'/'.join(pair)}: {time.time() - t:.0f} s", flush=True)
            if save:
                save(rows)
    return rows


def bits(pair: tuple[str, str], head_dim: int = 128) -> str:
    return f"{(formats.get(pair[0]).bits_per_value(head_dim) + formats.get(pair[1]).bits_per_value(head_dim)) / 2:g}"


def table(rows: list[dict], versus: str | None) -> str:
    ref = next((r for r in rows if f"{r['engine']}:{'/'.join(r['pair'])}" == versus), None)
    lines = ["| engine | K/V | bits/value | mean KLD | p99.9 KLD | same top-1 | chunks better than ref "
             "| top-1 changed here only / ref only |",
             "|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        name = "/".join(r["pair"]) if r["pair"][0] != r["pair"][1] else r["pair"][0]
        vs = f"{int((r['chunks'] < ref['chunks']).sum())}/{len(r['chunks'])}" if ref is not None else "-"
        # paired top-1: positions where only one of the two moved the top token (the rest cancel)
        flips = f"{int((~r['same'] & ref['same']).sum())} / {int((r['same'] & ~ref['same']).sum())}" \
            if ref is not None else "-"
        lines.append(f"| {r['engine']} | {name} | {bits(r['pair'])} | {r['kld'].mean():.6f} | "
                     f"{np.quantile(r['kld'], 0.999):.4f} | {100 * r['same'].mean():.2f}% | {vs} | {flips} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-f", "--file", default=None, help="text to score (required unless only merging)")
    p.add_argument("-c", "--ctx", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--skip", type=int, default=0, help="leave out the first N chunks (to split a run)")
    p.add_argument("--kvslim", default="", help="kvslim K/V pairs, e.g. q4_0,nl4,q8_0/q4_0")
    p.add_argument("--llama", default="", help="llama.cpp K/V pairs (ggml names)")
    p.add_argument("--gguf", default=None, help="f32 GGUF of the bundled model (default: export one)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--versus", default=None, help="paired reference row, e.g. llama:iq4_nl/iq4_nl")
    p.add_argument("--save", default=None, help="also save per-position KLD and top-1 to this .npz")
    p.add_argument("--load", action="append", default=[], help="add rows saved by an earlier --save run")
    p.add_argument("--llama-query", action="store_true",
                   help="kvslim rows (engine 'kvslim-lq') with queries converted as llama.cpp's CPU flash "
                        "attention converts them (f16 / q8_0 by the key type)")
    args = p.parse_args()
    if not args.kvslim and not args.llama:                      # only merge saved runs
        print(table(merge([r for path in args.load for r in load_rows(path)]), args.versus))
        return
    if not args.file:
        p.error("-f TEXT is required to run an engine")
    if args.llama:
        from kvslim import peer
        try:
            peer.check_cache_types(args.llama.split(","))
        except ValueError as err:
            p.error(f"--llama: {err}")
    kv = KvslimRunner(args.ctx, args.llama_query)
    bos = bos_id(kv.llm)
    chunks = chunk_ids(kv.llm.tokenize(Path(args.file).read_text(encoding="utf-8"), add_special=False),
                       args.ctx, args.chunks + args.skip, bos)[args.skip:]
    first = args.ctx // 2
    print(f"{len(chunks)} chunks of {args.ctx}, {len(chunks) * (args.ctx - first - 1)} scored positions", flush=True)
    save = (lambda done: save_rows(args.save, done)) if args.save else None
    engine = "kvslim-lq" if args.llama_query else "kvslim"
    rows = run(engine, kv, parse_pairs(args.kvslim), chunks, first, save) if args.kvslim else []
    if args.llama:
        gguf = Path(args.gguf) if args.gguf else _export()
        rows += run("llama", LlamaRunner(gguf, args.ctx, args.threads), parse_pairs(args.llama), chunks, first,
                    (lambda done: save_rows(args.save, rows + done)) if args.save else None)
    for path in args.load:
        rows += load_rows(path)
    print(table(merge(rows), args.versus))


def merge(rows: list[dict]) -> list[dict]:
    """Rows of the same engine and pair (from runs over different chunks) joined, first seen first."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["engine"], tuple(r["pair"]))
        if key in out:
            out[key] = {**out[key], **{k: np.concatenate([out[key][k], r[k]]) for k in ("kld", "same", "chunks")}}
        else:
            out[key] = dict(r)
    return list(out.values())


def save_rows(path: str, rows: list[dict]) -> None:
    np.savez(path, **{f"{r['engine']}:{'/'.join(r['pair'])}:{key}": r[key]
                      for r in rows for key in ("kld", "same", "chunks")})


def load_rows(path: str) -> list[dict]:
    """Rows saved by ``--save``, in their saved order."""
    data = np.load(path)
    names = list(dict.fromkeys(key.rsplit(":", 1)[0] for key in data.files))
    return [{"engine": n.split(":")[0], "pair": tuple(n.split(":")[1].split("/")),
             **{key: data[f"{n}:{key}"] for key in ("kld", "same", "chunks")}} for n in names]


def _export() -> Path:
    from kvslim.loading import convert_hf_to_gguf, default_model
    out = Path(tempfile.mkdtemp()) / "bundled-f32.gguf"
    convert_hf_to_gguf(default_model(), out, "f32")
    return out


if __name__ == "__main__":
    main()
