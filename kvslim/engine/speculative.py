"""Prompt-lookup drafts for speculative decoding (vLLM's "ngram" method, llama.cpp's lookup).

An agent that edits code, or a model that quotes its input, writes long runs of tokens that
already stand in its context. The draft is what followed the latest earlier occurrence of the
context's last few tokens; the engine runs the pending token and the draft through one forward
and keeps the draft's tokens for as long as the sampler, drawing from those logits, picks
them (``Engine._speculate``). Every kept token is the one the sampler drew, so the output is
what decoding one token at a time gives: the same distribution, and with the C step (which reads
the chunk as rows of one-token steps, ``DecodeStep.chunk``) the same bits; through a prompt-sized
forward, greedy tokens up to its rounding against a one-token step's.
"""
from __future__ import annotations

NGRAM_MIN, NGRAM_MAX = 2, 3       # suffix lengths tried, longest first (vLLM's prompt_lookup_min/max)


class PromptLookup:
    """One sequence's n-gram index: for each n-gram of its tokens (lengths NGRAM_MIN..NGRAM_MAX),
    the position after its latest occurrence, updated as tokens are added (each token is
    indexed once, so a draft costs a few dictionary lookups, not a scan of the context)."""

    def __init__(self):
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0                  # n-grams ending before this position are in ``after``

    def draft(self, tokens: list[int], n_max: int) -> list[int]:
        """Up to ``n_max`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` seen before; [] when there is none."""
        self._index(tokens)
        for n in range(min(NGRAM_MAX, len(tokens)), NGRAM_MIN - 1, -1):
            start = self.after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + n_max]
        return []

    def _index(self, tokens: list[int]) -> None:
        """Add the n-grams that end before the last token (the suffix itself must not match)."""
        if len(tokens) - 1 < self.indexed:        # tokens were removed: index again from the start
            self.after, self.indexed = {}, 0
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end + 1 >= n:
                    self.after[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)
