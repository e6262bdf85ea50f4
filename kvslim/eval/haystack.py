"""Haystacks built in token space: real filler tokens with needle sentences inserted after sentence ends.

Tokenizing a 64K-token text for every sample is slow; cutting a window out of
an already tokenized stream and splicing the needles' tokens in is ~100x
faster, and it is what training does. Both the training data
(``training/train.py``: :func:`needle_row`) and ``kvslim eval ruler`` build
their samples here, so the evaluation measures the sample shape training made::

    filler[:cut_1] + needle_1 + filler[cut_1:cut_2] + needle_2 + ... + "\\n\\n" question + answer

A needle goes in at the last sentence (or line) end at or before its depth,
with a leading space unless it follows a newline. Only the tokenizer is
needed: :class:`TokenSpace` reads which tokens end a sentence from it.
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

import numpy as np

from . import needle

__all__ = ["TokenSpace", "needle_row"]


class TokenSpace:
    """What haystack building needs from a tokenizer: ``encode`` and, per token id, whether it
    ends a sentence or a line.

    Args:
        encode: text -> token ids, without special tokens.
        decode: token ids -> text.
        vocab_size: ids 0..vocab_size-1 are classified.
    """

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], vocab_size: int):
        self.encode = encode
        self.sentence_end = np.array([decode([i]).endswith((".", "!", "?", "\n")) for i in range(vocab_size)])
        self.newline_end = np.array([decode([i]).endswith("\n") for i in range(vocab_size)])
        # stands in for <|endoftext|> inside filler: haystacks join documents with a blank line
        self.blank_line = encode("\n\n")[0]

    def sentence_ends(self, filler: np.ndarray) -> np.ndarray:
        """Positions in ``filler`` right after a sentence or line end (where a needle may go)."""
        return np.flatnonzero(self.sentence_end[filler]) + 1

    def cut_at(self, filler: np.ndarray, depth: float) -> int:
        """The insertion point for ``depth`` in [0, 1]: the last sentence end at or before it (0 if none)."""
        return snap(self.sentence_ends(filler), int(depth * len(filler)))

    def needle_ids(self, filler: np.ndarray, cut: int, sentence: str) -> list[int]:
        """Tokens of ``sentence`` as inserted at ``cut``: with a leading space unless a newline precedes it."""
        after_newline = cut == 0 or self.newline_end[filler[cut - 1]]
        return self.encode(sentence if after_newline else " " + sentence)

    def pieces(self, filler: np.ndarray, cuts: Sequence[int], sentences: Sequence[str],
               spaced: bool = False) -> list[list[int]]:
        """Each sentence's tokens as inserted at its cut: bare after a newline, else with a leading
        space. With ``spaced`` a sentence that follows another at the same cut gets its space too;
        without it the two are glued ("...is 12345.One of"), as training's rows have always been."""
        out, previous = [[] for _ in sentences], None
        for cut, i in sorted((cut, i) for i, cut in enumerate(cuts)):
            glued = spaced and cut == previous
            out[i] = self.encode(" " + sentences[i]) if glued else self.needle_ids(filler, cut, sentences[i])
            previous = cut
        return out

    def insert(self, filler: np.ndarray, sentences: Sequence[str], depths: Sequence[float],
               cuts: Sequence[int] | None = None, spaced: bool = False) -> tuple[list[int], list[int]]:
        """``filler`` with each sentence spliced in at its depth (or at the given ``cuts``).

        Returns the token ids and the position of each sentence's first token in them.
        Sentences at the same cut keep their given order (``spaced``: see :meth:`pieces`).
        """
        if cuts is None:
            ends = self.sentence_ends(filler)
            cuts = [snap(ends, int(d * len(filler))) for d in depths]
        pieces = self.pieces(filler, cuts, sentences, spaced)
        ids, starts, cursor = [], [0] * len(sentences), 0
        for cut, i in sorted((cut, i) for i, cut in enumerate(cuts)):
            ids.extend(filler[cursor:cut].tolist())
            starts[i] = len(ids)
            ids.extend(pieces[i])
            cursor = cut
        ids.extend(filler[cursor:].tolist())
        return ids, starts


def snap(ends: np.ndarray, position: int) -> int:
    """The last sentence end at or before ``position`` (0 if none)."""
    k = int(np.searchsorted(ends, position, side="right"))
    return int(ends[k - 1]) if k else 0


def needle_row(space: TokenSpace, rng: random.Random, length: int,
               window: Callable[[random.Random, int], np.ndarray], eos_id: int,
               answer_weight: float, answer_stop: str = "", kinds: dict[str, float] | None = None,
               asks: int = 1, kind: str | None = None,
               fill: tuple[float, float] = (0.2, 1.0),
               canonical: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One training row: ``length + 1`` tokens ending with a retrieval sample, and their loss weights.

    The sample (kind drawn with ``kinds``' weights, default :data:`needle.KINDS`, and
    phrasing by :mod:`needle`) fills a share of the row drawn uniformly from ``fill``
    (default 20-100%: the needle-to-question distance is then mostly short, under half
    the row four times in five; (0.8, 1.0) trains long look-ups); a window of other text ending
    in ``eos_id`` pads the front. ``window(rng, n)`` returns ``n`` consecutive tokens of
    the training stream (a fresh array). Answer tokens weigh ``answer_weight``, the rest 1.
    ``answer_stop`` (e.g. ``"."``, the character after the number in every needle
    phrasing) follows the answer with the answer's weight: digits are single tokens, so
    where a number ends is itself a prediction, and one that a model taught only the
    digits gets wrong by running on with an extra digit.

    ``asks`` > 1 follows a keyed sample with up to that many question-answer pairs, each
    after a blank line: one haystack then teaches several look-ups by key instead of one
    (the first question reads exactly as an evaluation prompt does).

    ``kind`` given: a caller that drew it from ``rng`` itself, with ``kinds``' weights (to
    log results per kind), gets the row that drawing it here would have given.

    ``canonical`` uses each kind's evaluation phrasing instead of a drawn one (for mining
    the rows an evaluation's phrasing makes hard; it draws less from ``rng``, so the rows differ).
    """
    kind = kind or needle.sample_kind(rng, kinds)
    sentences, _, quiz = needle.make_quiz(rng, kind, asks, canonical=canonical)
    tail_ids, tail_weights = [], []
    for question, answer in quiz:
        question_ids, answer_ids = space.encode("\n\n" + question), space.encode(answer + answer_stop)
        tail_ids += question_ids + answer_ids
        tail_weights += [1.0] * len(question_ids) + [answer_weight] * len(answer_ids)
    target = int(length * rng.uniform(*fill))
    needle_len = sum(len(space.encode(" " + x)) for x in sentences)
    filler_len = max(0, target - needle_len - len(tail_ids) - 1)
    filler = window(rng, filler_len + 1)[1:]
    filler[filler == eos_id] = space.blank_line
    ids, _ = space.insert(filler, sentences, [rng.random() for _ in sentences])
    weights = [1.0] * len(ids) + tail_weights + [1.0]
    ids += tail_ids + [eos_id]
    ids, weights = ids[-(length + 1):], weights[-(length + 1):]
    missing = length + 1 - len(ids)
    if missing > 0:
        prefix = window(rng, missing)
        prefix[-1] = eos_id
        ids = prefix.tolist() + ids
        weights = [1.0] * missing + weights
    return np.asarray(ids, dtype=np.int64), np.asarray(weights, dtype=np.float32)
