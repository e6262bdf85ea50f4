"""Constrained decoding: ``response_format`` JSON and forced tool calls, through llguidance.

A grammar becomes a per-sequence :class:`GrammarConstraint` that the sampler
asks for a token mask before each draw and tells each drawn token. llguidance
was picked over xgrammar by measurement (``benchmarks/grammar_mask.py``):
per-token mask cost on CPU with an 8K and a 150K vocabulary.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import torch

from .openai_api import ApiError

# no whitespace beyond the separators: a free choice of whitespace lets a model ramble in it forever
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarConstraint:
    """One sequence's grammar state (llguidance's ``LLMatcher``)."""

    def __init__(self, matcher, n_vocab: int):
        self.matcher, self.n_vocab = matcher, n_vocab

    def allowed(self, n_vocab: int) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self._check()
        keep = torch.zeros(n_vocab, dtype=torch.bool)
        n = min(n_vocab, self.n_vocab)
        keep[:n] = torch.from_numpy(bits[:n].astype(bool))
        return keep

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")


class Grammars:
    """Builds constraints for one tokenizer; the llguidance tokenizer is made once, on first use."""

    def __init__(self, tokenizer, n_vocab: int, eos_id: int):
        self.tokenizer, self.n_vocab, self.eos_id = tokenizer, n_vocab, eos_id
        self._lltok = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        import llguidance
        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.n_vocab,
                                                     eos_token=self.eos_id)
        return self._lltok

    def constraint(self, grammar: str, param: str) -> GrammarConstraint:
        """A fresh constraint; an invalid grammar (e.g. a bad JSON schema) is the client's error."""
        import llguidance
        matcher = llguidance.LLMatcher(self.lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ApiError(400, f"cannot use this {param}: {matcher.get_error()}", param=param)
        return GrammarConstraint(matcher, self.n_vocab)


def json_grammar(schema: dict | None) -> str:
    """Any JSON object (``json_object``) or one matching ``schema``."""
    import llguidance
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=JSON_LAYOUT)
    except Exception as err:                                          # llguidance reports schema errors so
        raise ApiError(400, f"invalid JSON schema: {err}", param="response_format") from None


def tool_call_grammar(tools: list[dict], name: str | None = None) -> str:
    """One Qwen/Hermes ``<tool_call>`` block calling ``name`` (or any of ``tools``) with valid arguments."""
    options = []
    for tool in tools:
        fn = tool.get("function") or {}
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn.get("name")}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_LAYOUT}
    return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
