"""Generated chat text split into reasoning, content and tool calls, as it streams.

Qwen3/3.5/3.6 templates open a thinking block with ``<think>`` (often already in
the prompt: the generation prompt ends with ``<think>\\n``) and close it with
``</think>``. Tool calls come in two shapes:

- Qwen3 (Hermes JSON): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``
- Qwen3.5/3.6 (XML): ``<tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>``; a string value is written raw, anything else as JSON.

:class:`OutputParser` takes text in any pieces (a tag may be split across
tokens) and yields :class:`Delta` s as soon as they are certain: reasoning and
content text, a call's name when known, its arguments as JSON text fragments
(XML parameters are converted to one JSON object). The concatenated deltas
are the same however the text was split, so a stream and a one-shot reply agree.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
REASONING_FORMATS = ("auto", "none", "deepseek")
# the head of a Qwen3 JSON call, up to the start of its arguments value
JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def tag_argument(head: str, opener: str) -> tuple[str, str] | None:
    """``<function=NAME>rest`` (``opener`` up to the ``=``) -> (NAME, rest); None until ``>`` arrives."""
    end = head.find(">")
    return None if end < 0 else (head[len(opener):end].strip(), head[end + 1:])


@dataclass
class Delta:
    """One certain piece of output: ``kind`` is "reasoning", "content", "tool_start" (``name``)
    or "tool_args" (``text``, a fragment of the call's JSON arguments); ``index`` numbers calls."""
    kind: str
    text: str = ""
    index: int = 0
    name: str = ""


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (it may still become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def param_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """{function: {parameter: JSON-schema type}} from OpenAI ``tools``, to type XML parameter values."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name")] = {k: v.get("type") if isinstance(v, dict) else None for k, v in props.items()}
    return out


class OutputParser:
    """Incremental parser of one reply. ``feed`` text pieces, then ``finish`` once; each returns deltas.

    Args:
        reasoning: split ``<think>`` blocks into reasoning (False: ``--reasoning-format none``).
        thinking_open: the prompt already opened the block (the reply starts inside it).
        tools: OpenAI tools of the request, or None to leave ``<tool_call>`` text as content.
    """

    def __init__(self, reasoning: bool = True, thinking_open: bool = False, tools: list[dict] | None = None):
        self.reasoning, self.with_tools = reasoning, tools is not None
        self.types = param_types(tools)
        self.state = "think" if reasoning and thinking_open else ("start" if reasoning else "content")
        self.buf = ""
        self.final = False
        self.n_calls = 0
        self.skip_space = self.state == "think"      # whitespace that opens a block is dropped
        self.call: dict = {}                         # the call being parsed (format, name, args state)

    # ----- public ------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        return self._run()

    def finish(self) -> list[Delta]:
        self.final = True
        out = self._run()
        return out + self._flush()

    # ----- the state machine ---------------------------------------------------------------
    def _run(self) -> list[Delta]:
        out: list[Delta] = []
        while True:
            step = getattr(self, "_" + self.state)(out)
            if not step:                              # needs more text
                return out

    def _start(self, out) -> bool:
        """Before the reply's first text: does it open a thinking block?"""
        head = self.buf.lstrip()
        if head.startswith(THINK_OPEN):
            self.buf, self.state, self.skip_space = head[len(THINK_OPEN):], "think", True
            return True
        if not self.final and THINK_OPEN.startswith(head):
            return False
        self.state = "content"
        return True

    def _leading_space_done(self) -> bool:
        """Drop the whitespace after a tag; False while nothing but whitespace has arrived."""
        if self.skip_space:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.skip_space = False
        return True

    def _think(self, out) -> bool:
        if not self._leading_space_done():
            return False
        at = self.buf.find(THINK_CLOSE)
        if at >= 0:
            self._emit(out, "reasoning", self.buf[:at].rstrip())
            self.buf, self.state, self.skip_space = self.buf[at + len(THINK_CLOSE):], "content", True
            return True
        self._emit_safe(out, "reasoning", THINK_CLOSE)
        return False

    def _content(self, out) -> bool:
        if not self._leading_space_done():
            return False
        if not self.with_tools:
            self._emit(out, "content", self.buf)
            self.buf = ""
            return False
        at = self.buf.find(CALL_OPEN)
        if at < 0:
            self._emit_safe(out, "content", CALL_OPEN)
            return False
        before = self.buf[:at]
        self._emit(out, "content", before.rstrip())
        self.buf, self.state = self.buf[at + len(CALL_OPEN):], "call_head"
        return True

    def _emit_safe(self, out, kind: str, tag: str) -> None:
        """Emit the buffer except what may still become ``tag`` and trailing whitespace."""
        keep = partial_suffix(self.buf, tag)
        text = self.buf[:len(self.buf) - keep].rstrip()          # held whitespace may end the block
        self._emit(out, kind, text)
        self.buf = self.buf[len(text):]

    def _emit(self, out, kind: str, text: str, **extra) -> None:
        if text or kind.startswith("tool"):
            out.append(Delta(kind, text, **extra))

    # ----- tool calls ------------------------------------------------------------------------
    def _call_head(self, out) -> bool:
        """After ``<tool_call>``: JSON object or ``<function=name>``?"""
        head = self.buf.lstrip()
        if head.startswith("{"):
            self.state, self.call = "json_head", {"format": "json"}
            return True
        if head.startswith(FUNCTION_OPEN):
            tag = tag_argument(head, FUNCTION_OPEN)
            if tag is None:
                return False
            self._start_call(out, tag[0])
            self.buf, self.state = tag[1], "xml_params"
            self.call.update(format="xml", n_params=0)
            return True
        if not self.final and (not head or FUNCTION_OPEN.startswith(head)):
            return False
        self._emit(out, "content", CALL_OPEN + self.buf)          # not a call after all: keep it as text
        self.buf, self.state = "", "content"
        return True

    def _start_call(self, out, name: str) -> None:
        self._emit(out, "tool_start", "", index=self.n_calls, name=name)
        self.call = {"name": name}
        self.n_calls += 1

    def _args(self, out, text: str) -> None:
        self._emit(out, "tool_args", text, index=self.n_calls - 1)

    def _json_head(self, out) -> bool:
        m = JSON_HEAD.match(self.buf)
        if m:
            self._start_call(out, json.loads(f'"{m.group(1)}"'))
            self.buf, self.state = self.buf[m.end():], "json_args"
            self.call.update(format="json", depth=0, in_string=False, escape=False, started=False)
            return True
        at = self.buf.find(CALL_CLOSE)
        if at < 0 and not self.final:
            return False
        return self._json_whole(out, self.buf[:at] if at >= 0 else self.buf, at)

    def _json_whole(self, out, payload: str, at: int) -> bool:
        """A call whose keys come in another order: parsed whole once closed."""
        try:
            obj = json.loads(payload)
            assert isinstance(obj, dict) and isinstance(obj.get("name"), str)
        except (ValueError, AssertionError):
            self._emit(out, "content", CALL_OPEN + self.buf)
            self.buf, self.state = "", "content"
            return True
        self._start_call(out, obj["name"])
        args = obj.get("arguments", {})
        self._args(out, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self.buf = self.buf[at + len(CALL_CLOSE):] if at >= 0 else ""
        self.state, self.skip_space = "content", True
        return True

    def _json_args(self, out) -> bool:
        """Stream the arguments value's text up to where its JSON ends (a string value: decoded, whole)."""
        c = self.call
        if not c["started"]:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            c.update(started=True, as_string=self.buf[0] == '"', scanned=0, sent=0)
        end = self._scan_json()
        if end < 0:
            if not c["as_string"]:
                self._args(out, self.buf[c["sent"]:])
                c["sent"] = len(self.buf)
            return False
        value = self.buf[:end]
        self._args(out, json.loads(value) if c["as_string"] else value[c["sent"]:])
        self.buf, self.state = self.buf[end:], "call_tail"
        return True

    def _scan_json(self) -> int:
        """Where the JSON value at the start of the buffer ends (-1: not yet); resumes where it stopped."""
        c = self.call
        for i in range(c["scanned"], len(self.buf)):
            ch = self.buf[i]
            if c["in_string"]:
                c["escape"] = not c["escape"] and ch == "\\"
                c["in_string"] = c["escape"] or ch != '"'
            elif ch == '"':
                c["in_string"] = True
            elif ch in "{[":
                c["depth"] += 1
            elif ch in "}]":
                c["depth"] -= 1
            if c["depth"] == 0 and not c["in_string"]:
                return i + 1
        c["scanned"] = len(self.buf)
        return -1

    def _call_tail(self, out) -> bool:
        """Whatever closes the call (``}`` of the JSON object, ``</function>``) up to ``</tool_call>``."""
        at = self.buf.find(CALL_CLOSE)
        if at < 0:
            return False
        self.buf, self.state, self.skip_space = self.buf[at + len(CALL_CLOSE):], "content", True
        return True

    def _xml_params(self, out) -> bool:
        head = self.buf.lstrip()
        if head.startswith(PARAM_OPEN):
            tag = tag_argument(head, PARAM_OPEN)
            if tag is None:
                return False
            self._open_param(out, tag[0])
            self.buf, self.state = tag[1], "xml_value"
            return True
        if head.startswith(FUNCTION_CLOSE) or head.startswith(CALL_CLOSE) or (self.final and not head.strip()):
            self._args(out, "}" if self.call["n_params"] else "{}")
            self.state = "call_tail"
            return True
        if not self.final and (not head or any(t.startswith(head) for t in (PARAM_OPEN, FUNCTION_CLOSE))):
            return False
        self.buf = head[1:]                                      # stray text inside the function: skipped
        return True

    def _open_param(self, out, key: str) -> None:
        c = self.call
        ptype = self.types.get(c["name"], {}).get(key)
        c.update(key=key, streamed=ptype == "string", value="", opened=False)
        prefix = "{" if c["n_params"] == 0 else ", "
        c["n_params"] += 1
        self._args(out, prefix + json.dumps(key, ensure_ascii=False) + ": " + ('"' if c["streamed"] else ""))

    def _xml_value(self, out) -> bool:
        c = self.call
        if not c["opened"]:                                      # one newline follows the tag
            if not self.buf:
                return False
            self.buf, c["opened"] = self.buf[1:] if self.buf[0] == "\n" else self.buf, True
        at = self.buf.find(PARAM_CLOSE)
        if at < 0:
            keep = max(partial_suffix(self.buf, "\n" + PARAM_CLOSE), partial_suffix(self.buf, PARAM_CLOSE))
            self._value_text(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        raw = self.buf[:at]
        self._value_text(out, raw[:-1] if raw.endswith("\n") else raw)
        self._close_param(out)
        self.buf, self.state = self.buf[at + len(PARAM_CLOSE):], "xml_params"
        return True

    def _value_text(self, out, text: str) -> None:
        if self.call["streamed"]:
            if text:
                self._args(out, json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self.call["value"] += text

    def _close_param(self, out) -> None:
        c = self.call
        if c["streamed"]:
            self._args(out, '"')
            return
        try:
            value = json.dumps(json.loads(c["value"]), ensure_ascii=False)
        except ValueError:
            value = json.dumps(c["value"], ensure_ascii=False)      # not JSON: the raw text is a string
        self._args(out, value)

    # ----- the end ----------------------------------------------------------------------------
    def _flush(self) -> list[Delta]:
        """Text left when the reply ended (inside a block, or cut by max_tokens)."""
        out: list[Delta] = []
        rest = self.buf
        if self.state in ("start", "content"):
            self._emit(out, "content", rest if self.n_calls == 0 or rest.strip() else "")
        elif self.state == "think":
            self._emit(out, "reasoning", rest.rstrip())
        elif self.state in ("call_head", "json_head"):
            self._emit(out, "content", CALL_OPEN + rest)
        self.buf = ""
        return out


@dataclass
class ParsedReply:
    """Deltas put together: what a non-streamed reply returns."""
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)           # [{"name": ..., "arguments": JSON text}]

    def add(self, deltas: list[Delta]) -> "ParsedReply":
        for d in deltas:
            if d.kind == "reasoning":
                self.reasoning += d.text
            elif d.kind == "content":
                self.content += d.text
            elif d.kind == "tool_start":
                self.calls.append({"name": d.name, "arguments": ""})
            else:
                self.calls[d.index]["arguments"] += d.text
        return self


def parse_reply(text: str, reasoning: bool = True, thinking_open: bool = False,
                tools: list[dict] | None = None) -> ParsedReply:
    """The whole reply at once (what the stream's deltas add up to)."""
    p = OutputParser(reasoning, thinking_open, tools)
    return ParsedReply().add(p.feed(text) + p.finish())


def thinking_opened(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` block (the reply continues it)."""
    at = prompt.rfind(THINK_OPEN)
    return at >= 0 and THINK_CLOSE not in prompt[at:] and not prompt[at + len(THINK_OPEN):].strip()
