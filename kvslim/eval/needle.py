"""Synthetic "needle in a haystack" retrieval samples.

A sample is real filler text (documents supplied by the caller) with a short
*needle* sentence inserted at a chosen depth, followed by a question whose
answer only the needle gives::

    <filler ...> The pass key is 48213. Remember it. 48213 is the pass key. <filler ...>

    What is the pass key? The pass key is           <- prompt ends here
     48213                                          <- expected answer

The same generator serves training (many kinds and phrasings, so that the
model learns to retrieve rather than to match one template) and evaluation
(``CANONICAL_KIND``, one fixed phrasing, used by ``training/evaluate.py`` and
``kvslim eval niah``).  Everything is pure Python and tokenizer-independent:
length is given in characters, or in tokens through a caller's counting
callback.  Given the same ``random.Random`` state and arguments, the output is
identical on every platform.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

__all__ = [
    "CANONICAL_KIND",
    "KINDS",
    "MAGIC_NEEDLE",
    "MAGIC_QUESTION",
    "NeedleSample",
    "make_needle",
    "make_quiz",
    "parse_kinds",
    "build_haystack",
    "build_sample",
    "filler_text",
    "sample_kind",
]

CANONICAL_KIND = "passkey"

# Short, common, unambiguous words used as keys of the "magic number" facts.
WORDS = (
    "apple", "river", "candle", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orange", "pepper", "quarry", "rabbit",
    "saddle", "tiger", "umbrella", "violin", "walnut", "window", "yellow", "zebra",
    "anchor", "basket", "castle", "dragon", "engine", "forest", "guitar", "hammer",
    "iceberg", "jungle", "kingdom", "ladder", "mirror", "nickel", "oyster", "pillow",
    "rocket", "silver", "tunnel", "valley", "wizard", "button", "copper", "dolphin",
    "feather", "glacier", "helmet", "marble", "planet", "ribbon", "spider", "thunder",
)

# Canonical pass-key phrasing (evaluation) and training variants.  Every
# needle states the key twice so that it stands out from the filler.
_PASSKEY_NEEDLES = (
    "The pass key is {n}. Remember it. {n} is the pass key.",
    "Here is an important fact: the pass key is {n}. Keep the pass key {n} in mind.",
    "Remember this pass key: {n}. The pass key is {n}.",
    "Note that the pass key is {n}. I repeat, the pass key is {n}.",
)
_PASSKEY_QUESTIONS = (
    "What is the pass key? The pass key is",
    "What was the pass key mentioned above? The pass key is",
    "Recall the pass key from the text. The pass key is",
)
_MAGIC_NEEDLES = (
    "The special magic number for {w} is {n}.",
    "One of the special magic numbers for {w} is: {n}.",
    "Remember that the special magic number for {w} is {n}.",
)
_MAGIC_QUESTIONS = (
    "What is the special magic number for {w}? The special magic number for {w} is",
    "Which special magic number was mentioned for {w}? The special magic number for {w} is",
)
# canonical "special magic number" fact and question (kvslim eval ruler's multi-needle tasks)
MAGIC_NEEDLE, MAGIC_QUESTION = _MAGIC_NEEDLES[0], _MAGIC_QUESTIONS[0]
_CODE_NEEDLES = (
    "The secret code of the {w} is {n}.",
    "Attention: the {w} has the secret code {n}.",
)
_CODE_QUESTIONS = (
    "What is the secret code of the {w}? The secret code of the {w} is",
)

# kind -> relative training weight (evaluation uses CANONICAL_KIND only)
KINDS = {
    "passkey": 0.4,        # the canonical kind, also with training phrasings
    "magic": 0.3,          # one key-value fact
    "magic_multi": 0.2,    # 2-4 facts with different keys; one is asked
    "code": 0.1,           # another key-value phrasing
    # 5-10 facts with different keys (ruler's niah_multikey has 4 keys and 3 values of a
    # fifth). Weight 0 here: opt-in through train.py --kinds, so that earlier runs' rows
    # stay the same draws.
    "magic_many": 0.0,
}
# kinds whose facts are looked up by a key word; the count range of each
KEYED_COUNTS = {"magic": (1, 1), "code": (1, 1), "magic_multi": (2, 4), "magic_many": (5, 10)}


@dataclasses.dataclass(frozen=True)
class NeedleSample:
    """One retrieval sample: ``prompt`` then the expected ``answer``."""

    prompt: str           # filler with needle(s), then the question (no trailing space)
    answer: str           # expected continuation, e.g. " 48213"
    kind: str
    depth: float          # requested depth fraction of the (first) needle
    needle: str           # the needle sentence(s) that hold the answer
    needle_offset: int    # character offset of the answer-bearing needle in prompt
    question: str


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def make_needle(rng: random.Random, kind: str = CANONICAL_KIND, *,
                canonical: bool = False) -> tuple[list[str], int, str, str]:
    """Draw needle sentences, the index of the one asked about, question, answer.

    With ``canonical`` (evaluation) the fixed first phrasing of the kind is used;
    otherwise phrasings are drawn at random.
    """
    sentences, asked, questions = make_quiz(rng, kind, 1, canonical=canonical)
    (question, answer), = questions
    return sentences, asked[0], question, answer


def make_quiz(rng: random.Random, kind: str, asks: int, *,
              canonical: bool = False) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """Needle sentences and up to ``asks`` questions about them (distinct facts, in random order).

    Returns the sentences, the index of the sentence each question asks about, and
    (question, answer) pairs. A pass key is one fact, so it gets one question; a keyed
    kind gets ``min(asks, facts)``. With ``asks=1`` the draws are those of
    :func:`make_needle` (training rows made before quizzes existed stay the same).
    """
    pick = (lambda options: options[0]) if canonical else rng.choice
    if kind == "passkey":
        n = _number(rng, 5)
        return [pick(_PASSKEY_NEEDLES).format(n=n)], [0], [(pick(_PASSKEY_QUESTIONS), " " + n)]
    if kind not in KEYED_COUNTS:
        raise ValueError(f"unknown needle kind {kind!r}; expected one of {sorted(KINDS)}")
    needles, questions = ((_CODE_NEEDLES, _CODE_QUESTIONS) if kind == "code" else (_MAGIC_NEEDLES, _MAGIC_QUESTIONS))
    lo, hi = KEYED_COUNTS[kind]
    count = lo if lo == hi else rng.randint(lo, hi)     # a fixed count draws nothing (earlier rows' draws)
    words = rng.sample(WORDS, count)
    numbers = [_number(rng, rng.randint(4, 7)) for _ in words]
    sentences = [pick(needles).format(w=w, n=n) for w, n in zip(words, numbers)]
    asked = rng.sample(range(count), min(asks, count))   # one ask draws as randrange(count) did
    return sentences, asked, [(pick(questions).format(w=words[i]), " " + numbers[i]) for i in asked]


def filler_text(docs: Sequence[str], rng: random.Random, length_chars: int) -> str:
    """At least `length_chars` characters of consecutive real documents.

    Starts at a random document (and a random paragraph inside it) and joins
    documents with blank lines, wrapping around the list if needed.
    """
    if not docs:
        raise ValueError("filler_text needs at least one document")
    if length_chars <= 0:
        return ""
    index = rng.randrange(len(docs))
    first = docs[index]
    starts = [0] + [i + 2 for i in range(len(first) - 2) if first.startswith("\n\n", i)]
    parts = [first[rng.choice(starts[: max(1, len(starts) // 2)]):]]
    total = len(parts[0])
    guard = 0
    while total < length_chars:
        index = (index + 1) % len(docs)
        parts.append(docs[index])
        total += len(docs[index]) + 2
        guard += 1
        if guard > 100_000:
            raise ValueError("documents are empty")
    return "\n\n".join(parts)[:length_chars]


def _snap(text: str, position: int) -> int:
    """Move `position` back to just after a sentence or line end (or to 0)."""
    if position >= len(text):
        return len(text)
    lo = max(0, position - 400)
    best = -1
    for mark in (". ", ".\n", "\n", "? ", "! "):
        found = text.rfind(mark, lo, position)
        if found >= 0:
            best = max(best, found + len(mark))
    if best >= 0:
        return best
    space = text.rfind(" ", lo, position)
    return space + 1 if space >= 0 else position


def _trim_end(text: str) -> str:
    """Cut a filler piece after its last whitespace so no word is split."""
    cut = max(text.rfind(" "), text.rfind("\n"))
    return text[:cut] if cut > len(text) // 2 else text


def build_haystack(filler: str, needles: Sequence[str], depths: Sequence[float],
                   question: str) -> tuple[str, list[int]]:
    """Insert `needles` into `filler` at `depths` and append `question`.

    Returns the prompt and the character offset of each needle in it.
    """
    filler = _trim_end(filler).rstrip()
    positions = [_snap(filler, int(round(min(max(d, 0.0), 1.0) * len(filler)))) for d in depths]
    order = sorted(range(len(needles)), key=lambda i: positions[i])
    pieces, offsets, cursor, length = [], [0] * len(needles), 0, 0
    for i in order:
        chunk = filler[cursor:positions[i]]
        pieces.append(chunk)
        length += len(chunk)
        sep = "" if not chunk or chunk[-1] in " \n" else " "
        pieces.append(sep)
        length += len(sep)
        offsets[i] = length
        tail = filler[positions[i]:]
        after = "" if tail[:1] in ("", " ", "\n") else " "
        pieces.append(needles[i] + after)
        length += len(needles[i]) + len(after)
        cursor = positions[i]
    pieces.append(filler[cursor:])
    body = "".join(pieces).rstrip()
    prompt = (body + "\n\n" if body else "") + question
    return prompt, offsets


def build_sample(docs: Sequence[str], rng: random.Random, depth: float, *,
                 kind: str = CANONICAL_KIND,
                 length_chars: int | None = None,
                 target_tokens: int | None = None,
                 count_tokens: Callable[[str], int] | None = None,
                 canonical: bool | None = None,
                 max_tries: int = 6) -> NeedleSample:
    """Build one retrieval sample of about `length_chars` characters, or of at
    most `target_tokens` tokens (prompt plus answer) as counted by `count_tokens`.

    `depth` in [0, 1] places the asked-about needle (0: start of the filler,
    1: just before the question).  Other needles of ``magic_multi`` go to
    random depths.  With ``canonical=True`` (evaluation) the fixed first
    phrasing of the kind is used; by default phrasings are drawn (training).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if (length_chars is None) == (target_tokens is None):
        raise ValueError("give exactly one of length_chars or target_tokens")
    if target_tokens is not None and count_tokens is None:
        raise ValueError("target_tokens needs a count_tokens callback")
    sentences, asked, question, answer = make_needle(rng, kind, canonical=bool(canonical))
    depths = [rng.random() for _ in sentences]
    depths[asked] = depth
    # The filler is drawn once, long enough; only its cut length changes below.
    if length_chars is not None:
        budget = max(0, length_chars - sum(len(s) + 1 for s in sentences) - len(question) - 2)
        source = filler_text(docs, rng, budget)
        prompt, offsets = build_haystack(source, sentences, depths, question)
    else:
        assert count_tokens is not None and target_tokens is not None
        fixed = count_tokens(" ".join(sentences) + "\n\n" + question + answer) + 2
        want = max(0, target_tokens - fixed)
        chars = want * 4 + 64
        source = filler_text(docs, rng, chars * 2 + 4096)
        prompt, offsets = build_haystack(source[:chars], sentences, depths, question)
        for _ in range(max_tries):
            have = count_tokens(prompt + answer)
            if have <= target_tokens and have >= target_tokens - max(8, target_tokens // 100):
                break
            ratio = (len(source[:chars]) + 1) / max(1, have - fixed)
            chars = max(0, int((target_tokens - fixed) * ratio * (0.995 if have > target_tokens else 1.0)))
            if chars > len(source):
                source = filler_text(docs, random.Random(rng.random()), chars + 4096)
            prompt, offsets = build_haystack(source[:chars], sentences, depths, question)
        while count_tokens(prompt + answer) > target_tokens and chars > 0:
            chars = int(chars * 0.98) - 1
            prompt, offsets = build_haystack(source[:max(0, chars)], sentences, depths, question)
    return NeedleSample(prompt=prompt, answer=answer, kind=kind, depth=depth,
                        needle=sentences[asked], needle_offset=offsets[asked],
                        question=question)


def sample_kind(rng: random.Random, weights: dict[str, float] | None = None) -> str:
    """Draw a needle kind with the training weights of ``KINDS`` (or the given ones)."""
    weights = KINDS if weights is None else weights
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def parse_kinds(spec: str) -> dict[str, float]:
    """``"passkey:0.2,magic_many:0.5"`` -> weights; kinds not named weigh 0."""
    weights = dict.fromkeys(KINDS, 0.0)
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition(":")
        if name not in KINDS:
            raise ValueError(f"unknown needle kind {name!r} in {spec!r}; expected one of {sorted(KINDS)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"needle kind weight {item!r} is not kind:number") from None
        if weights[name] < 0:
            raise ValueError(f"needle kind weight {item!r} is negative")
    if not any(weights.values()):
        raise ValueError(f"needle kinds {spec!r} give every kind weight 0")
    return weights
