"""Per-token cost of a grammar engine's token mask on CPU: llguidance vs xgrammar.

    python benchmarks/grammar_mask.py [--steps 400] [--runs 5]

Two vocabularies: the bundled model's (8K byte-level BPE) and a synthetic
150K one (distinct byte-level pieces of English prose and Python source, the
size of Qwen's; no hub is reachable here, so not Qwen's own). For each engine
and vocabulary: grammar compile time, then a random walk through a JSON
schema's grammar (a token drawn uniformly from the allowed set each step,
restarting when the grammar completes), timing mask computation plus
consuming the token. xgrammar is optional (``pip install --no-deps xgrammar
apache-tvm-ffi`` keeps it from pulling triton).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.tokenizer import Tokenizer  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "count": {"type": "integer"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "where": {"type": "object", "properties": {"city": {"type": "string"}, "lat": {"type": "number"}},
              "required": ["city", "lat"]}}, "required": ["name", "count", "ok", "tags", "where"]}


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def synthetic_vocab(size: int, seed: int = 0) -> str:
    """tokenizer.json text of a byte-level BPE with ``size`` distinct pieces of real text (no merges)."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    alphabet = byte_level_alphabet()
    text = (ROOT / "kvslim/data/text/austen-heldout.txt").read_text()
    text += "".join(p.read_text(errors="ignore") for p in sorted(Path(torch.__file__).parent.glob("*.py"))[:60])
    data, rng = text.encode(), random.Random(seed)
    pieces = {alphabet[b] for b in range(256)}
    while len(pieces) < size - 1:
        start, n = rng.randrange(len(data) - 16), rng.choice([2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 10, 12, 16])
        pieces.add("".join(alphabet[b] for b in data[start:start + n]))
    vocab = {p: i for i, p in enumerate(sorted(pieces))}
    vocab["<|im_end|>"] = len(vocab)
    tok = Backend(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


# ----- the two engines ------------------------------------------------------------------------
class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: int):
        import llguidance
        self.ll, self.n_vocab = llguidance, n_vocab
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})

    def matcher(self):
        return self.ll.LLMatcher(self.tok, self.grammar, log_level=0)

    def mask(self, m) -> np.ndarray:                       # as kvslim's sampler uses it: a bool per token
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return bits[:self.n_vocab].astype(bool)

    @staticmethod
    def consume(m, token: int) -> None:
        m.consume_token(token)

    @staticmethod
    def done(m) -> bool:
        return m.is_stopped() or m.is_accepting() and random.random() < 0.5


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer as Backend
        hf = PreTrainedTokenizerFast(tokenizer_object=Backend.from_str(tokenizer_json), eos_token="<|im_end|>")
        self.xgr, self.n_vocab = xgr, n_vocab
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab, stop_token_ids=[eos])
        self.compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        self.bitmask = xgr.allocate_token_bitmask(1, n_vocab)

    def matcher(self):
        return self.xgr.GrammarMatcher(self.compiled)

    def mask(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.bitmask)
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")
        return bits[:self.n_vocab].astype(bool)

    @staticmethod
    def consume(m, token: int) -> None:
        m.accept_token(token)

    @staticmethod
    def done(m) -> bool:
        return m.is_terminated()


def walk(engine, steps: int, seed: int) -> list[float]:
    """Seconds per token (mask + consume) over a random walk of ``steps`` tokens."""
    rng, times = np.random.default_rng(seed), []
    m = engine.matcher()
    while len(times) < steps:
        t0 = time.perf_counter()
        allowed = np.flatnonzero(engine.mask(m))
        token = int(rng.choice(allowed))
        engine.consume(m, token)
        times.append(time.perf_counter() - t0)
        if engine.done(m):
            m = engine.matcher()
    return times


def measure(cls, label: str, tokenizer_json: str, n_vocab: int, eos: int, args) -> list:
    t0 = time.perf_counter()
    try:
        engine = cls(tokenizer_json, n_vocab, eos)
    except ImportError as err:
        return [cls.name, label, "-", "-", "-", f"not installed ({err.name})"]
    setup = time.perf_counter() - t0
    times = [t for run in range(args.runs) for t in walk(engine, args.steps, run)]
    q = statistics.quantiles(times, n=100)
    return [cls.name, label, f"{1000 * setup:.0f}", f"{1e6 * statistics.median(times):.0f}", f"{1e6 * q[98]:.0f}",
            f"{len(times)} tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=151_000)
    args = ap.parse_args()
    bundled = Tokenizer.from_folder(ROOT / "kvslim/data/tiny-qwen35")
    vocabs = [("bundled 8K", bundled.backend.to_str(), bundled.vocab_size, bundled.token_id("<|im_end|>"))]
    big = synthetic_vocab(args.vocab)
    vocabs.append((f"synthetic {args.vocab // 1000}K", big, args.vocab, args.vocab - 1))
    rows = [measure(cls, label, js, n, eos, args) for label, js, n, eos in vocabs for cls in (LLGuidance, XGrammar)]
    print(markdown_table(["engine", "vocab", "tokenizer+compile ms", "median us/token", "p99 us/token", "sample"],
                         rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
