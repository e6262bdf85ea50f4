"""KLD of KV levers that are not formats of the table, by simulation: sink tokens, mean subtraction,
K/V splits, query-aware K transform coding.

    python benchmarks/kv_levers.py -f TEXT --chunks 8 k=nl4s,v=nl4s k=nl4s,v=nl4s,sink=4 \\
        k=nl4s,v=nl4s,mean=kv k=nl4s,v=f32 k=f32,v=nl4s k=qa3,v=f32

Each config quantizes and dequantizes K and V as they enter an f32 cache (the attention
then sees exactly the values a packed cache would decode to), so a lever can be measured
before it has a cache layout. Keys of a config:
  k, v     a table format (role k / v), f32 for none, or ``qaB`` for K: query-aware transform
           coding at B bits per value on average (below)
  sink=N   positions < N stay exact (attention sinks kept at f16)
  mean=k|v|kv  subtract a per-(layer, kv head) mean vector taken from the slot's first prefill
           batch before quantizing, add it back after (for K the softmax does not need it back:
           q.m is the same for every key of a query)
Scoring is kld_vs_llama_cpp's: chunks of ``-c`` tokens, rows c/2 .. c-2, KLD over the whole
vocabulary against the same model with an f16 cache.

``qaB``: per (layer, kv head), the eigenbasis U of the query covariance (the query heads of
the group) and the keys' spread in it are calibrated on ``-c`` tokens of TEXT taken after
the scored chunks; each direction j gets an integer number of bits by reverse water-filling
on lambda_j * var_j (0-8, mean B), and a Lloyd-Max N(0,1) quantizer scaled by the direction's
calibrated spread. No per-row header: B is the whole cost.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from kvslim import formats
from kvslim.cache.kv import KVCache
from kvslim.engine.llm import load
from kvslim.eval.perplexity import bos_id, chunk_ids, with_cache_types
from kld_vs_llama_cpp import compare

class Layers:
    """Attention caches numbered in order of first use: a model's forward meets its attention
    layers in order, and each ``with_cache_types`` model builds fresh caches."""
    count = 0      # attention layers of the model
    seen = 0


# ----- query-aware K transform coding ---------------------------------------------------------
class QueryAwareK:
    """Calibrated per-layer transforms; ``code(layer, k, bits)`` quantizes and dequantizes."""

    def __init__(self):
        self.cal: dict[int, list[tuple]] = {}
        self._grids: dict[int, torch.Tensor] = {}

    def calibrate(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """q (N, Hq, D), k (N, Hk, D) after RoPE."""
        group = q.shape[1] // k.shape[1]
        self.cal[layer] = []
        for h in range(k.shape[1]):
            qq = q[:, h * group:(h + 1) * group].reshape(-1, q.shape[-1]).double()
            lam, u = torch.linalg.eigh(qq.T @ qq / qq.shape[0])
            ku = k[:, h].double() @ u
            self.cal[layer].append((u.float(), ku.std(0).float(), ku.mean(0).float(), lam.clamp_min(1e-12).float()))

    def grid(self, bits: int) -> torch.Tensor:
        """Lloyd-Max levels for N(0,1) at ``bits`` bits (empirical, 400K samples)."""
        if bits not in self._grids:
            x = torch.randn(400_000, generator=torch.Generator().manual_seed(bits))
            g = torch.quantile(x[:100_000], (torch.arange(1 << bits) + 0.5) / (1 << bits))
            for _ in range(40):
                c = torch.bucketize(x, (g[1:] + g[:-1]) / 2)
                g = torch.stack([x[c == i].mean() for i in range(1 << bits)])
            self._grids[bits] = g
        return self._grids[bits]

    @staticmethod
    def allocate(weight: torch.Tensor, mean_bits: float, max_bits: int = 8) -> torch.Tensor:
        """Integer bits per direction, 0.5*log2(weight) - t rounded and clipped, t bisected so
        that the mean is at most ``mean_bits`` (reverse water-filling)."""
        lo, hi = -40.0, 40.0
        for _ in range(60):
            t = (lo + hi) / 2
            if (0.5 * torch.log2(weight) - t).round().clamp(0, max_bits).mean() > mean_bits:
                lo = t
            else:
                hi = t
        return (0.5 * torch.log2(weight) - hi).round().clamp(0, max_bits)

    def code(self, layer: int, k: torch.Tensor, mean_bits: float) -> torch.Tensor:
        out = torch.empty(k.shape, dtype=torch.float32)
        for h, (u, sd, mu, lam) in enumerate(self.cal[layer]):
            bits = self.allocate(lam * sd ** 2, mean_bits)
            z = (k[:, h].float() @ u - mu) / sd
            rec = torch.zeros_like(z)
            for b in (int(b) for b in bits.unique().tolist() if b > 0):
                idx = (bits == b).nonzero().flatten()
                g = self.grid(b)
                rec[:, idx] = g[torch.bucketize(z[:, idx].contiguous(), (g[1:] + g[:-1]) / 2)]
            out[:, h] = (rec * sd + mu) @ u.T
        return out


QA = QueryAwareK()


# ----- the simulated cache ----------------------------------------------------------------------
class Lever:
    """The active config; ``KVCache.forward`` is wrapped to apply it."""
    cfg: dict = {}
    calib: list | None = None


def qdq(name: str, role: str, x: torch.Tensor, layer: int) -> torch.Tensor:
    if name in ("f32", "f16"):
        return x
    if name.startswith("qa"):
        return QA.code(layer, x, float(name[2:])).to(x.dtype)
    fmt = formats.get(name, role=role)
    return fmt.decode(fmt.encode(x.float().contiguous()), x.shape[-1]).reshape(x.shape).to(x.dtype)


def apply(cache, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    c = Lever.cfg
    if "mean" in c and int(positions[0]) == 0:                  # the slot's first prefill batch
        cache._lever_mk = k.float().mean(0) if "k" in c["mean"] else torch.zeros_like(k[0])
        cache._lever_mv = v.float().mean(0) if "v" in c["mean"] else torch.zeros_like(v[0])
    mk, mv = (getattr(cache, "_lever_mk", 0), getattr(cache, "_lever_mv", 0)) if "mean" in c else (0, 0)
    k2 = qdq(c["k"], "k", k - mk, cache._lever_layer) + mk
    v2 = qdq(c["v"], "v", v - mv, cache._lever_layer) + mv
    if c.get("sink"):
        keep = (positions < int(c["sink"]))[:, None, None]
        k2, v2 = torch.where(keep, k, k2), torch.where(keep, v, v2)
    return k2, v2


_FORWARD = KVCache.forward


def forward(self, batch, q, k, v):
    if not hasattr(self, "_lever_layer"):
        self._lever_layer = Layers.seen % Layers.count
        Layers.seen += 1
    if Lever.calib is not None:
        Lever.calib.append((self._lever_layer, q.detach().float(), k.detach().float()))
    if Lever.cfg:
        k, v = apply(self, batch.positions, k, v)
    return _FORWARD(self, batch, q, k, v)


def parse(text: str) -> dict:
    return dict(part.partition("=")[::2] for part in text.split(","))


def calibrate(llm, ids: list[int]) -> None:
    Lever.calib = []
    with_cache_types(llm, "f32", "f32").logits(ids)
    for layer in range(Layers.count):
        rows = [(q, k) for lay, q, k in Lever.calib if lay == layer]
        QA.calibrate(layer, torch.cat([q for q, _ in rows]), torch.cat([k for _, k in rows]))
    Lever.calib = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-f", "--file", required=True)
    p.add_argument("-c", "--ctx", type=int, default=4096)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("configs", nargs="+", help="e.g. k=nl4s,v=nl4s,sink=4")
    args = p.parse_args()
    llm = load(None, ctx=args.ctx, dtype=torch.float32, cache_type_k="f32", cache_type_v="f32")
    Layers.count = sum(kind == "full_attention" for kind in getattr(llm.model.config, "layer_types", ())) or \
        llm.model.config.num_hidden_layers
    ids = llm.tokenize(Path(args.file).read_text(encoding="utf-8"), add_special=False)
    chunks = chunk_ids(ids, args.ctx, args.chunks, bos_id(llm))
    after = args.ctx * (args.chunks + 1)
    if len(ids) < after + args.ctx:
        raise SystemExit(f"{args.file}: {len(ids)} tokens; calibration needs {after + args.ctx} (after the scored chunks)")
    calibrate(llm, ids[after:after + args.ctx])
    first = args.ctx // 2
    base = [with_cache_types(llm, "f16", "f16").logits(c)[first:-1].numpy() for c in chunks]
    print("| config | mean KLD | p99.9 KLD | same top-1 | per chunk |\n|---|--:|--:|--:|---|")
    for text in args.configs:
        Lever.cfg = parse(text)
        runs = [compare(b, with_cache_types(llm, "f32", "f32").logits(c)[first:-1].numpy()) for b, c in zip(base, chunks)]
        Lever.cfg = {}
        kld, same = np.concatenate([r[0] for r in runs]), np.concatenate([r[1] for r in runs])
        print(f"| {text} | {kld.mean():.6f} | {np.quantile(kld, 0.999):.4f} | {100 * same.mean():.2f}% | "
              f"{' '.join(f'{r[0].mean():.6f}' for r in runs)} |", flush=True)


KVCache.forward = forward

if __name__ == "__main__":
    main()
