"""Messages as chat templates read them, and tool calls as the APIs return them.

Generated text is split into reasoning, content and calls by ``parsing.py``.
"""
from __future__ import annotations

import json
import uuid


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


def call_id(prefix: str = "call") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def openai_call(call: dict, cid: str) -> dict:
    """A parsed call ({"name", "arguments": JSON text}) in OpenAI's ``tool_calls`` shape."""
    return {"id": cid, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
