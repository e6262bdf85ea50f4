"""Incremental detokenization with stop strings, for streaming.

Each token costs the same however long the reply has grown: only a short window of the newest
ids is decoded again (a reply of 15K tokens re-decoded whole cost 5 ms a token here), stop
strings are looked for only where a new one can end, and what is emitted holds back any tail
that could still grow into a stop string.

The window: ids[prefix:read] were decoded before and are decoded again beside the new ids, as
context, because a tokenizer may decode a token differently at the start of a text (Metaspace
drops the first piece's space) and byte-level BPE or byte fallback split a character across
tokens. New ids are taken into the text once they decode to whole characters (vLLM and TGI
detokenize the same way). The text equals the tokenizer's decode of all the ids
(tests/test_engine.py holds it to that on byte-level BPE and on Llama-2's Metaspace with byte
fallback), but for one case: a run of byte-fallback tokens that is not UTF-8, where the decoder
replaces every byte of the run and the stream has already sent the valid ones before the bad one.
"""
from __future__ import annotations

from ..tokenizer import Tokenizer

# A UTF-8 character is at most 4 bytes, so more undecodable tokens than this waiting at the end
# are broken bytes, not a character still arriving: they go into the text as U+FFFD.
MAX_PENDING = 8


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._borders = [border_table(s) for s in self.stop]
        self.ids: list[int] = []
        self.full = ""          # decoded text of ids[:read]
        self.text = ""          # generated text so far, cut before a stop string
        self.sent = 0           # characters already handed out by ``new_text``
        self.final = False
        self.stopped = False
        self._prefix = self._read = 0

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string appeared (the text is cut before it)."""
        self.ids.append(token)
        self._take(force=len(self.ids) - self._read > MAX_PENDING)
        return self.stopped

    def finish(self) -> None:
        """The reply ended: what is still waiting (an unfinished character) goes into the text."""
        if not self.stopped:
            self._take(force=True)
        self.final = True

    def new_text(self) -> str:
        """Text that is safe to emit now and was not emitted before."""
        safe = len(self.text) if self.final else len(self.text) - self._held_back()
        out = self.text[self.sent:max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return out

    # ----- inside ------------------------------------------------------------------------
    def _take(self, force: bool) -> None:
        if self._read == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.ids[self._prefix:])
        if not force and (len(after) <= len(before) or after.endswith("\ufffd")):
            return                                                  # no whole character yet
        if not after.startswith(before):                            # the context decoded otherwise: no window
            self._prefix, before, after = 0, self.full, self.tokenizer.decode(self.ids)
        start = len(self.full)
        self.full += after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self._cut(start)

    def _cut(self, start: int) -> None:
        """Find a stop string in what ``start`` began: none ended before it, or generation would have stopped."""
        hits = [i for s in self.stop if (i := self.full.find(s, max(0, start - len(s) + 1))) >= 0]
        self.stopped = bool(hits)
        self.text = self.full[:min(hits)] if hits else self.full

    def _held_back(self) -> int:
        """The longest end of the text that begins some stop string (it may yet complete it)."""
        return max((overlap(self.text, s, border) for s, border in zip(self.stop, self._borders)), default=0)


def border_table(s: str) -> list[int]:
    """border[i]: length of the longest proper prefix of s[:i + 1] that is also its suffix (KMP)."""
    border, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border


def overlap(text: str, s: str, border: list[int]) -> int:
    """Length of the longest proper prefix of s that text ends with: linear in len(s), where trying
    each length with endswith is quadratic (a 10K-character stop string took seconds a token)."""
    k = 0
    for ch in text[max(0, len(text) - len(s) + 1):] if len(s) > 1 else "":   # s itself cannot fit in there
        while k and s[k] != ch:
            k = border[k - 1]
        if s[k] == ch:
            k += 1
    return k
