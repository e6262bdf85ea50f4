"""Perplexity and KL divergence against a reference cache, as llama-perplexity measures them.

The text is cut into chunks of ``n_ctx`` tokens; each chunk is a fresh prefill
(its first token replaced by BOS when the tokenizer adds one) and only the
second half is scored: logits at rows ``n_ctx/2 .. n_ctx-2`` predict tokens
``n_ctx/2+1 .. n_ctx-1``, so every scored token has at least half a chunk of
context. Statistics and the printed blocks follow ``tools/perplexity`` of
llama.cpp line for line.

Sweeps without a file (``compare_exact``) hold one chunk of the reference's
log-probabilities in memory and compare over the whole vocabulary.

Reference ("base") log-probabilities saved to a file keep, per scored token, the
log-prob of the actual next token (fp32), the argmax and, by default, the whole
vocabulary's log-probs as uint16 codes, as llama-perplexity's base files do:
``lo + step * code`` with ``lo`` the row's smallest log-prob and ``step`` =
(largest - smallest) / 65535, so every stored log-prob is within ``step / 2`` of
the float32 value (about 2e-4 nats for a 25-nat range); decoded rows are
renormalised. The KLD from such a file is the full-vocabulary sum: its mean stays
within 0.1% of ``compare_exact``'s (tested; 0.014% on the bundled model, q4_0 vs
f16, 3,066 tokens). A file holds 2 x vocab + 16 bytes per
token (16 KiB at vocab 8192, 485 KiB at 248,320).

``top_k > 0`` keeps only the ``top_k`` most likely ids with fp32 log-probs and lumps
the rest of the vocabulary into one "tail" bucket: a LOWER BOUND on KL(base || Q),
equal only when ``top_k`` covers the vocabulary. On the bundled 10M-parameter model,
whose distributions are broad (about a quarter of the mass lies outside the top
128), the top-128 bound reads about 21% low: 0.000812 against 0.001025 (q4_0, -c 4096,
the issue's measurement) and 0.000562 against 0.000709 (q4_0, -c 1024, measured here). At ``top_k=128`` a file holds 1,036 bytes per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..engine.llm import LLM

MIN_CTX = 16              # smallest chunk: 7 scored tokens per chunk at least
DEFAULT_TOP_K = 0         # the whole vocabulary (uint16 codes): exact KLD
FILE_KIND = "kvslim-kld-base"
FILE_VERSION = "2"        # 1: top-k only; 2 adds whole-vocabulary uint16 storage (both read)
CODE_LEVELS = 65535
LLAMA_MAGIC = b"_logits_"   # how llama-perplexity's own base files start

Progress = Callable[[int], None]   # called with the number of tokens just processed


# ----- models and chunks -------------------------------------------------------------
def with_cache_types(llm: LLM, type_k: str, type_v: str) -> LLM:
    """Another LLM over the same weights (no reload) with its own caches of the given types."""
    return llm.with_cache_types(type_k, type_v)


def chunk_ids(ids: list[int], n_ctx: int, n_chunks: int | None = None, bos: int | None = None) -> list[list[int]]:
    """Consecutive chunks of ``n_ctx`` tokens (the remainder is dropped), first token -> ``bos`` if given."""
    if n_ctx < MIN_CTX:
        raise ValueError(f"-c {n_ctx} is too small: chunks need at least {MIN_CTX} tokens")
    if len(ids) < n_ctx:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of -c {n_ctx}; "
                         f"use a longer text or a smaller -c")
    count = len(ids) // n_ctx if n_chunks is None or n_chunks <= 0 else min(n_chunks, len(ids) // n_ctx)
    chunks = [list(ids[i * n_ctx:(i + 1) * n_ctx]) for i in range(count)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def bos_id(llm: LLM) -> int | None:
    """The BOS id when the tokenizer adds one (llama.cpp puts BOS at the start of every chunk)."""
    tok = llm.tokenizer
    return tok.token_id(tok.bos_token) if tok.add_bos and tok.bos_token else None


def iter_logits(llm: LLM, ids: list[int], first: int = 0,
                progress: Progress | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Fresh prefill of ``ids`` in ubatches; yields ``(row, logits)`` for rows >= ``first``,
    logits float32 ``(n, vocab)`` starting at ``row``. Memory is bounded by one ubatch."""
    return llm.engine.iter_scores(ids, first, progress)


def scored_rows(ids: list[int], first: int, start: int, logits: torch.Tensor):
    """The rows of ``logits`` (starting at ``start``) that have a next token, and those tokens."""
    n = min(logits.shape[0], len(ids) - 1 - start)
    return logits[:n], torch.tensor(ids[start + 1:start + 1 + n], dtype=torch.long)


# ----- llama-perplexity's statistics -------------------------------------------------
def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error, llama.cpp style (0 below 11 values)."""
    count = len(values)
    if count < 1:
        return 0.0, 0.0
    mean = float(values.sum() / count)
    var = float((values * values).sum() / count) - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def covariance_of_means(a: np.ndarray, b: np.ndarray) -> float:
    count = len(a)
    if count < 10:
        return 0.0
    return (float((a * b).sum() / count) - float(a.sum() / count) * float(b.sum() / count)) / (count - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """Linear interpolation between order statistics, as perplexity.cpp does."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)])


def median(sorted_values: np.ndarray) -> float:
    n = len(sorted_values)
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


# ----- perplexity --------------------------------------------------------------------
@dataclass
class PerplexityResult:
    nll: np.ndarray            # (N,) float64 negative log-likelihood of every scored token
    n_ctx: int
    n_chunks: int
    type_k: str = "f16"
    type_v: str = "f16"

    @property
    def ppl(self) -> float:
        return math.exp(self.nll.mean())

    @property
    def uncertainty(self) -> float:
        """Standard error of the perplexity (llama.cpp's ``+/-``)."""
        n = len(self.nll)
        var = (self.nll ** 2).mean() - self.nll.mean() ** 2
        return math.sqrt(var / (n - 1)) * self.ppl if var > 0 and n > 1 else 0.0

    def final_line(self) -> str:
        return f"Final estimate: PPL = {self.ppl:.4f} +/- {self.uncertainty:.5f}"

    def as_dict(self) -> dict:
        return {"type_k": self.type_k, "type_v": self.type_v, "n_ctx": self.n_ctx, "chunks": self.n_chunks,
                "tokens": int(len(self.nll)), "ppl": self.ppl, "ppl_unc": self.uncertainty}


def perplexity(llm: LLM, chunks: list[list[int]], progress: Progress | None = None) -> PerplexityResult:
    """Perplexity of the second half of every chunk under ``llm``'s cache types."""
    n_ctx = len(chunks[0])
    first = n_ctx // 2
    nll = []
    for ids in chunks:
        for start, logits in iter_logits(llm, ids, first, progress):
            rows, targets = scored_rows(ids, first, start, logits)
            logp = torch.log_softmax(rows, -1)
            nll.append(-logp.gather(1, targets[:, None])[:, 0].double())
    return PerplexityResult(torch.cat(nll).numpy(), n_ctx, len(chunks), llm.engine.type_k, llm.engine.type_v)


# ----- reference log-probabilities ------------------------------------------------------
def encode_logp(logp: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, vocab) log-probs -> (uint16 codes, lo, step): ``lo + step * code`` is within
    ``step / 2`` of each value, ``step = (max - min) / 65535`` per row (llama-perplexity's
    base-file encoding)."""
    lp = logp.double()
    lo, hi = lp.min(-1).values, lp.max(-1).values
    step = (hi - lo) / CODE_LEVELS
    codes = ((lp - lo[:, None]) / step.clamp_min(1e-300)[:, None]).round().clamp(0, CODE_LEVELS)
    return (codes.to(torch.int32).numpy().astype(np.uint16), lo.float().numpy(), step.float().numpy())


def decode_logp(codes: np.ndarray, lo: np.ndarray, step: np.ndarray) -> torch.Tensor:
    """uint16 codes -> float64 log-probs (n, vocab), renormalised so the probabilities sum to 1."""
    lp = torch.from_numpy(lo).double()[:, None] + torch.from_numpy(step).double()[:, None] * \
        torch.from_numpy(codes.astype(np.int32)).double()
    return torch.log_softmax(lp, -1)


@dataclass
class Reference:
    """The reference cache's log-probabilities on the scored rows of every chunk.

    Either the whole vocabulary (``codes``/``lo``/``step``: exact KLD, the default) or
    the top-k (``top_ids``/``top_logp``: a lower bound on the KLD).
    """

    tokens: np.ndarray         # (n_chunks, n_ctx) int32, as evaluated (BOS substituted)
    first: int                 # first scored row of each chunk
    n_vocab: int
    top_ids: np.ndarray | None     # top-k storage: (N, K) int32, most likely first
    top_logp: np.ndarray | None    # (N, K) float32
    next_logp: np.ndarray      # (N,) float32: log-prob of the actual next token
    argmax: np.ndarray         # (N,) int32
    meta: dict = field(default_factory=dict)
    codes: np.ndarray | None = None    # whole-vocabulary storage: (N, vocab) uint16
    lo: np.ndarray | None = None       # (N,) float32: smallest log-prob of the row
    step: np.ndarray | None = None     # (N,) float32: log-prob per code

    @property
    def n_ctx(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def chunks(self) -> list[list[int]]:
        return [row.tolist() for row in self.tokens]

    @property
    def whole_vocab(self) -> bool:
        return self.codes is not None

    @property
    def top_k(self) -> int:
        """Log-probs kept per token: the vocabulary size when the KLD is exact."""
        return self.n_vocab if self.whole_vocab else int(self.top_ids.shape[1])

    @property
    def storage(self) -> str:
        return "uint16 whole vocabulary" if self.whole_vocab else f"top-{self.top_k} (KLD lower bound)"

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    def positions(self) -> np.ndarray:
        """Row (depth in the chunk) of every scored token."""
        return np.tile(np.arange(self.first, self.n_ctx - 1), self.tokens.shape[0])

    def first_chunks(self, n: int) -> "Reference":
        """The same base restricted to its first ``n`` chunks."""
        keep = min(n, len(self.tokens)) * self.rows_per_chunk
        cut = lambda a: None if a is None else a[:keep]  # noqa: E731
        return Reference(self.tokens[:n], self.first, self.n_vocab, cut(self.top_ids), cut(self.top_logp),
                         self.next_logp[:keep], self.argmax[:keep], self.meta, cut(self.codes), cut(self.lo),
                         cut(self.step))

    def logp(self, rows: slice) -> torch.Tensor:
        """Whole-vocabulary float64 log-probs of the scored rows ``rows``."""
        return decode_logp(self.codes[rows], self.lo[rows], self.step[rows])

    def save(self, path: str | Path) -> None:
        from safetensors import SafetensorError
        from safetensors.numpy import save_file

        meta = {"format": FILE_KIND, "version": FILE_VERSION, "n_vocab": str(self.n_vocab),
                "first": str(self.first), "storage": "uint16" if self.whole_vocab else "top-k",
                **{k: str(v) for k, v in self.meta.items()}}
        stored = {"codes": self.codes, "lo": self.lo, "step": self.step} if self.whole_vocab else \
            {"top_ids": self.top_ids, "top_logp": self.top_logp}
        tensors = {"tokens": self.tokens, "next_logp": self.next_logp, "argmax": self.argmax, **stored}
        try:
            save_file(tensors, str(path), metadata=meta)
        except (OSError, SafetensorError) as err:
            raise ValueError(f"cannot write KL-divergence base {path}: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Reference":
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"cannot read KL-divergence base {path}: no such file")
        with path.open("rb") as f:
            magic = f.read(len(LLAMA_MAGIC))
        if magic == LLAMA_MAGIC:
            # the same flag in llama-perplexity writes this layout; say so rather than "header too large"
            raise ValueError(f"{path} is a llama-perplexity base file; kvslim reads only the base files "
                             f"'kvslim eval kld --kl-divergence-base FILE' writes")
        try:
            with safe_open(str(path), "np") as f:
                meta = dict(f.metadata() or {})
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{path} does not look like a KL-divergence base file ({err})") from None
        whole, top = {"codes", "lo", "step"} <= set(arrays), {"top_ids", "top_logp"} <= set(arrays)
        if meta.get("format") != FILE_KIND or {"tokens", "next_logp", "argmax"} - set(arrays) or not (whole or top):
            raise ValueError(f"{path} does not look like a KL-divergence base file written by kvslim eval kld")
        extra = {k: v for k, v in meta.items() if k not in ("format", "version", "n_vocab", "first", "storage")}
        return cls(arrays["tokens"], int(meta["first"]), int(meta["n_vocab"]), arrays.get("top_ids"),
                   arrays.get("top_logp"), arrays["next_logp"], arrays["argmax"], extra, arrays.get("codes"),
                   arrays.get("lo"), arrays.get("step"))


def reference(llm: LLM, chunks: list[list[int]], first: int | None = None, top_k: int = DEFAULT_TOP_K,
              progress: Progress | None = None) -> Reference:
    """Log-probabilities of ``llm`` (the reference cache types) on every scored row.

    Args:
        first: first scored row per chunk (default ``n_ctx // 2``; 0 scores every row).
        top_k: 0 (default) or >= vocab: the whole vocabulary as uint16 codes (exact KLD);
            K > 0: the K most likely log-probs only (the KLD is then a lower bound).
    """
    n_ctx = len(chunks[0])
    first = n_ctx // 2 if first is None else first
    vocab = llm.model.config.vocab_size
    whole = top_k <= 0 or top_k >= vocab
    parts = {k: [] for k in ("a", "b", "c", "next", "argmax")}
    for ids in chunks:
        for start, logits in iter_logits(llm, ids, first, progress):
            rows, targets = scored_rows(ids, first, start, logits)
            logp = torch.log_softmax(rows, -1)
            if whole:
                for key, value in zip("abc", encode_logp(logp)):
                    parts[key].append(value)
            else:
                top = torch.topk(logp, top_k, dim=-1)
                parts["a"].append(top.indices.int().numpy())
                parts["b"].append(top.values.numpy())
            parts["next"].append(logp.gather(1, targets[:, None])[:, 0].numpy())
            parts["argmax"].append(rows.argmax(-1).int().numpy())
    cat = {k: np.concatenate(v) if v else None for k, v in parts.items()}
    meta = {"n_ctx": n_ctx, "type_k": llm.engine.type_k, "type_v": llm.engine.type_v,
            "model": str(llm.path) if llm.path else "bundled"}
    tokens = np.asarray(chunks, dtype=np.int32)
    if whole:
        return Reference(tokens, first, vocab, None, None, cat["next"], cat["argmax"], meta,
                         cat["a"], cat["b"], cat["c"])
    return Reference(tokens, first, vocab, cat["a"], cat["b"], cat["next"], cat["argmax"], meta)


# ----- comparison -----------------------------------------------------------------------
@dataclass
class Comparison:
    """Per scored token: Q's and the base's NLL, KL(base || Q), p_Q - p_base of the next token, same argmax."""

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray       # bool
    positions: np.ndarray      # row in the chunk
    tail_mass: np.ndarray      # base probability outside the stored top-k
    type_k: str = "f16"
    type_v: str = "f16"


def kl_top_k(top_logp: torch.Tensor, logq_top: torch.Tensor, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(P || Q) from P's top-k log-probs and Q's log-probs at the same ids, (n, K) each.

    Everything outside the top-k is one bucket on both sides (skipped when ``exact``).
    Returns (kld, tail mass of P), float64 (n,).
    """
    lp, lq = top_logp.double(), logq_top.double()
    p = lp.exp()
    kld = (p * (lp - lq)).sum(-1)
    tail_p = (1.0 - p.sum(-1)).clamp_min(0.0)
    if exact:
        return kld, tail_p
    tail_q = (1.0 - lq.exp().sum(-1)).clamp_min(1e-300)
    bucket = torch.where(tail_p > 0, tail_p * (tail_p.clamp_min(1e-300).log() - tail_q.log()), torch.zeros_like(tail_p))
    return kld + bucket, tail_p


class _Tokens:
    """Collects the per-token figures of one cache pair against a reference."""

    def __init__(self):
        self.parts = {k: [] for k in ("nll", "nll_base", "kld", "same", "tail")}

    def add(self, logq: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, nll_base: torch.Tensor,
            argmax_base: torch.Tensor, kld: torch.Tensor, tail: torch.Tensor) -> None:
        self.parts["nll"].append(-logq.gather(1, targets[:, None])[:, 0].double())
        self.parts["nll_base"].append(nll_base.double())
        self.parts["kld"].append(kld)
        self.parts["same"].append(logits.argmax(-1) == argmax_base.long())
        self.parts["tail"].append(tail)

    def result(self, positions: np.ndarray, llm: LLM) -> Comparison:
        nll, nll_base, kld, same, tail = (torch.cat(self.parts[k]).numpy()
                                          for k in ("nll", "nll_base", "kld", "same", "tail"))
        return Comparison(nll, nll_base, kld, np.exp(-nll) - np.exp(-nll_base), same, positions, tail,
                          llm.engine.type_k, llm.engine.type_v)


def compare(llm: LLM, ref: Reference, progress: Progress | None = None) -> Comparison:
    """Score the reference's chunks under ``llm``'s cache types against the stored log-probs."""
    if llm.model.config.vocab_size != ref.n_vocab:
        raise ValueError(f"inconsistent vocabulary: the base has {ref.n_vocab} tokens, the model "
                         f"{llm.model.config.vocab_size}")
    next_logp, argmax = torch.from_numpy(ref.next_logp), torch.from_numpy(ref.argmax)
    out, at = _Tokens(), 0
    for ids in ref.chunks:
        for start, logits in iter_logits(llm, ids, ref.first, progress):
            rows, targets = scored_rows(ids, ref.first, start, logits)
            sl = slice(at, at + rows.shape[0])
            logq = torch.log_softmax(rows, -1)
            kld, tail = _stored_kld(ref, sl, logq)
            out.add(logq, rows, targets, -next_logp[sl], argmax[sl], kld, tail)
            at += rows.shape[0]
    return out.result(ref.positions(), llm)


def _stored_kld(ref: Reference, rows: slice, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(base || Q) and the base's mass outside what is stored, float64 (n,), for ``rows``."""
    if ref.whole_vocab:
        lp = ref.logp(rows)
        kld = (lp.exp() * (lp - logq.double())).sum(-1)
        return kld, torch.zeros_like(kld)
    top_ids = torch.from_numpy(ref.top_ids[rows]).long()
    return kl_top_k(torch.from_numpy(ref.top_logp[rows]), logq.gather(1, top_ids), ref.top_k >= ref.n_vocab)


def compare_exact(ref: LLM, llms: list[LLM], chunks: list[list[int]], first: int | None = None,
                  progress: Progress | None = None) -> list[Comparison]:
    """KL(ref || Q) over the whole vocabulary for every model in ``llms``, chunk by chunk.

    The reference's log-probs of one chunk are held in memory (scored rows x vocab,
    fp32) while each model scores that chunk, so nothing is truncated and nothing
    is written; the reference prefills every chunk once.
    """
    n_ctx = len(chunks[0])
    first = n_ctx // 2 if first is None else first
    outs = [_Tokens() for _ in llms]
    for ids in chunks:
        parts = [(torch.log_softmax(rows, -1), rows.argmax(-1), targets)
                 for rows, targets in (scored_rows(ids, first, start, logits)
                                       for start, logits in iter_logits(ref, ids, first, progress))]
        logp = torch.cat([p[0] for p in parts])                          # (rows, vocab)
        argmax, targets = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        nll_base = -logp.gather(1, targets[:, None])[:, 0]
        for llm, out in zip(llms, outs):
            at = 0
            for start, logits in iter_logits(llm, ids, first, progress):
                rows, tgt = scored_rows(ids, first, start, logits)
                sl = slice(at, at + rows.shape[0])
                logq, lp = torch.log_softmax(rows, -1), logp[sl]
                lp64 = lp.double()
                kld = (lp64.exp() * (lp64 - logq.double())).sum(-1)
                out.add(logq, rows, tgt, nll_base[sl], argmax[sl], kld, torch.zeros_like(kld))
                at += rows.shape[0]
    positions = np.tile(np.arange(first, n_ctx - 1), len(chunks))
    return [out.result(positions, llm) for llm, out in zip(llms, outs)]


# ----- llama-perplexity's summary ---------------------------------------------------------
KLD_PERCENTILES = (("99.9%", 0.999), ("99.0%", 0.990), ("95.0%", 0.950), ("90.0%", 0.900))
KLD_LOW_PERCENTILES = (("10.0%", 0.100), (" 5.0%", 0.050), (" 1.0%", 0.010), (" 0.1%", 0.001))
DP_PERCENTILES = KLD_PERCENTILES + (("75.0%", 0.750),)
DP_LOW_PERCENTILES = (("25.0%", 0.250),) + KLD_LOW_PERCENTILES


def kld_statistics(c: Comparison) -> dict:
    """Every figure of llama-perplexity's three summary blocks (fractions, not percent)."""
    log_ppl, log_ppl_unc = mean_and_uncertainty(c.nll)
    log_base, log_base_unc = mean_and_uncertainty(c.nll_base)
    cov = covariance_of_means(c.nll, c.nll_base)
    ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
    ratio_unc = math.sqrt(max(0.0, log_ppl_unc ** 2 + log_base_unc ** 2 - 2 * cov))
    denom = log_ppl_unc * log_base_unc
    kld_sorted, dp_sorted = np.sort(c.kld), np.sort(c.p_diff)
    kld_mean, kld_unc = mean_and_uncertainty(c.kld)
    dp_mean, dp_unc = mean_and_uncertainty(c.p_diff)
    mse, mse_unc = mean_and_uncertainty(c.p_diff ** 2)
    rms = math.sqrt(mse)
    same = float(c.same_top.mean())
    n = len(c.kld)
    s = {"type_k": c.type_k, "type_v": c.type_v, "tokens": n,
         "ppl": ppl, "ppl_unc": ppl * log_ppl_unc, "ppl_base": ppl_base, "ppl_base_unc": ppl_base * log_base_unc,
         "cor_ln_ppl": cov / denom if denom > 0 else float("nan"),
         "ln_ppl_ratio": log_ppl - log_base, "ln_ppl_ratio_unc": ratio_unc,
         "ppl_ratio": math.exp(log_ppl - log_base), "ppl_ratio_unc": math.exp(log_ppl - log_base) * ratio_unc,
         "ppl_diff": ppl - ppl_base,
         "ppl_diff_unc": math.sqrt(max(0.0, (ppl * log_ppl_unc) ** 2 + (ppl_base * log_base_unc) ** 2
                                       - 2 * ppl * ppl_base * cov)),
         "kld_mean": kld_mean, "kld_unc": kld_unc, "kld_max": float(kld_sorted[-1]),
         "kld_median": median(kld_sorted), "kld_min": float(kld_sorted[0]),
         "dp_mean": dp_mean, "dp_unc": dp_unc, "dp_max": float(dp_sorted[-1]), "dp_median": median(dp_sorted),
         "dp_min": float(dp_sorted[0]), "dp_rms": rms, "dp_rms_unc": 0.5 / rms * mse_unc if rms > 0 else 0.0,
         "same_top": same, "same_top_unc": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
         "tail_mass_mean": float(c.tail_mass.mean())}
    for label, f in KLD_PERCENTILES + KLD_LOW_PERCENTILES:
        s[f"kld_p{label.strip()[:-1]}"] = percentile(kld_sorted, f)
    for label, f in DP_PERCENTILES + DP_LOW_PERCENTILES:
        s[f"dp_p{label.strip()[:-1]}"] = percentile(dp_sorted, f)
    return s


def format_kld_block(s: dict) -> str:
    """The three blocks llama-perplexity prints at the end of a KL-divergence run, byte for byte."""
    pct = lambda label: label.strip()[:-1]  # noqa: E731  "99.9%" -> "99.9"
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_unc']:10.6f}",
             f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_unc']:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * s['cor_ln_ppl']:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_unc']:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_unc']:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_unc']:10.6f}",
             "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_unc']:10.6f}",
             f"Maximum KLD: {s['kld_max']:10.6f}"]
    lines += [f"{label}   KLD: {s['kld_p' + pct(label)]:10.6f}" for label, _ in KLD_PERCENTILES]
    lines += [f"Median  KLD: {s['kld_median']:10.6f}"]
    lines += [f"{label}   KLD: {s['kld_p' + pct(label)]:10.6f}" for label, _ in KLD_LOW_PERCENTILES]
    lines += [f"Minimum KLD: {s['kld_min']:10.6f}",
              "",
              "====== Token probability statistics ======",
              f"Mean    Δp: {100 * s['dp_mean']:6.3f} ± {100 * s['dp_unc']:5.3f} %",
              f"Maximum Δp: {100 * s['dp_max']:6.3f}%"]
    lines += [f"{label}   Δp: {100 * s['dp_p' + pct(label)]:6.3f}%" for label, _ in DP_PERCENTILES]
    lines += [f"Median  Δp: {100 * s['dp_median']:6.3f}%"]
    lines += [f"{label}   Δp: {100 * s['dp_p' + pct(label)]:6.3f}%" for label, _ in DP_LOW_PERCENTILES]
    lines += [f"Minimum Δp: {100 * s['dp_min']:6.3f}%",
              f"RMS Δp    : {100 * s['dp_rms']:6.3f} ± {100 * s['dp_rms_unc']:5.3f} %",
              f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %"]
    return "\n".join(lines)


__all__ = ["MIN_CTX", "DEFAULT_TOP_K", "PerplexityResult", "Reference", "Comparison", "with_cache_types",
           "chunk_ids", "bos_id", "iter_logits", "perplexity", "reference", "compare", "compare_exact",
           "kld_statistics",
           "format_kld_block", "kl_top_k", "encode_logp", "decode_logp"]
