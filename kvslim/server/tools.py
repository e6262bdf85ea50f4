"""Qwen-style tool calls in generated text, as OpenAI ``tool_calls``.

Qwen (Hermes-style) templates ask the model to answer with
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks.
"""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split generated text into plain content and OpenAI tool calls (malformed blocks stay as text)."""
    calls, kept, last = [], [], 0
    for m in BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[last:m.start()])
        calls.append(call)
        last = m.end()
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _call(payload: str) -> dict | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def template_messages(messages: list[dict]) -> list[dict]:
    """Tool-call arguments arrive as JSON strings; templates render them as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    fn = dict(call.get("function", call))
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn, "name": fn.get("name"), "arguments": fn.get("arguments")}


class ToolStreamFilter:
    """While streaming with tools, content before a ``<tool_call>`` flows; from it on, text is held
    until the end, when the calls are parsed."""

    def __init__(self):
        self.held = ""
        self.in_call = False

    def feed(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        buf = self.held + text
        at = buf.find(OPEN)
        if at >= 0:
            self.in_call, self.held = True, buf[at:]
            return buf[:at]
        keep = max((n for n in range(1, len(OPEN)) if buf.endswith(OPEN[:n])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[dict]]:
        """Remaining content and the parsed calls."""
        return parse_tool_calls(self.held)
