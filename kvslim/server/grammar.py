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


def json_grammar(schema: dict | None, prefix: str = "") -> str:
    """Any JSON object (``json_object``) or one matching ``schema``, after the literal ``prefix``."""
    import llguidance
    schema = schema or {"type": "object"}
    try:
        if not prefix:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)       # checks the schema
    except Exception as err:                                          # llguidance reports schema errors so
        raise ApiError(400, f"invalid JSON schema: {err}", param="response_format") from None
    return f"start: {json.dumps(prefix)} value\nvalue: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}\n"


# when the prompt left a thinking block open, a forced reply first closes it (empty), as the template
# re-renders a turn without reasoning, so the next turn's prompt still starts with these exact tokens
CLOSE_THINKING = "\n</think>\n\n"


def tool_call_grammar(tools: list[dict], name: str | None = None, xml: bool = False, prefix: str = "") -> str:
    """One ``<tool_call>`` block calling ``name`` (or any of ``tools``) with valid arguments: Qwen3's JSON
    object, or with ``xml`` Qwen3.5's ``<function=...>`` form (the one the chat template teaches)."""
    if xml:
        return xml_tool_call_grammar(tools, name).replace("start: ", f"start: {json.dumps(prefix)} " if prefix
                                                           else "start: ", 1)
    options = []
    for tool in tools:
        fn = tool.get("function") or {}
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn.get("name")}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_LAYOUT}
    head = json.dumps(prefix + "<tool_call>\n")
    return f'start: {head} call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'


def xml_tool_call_grammar(tools: list[dict], name: str | None = None) -> str:
    """Lark for ``<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>``:
    required parameters in schema order, then optional ones each at most once in order; a string value
    is raw text without ``<``, any other value JSON matching its schema."""
    fns = [t.get("function") or {} for t in tools]
    fns = [f for f in fns if name is None or f.get("name") == name]
    rules = [f'start: "<tool_call>\\n<function=" ({" | ".join(f"f{i}" for i in range(len(fns)))}) '
             f'"</function>\\n</tool_call>"']
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            rules += xml_param_rules(f"p{i}_{j}", key, schema if isinstance(schema, dict) else {})
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        rules.append(f"f{i}: {json.dumps(fn.get('name', '') + '>' + chr(10))} {' '.join(parts)}")
    return "\n".join(rules) + "\n"


def xml_param_rules(rule: str, key: str, schema: dict) -> list[str]:
    head = json.dumps(f"<parameter={key}>\n")
    if schema.get("type") == "string":                                # raw text up to the closing tag
        return [f"{rule}: {head} /[^<]*\\n<\\/parameter>\\n/"]
    value = json.dumps({**schema, "x-guidance": JSON_LAYOUT})
    return [f"{rule}: {head} {rule}_v \"\\n</parameter>\\n\"", f"{rule}_v: %json {value}"]
