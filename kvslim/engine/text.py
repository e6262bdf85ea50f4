"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from the generated ids (byte-level BPE may split a
character across tokens), and what is emitted holds back both an incomplete
UTF-8 character and any tail that could still grow into a stop string.
"""
from __future__ import annotations

from ..tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""          # generated text so far, cut before a stop string
        self.sent = 0           # characters already handed out by ``new_text``
        self.final = False

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string appeared (the text is cut before it)."""
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        self.text = full[:min(hits)] if hits else full
        return bool(hits)

    def finish(self) -> None:
        self.final = True

    def new_text(self) -> str:
        """Text that is safe to emit now and was not emitted before."""
        safe = len(self.text) if self.final else len(self.text) - self._held_back()
        out = self.text[self.sent:max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return out

    def _held_back(self) -> int:
        text = self.text
        held = len(text) - len(text.rstrip("\ufffd"))               # an incomplete UTF-8 character
        for s in self.stop:                                         # a stop string may be starting
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held
