#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of kvslim's bundled tiny model.

The tokenizer is trained with the ``tokenizers`` library on the *training*
split of the corpus (``training/data/<source>.train.txt``, see corpus.py);
held-out documents are never seen.  Properties:

* byte-level pre-tokenizer and decoder: every string round-trips exactly,
  whatever bytes it holds;
* digits are split into single digits before the byte-level split (as the
  Qwen tokenizers do), so numbers such as pass keys are spelled digit by digit
  and copying them is a per-token operation the model can learn;
* special tokens ``<|endoftext|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>``
  (2);
* deterministic: documents are fed in a fixed order (sources sorted by name,
  documents in file order) and the trainer has no random state.

Usage::

    .venv/bin/python training/tokenizer.py                       # -> training/tokenizer.json
    .venv/bin/python training/tokenizer.py --vocab-size 4096 --out /tmp/tok.json
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TRAINING_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TRAINING_DIR))

import corpus  # noqa: E402  (training/corpus.py, next to this file)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_OUT = TRAINING_DIR / "tokenizer.json"


def train_files(data_dir: Path) -> list[Path]:
    """The training-split files, in a fixed (sorted) order."""
    files = sorted(data_dir.glob("*.train.txt"))
    if not files:
        raise SystemExit(
            f"no *.train.txt under {data_dir}; run .venv/bin/python training/corpus.py first")
    return files


def iter_documents(files: list[Path]) -> Iterator[str]:
    """Every training document, source by source, in file order."""
    for path in files:
        yield from corpus.read_documents(path)


def build_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `files`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents(files), trainer=trainer)
    return tok


def check_round_trip(tok: Tokenizer) -> None:
    """A few strings that must survive encode/decode unchanged."""
    samples = [
        "The pass key is 48213. Remember it. 48213 is the pass key.",
        "  indented\tcode = {'a': [1, 2, 3]}\n\nÜnïcödé — “quotes” 日本語 🙂\r\n",
        "",
    ]
    for text in samples:
        ids = tok.encode(text).ids
        back = tok.decode(ids, skip_special_tokens=False)
        if back != text:
            raise SystemExit(f"round trip failed: {text!r} -> {back!r}")
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"special token {name} has id {tok.token_to_id(name)}, expected {i}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=corpus.DEFAULT_DATA_DIR)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    files = train_files(args.data_dir)
    start = time.time()
    tok = build_tokenizer(files, args.vocab_size)
    check_round_trip(tok)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    print(f"[tokenizer] vocab {tok.get_vocab_size()} from {len(files)} files "
          f"in {time.time() - start:.1f}s -> {args.out} (sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
