"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the same engine path.

A Messages request becomes the same :class:`GenerationRequest` a chat
completion does (system, turns, ``tool_use`` / ``tool_result`` blocks, thinking
blocks mapped onto the chat template's messages), so rendering, prefix reuse,
scheduling and the reply parser are shared; only the request and response
shapes differ. Streams use Anthropic's event types (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``, ``ping``, ``error``).
"""
from __future__ import annotations

import json
import logging
import uuid

from . import openai_api as api
from .parsing import Delta
from .responder import Choice, Responder

log = logging.getLogger("kvslim.server")
NUMBER = (int, float)
OPTIONAL = type(None)
FIELDS = {"model": str, "messages": list, "max_tokens": int, "system": (str, list, OPTIONAL),
          "stop_sequences": (list, OPTIONAL), "stream": (bool, OPTIONAL), "temperature": NUMBER + (OPTIONAL,),
          "top_p": NUMBER + (OPTIONAL,), "top_k": (int, OPTIONAL), "tools": (list, OPTIONAL),
          "tool_choice": (dict, OPTIONAL), "thinking": (dict, OPTIONAL), "metadata": (dict, OPTIONAL),
          "service_tier": (str, OPTIONAL)}
COUNT_FIELDS = {k: FIELDS[k] for k in ("model", "messages", "system", "tools", "tool_choice", "thinking")}
# Anthropic's error types by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: api.ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


# ----- requests ------------------------------------------------------------------------------
def parse_messages(body, strict: bool = False, counting: bool = False) -> api.GenerationRequest:
    """A Messages request as the server's generation request (``counting``: count_tokens' subset)."""
    api.check_fields(body, COUNT_FIELDS if counting else FIELDS, strict)
    for name in ("model", "messages") + (() if counting else ("max_tokens",)):
        if name not in body:
            raise api.ApiError(400, f"{name}: Field required", param=name)
    if not counting and body["max_tokens"] < 1:
        raise api.ApiError(400, f"max_tokens: must be at least 1, got {body['max_tokens']}", param="max_tokens")
    if body.get("temperature") is not None and not 0 <= body["temperature"] <= 1:
        raise api.ApiError(400, "temperature: must be between 0 and 1", param="temperature")
    stops = body.get("stop_sequences") or []
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise api.ApiError(400, "stop_sequences: must be a list of at most 16 non-empty strings")
    sampling = api.parse_sampling({k: body.get(k) for k in ("temperature", "top_p", "top_k")})
    req = api.GenerationRequest(body["model"], body.get("max_tokens"), sampling, list(stops), bool(body.get("stream")))
    req.messages = system_messages(body.get("system")) + turn_messages(body["messages"])
    req.tools = convert_tools(body.get("tools"))
    req.tool_choice = convert_tool_choice(body.get("tool_choice"), req.tools)
    req.template_kwargs = thinking_kwargs(body.get("thinking"))
    return req


def text_of(blocks, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in blocks):
        return "\n".join(b["text"] for b in blocks)
    raise api.ApiError(400, f"{where}: expected a string or a list of text blocks", param=where)


def system_messages(system) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": text_of(system, "system")}]


def turn_messages(turns: list) -> list[dict]:
    if not turns:
        raise api.ApiError(400, "messages: at least one message is required", param="messages")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise api.ApiError(400, f"messages.{i}: role must be 'user' or 'assistant'", param=f"messages.{i}")
        content = turn.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise api.ApiError(400, f"messages.{i}.content: expected a string or a list of blocks")
        out += (user_turn if turn["role"] == "user" else assistant_turn)(blocks, f"messages.{i}.content")
    return out


def user_turn(blocks: list, where: str) -> list[dict]:
    """Tool results become tool messages (the template groups them into one turn); text a user message."""
    tools, texts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            content = b.get("content", "")
            text = text_of(content, f"{where}.{j}.content") if content not in (None, []) else ""
            tools.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                          "content": ("Error: " + text) if b.get("is_error") else text})
        else:
            raise api.ApiError(400, f"{where}.{j}: block type {kind!r} is not supported in a user turn "
                                    f"(text and tool_result are)", param=f"{where}.{j}")
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts or not tools else [])


BLOCK_FIELDS = {"text": "'text' as a string", "thinking": "'thinking' as a string",
                "tool_use": "'name' as a string and 'input' as a JSON object"}


def assistant_turn(blocks: list, where: str) -> list[dict]:
    """Text, thinking (kept as reasoning_content so the prompt re-renders as generated) and tool_use."""
    texts, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        elif kind in BLOCK_FIELDS:                                     # a known block with a field of the wrong type
            raise api.ApiError(400, f"{where}.{j}: a {kind} block needs {BLOCK_FIELDS[kind]}", param=f"{where}.{j}")
        else:
            raise api.ApiError(400, f"{where}.{j}: block type {kind!r} is not supported in an assistant turn "
                                    f"(text, thinking and tool_use are)", param=f"{where}.{j}")
    message = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return [message]


def convert_tools(tools: list | None) -> list[dict] | None:
    """Client tools ({name, description, input_schema}) as OpenAI function tools; server tools are skipped."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise api.ApiError(400, f"tools.{i}: a tool needs a name", param=f"tools.{i}")
        if "input_schema" not in t:                              # Anthropic-hosted tools (web search, ...)
            log.warning("ignoring tool %r: no input_schema (server tools are not available here)", t["name"][:64])
            continue
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t["input_schema"]}})
    return out or None


def convert_tool_choice(choice: dict | None, tools: list[dict] | None) -> str | None:
    """auto / any / tool / none as the chat path's "auto", "required", "function:NAME", "none"."""
    if choice is None:
        return None
    kind, names = choice.get("type"), [t["function"]["name"] for t in tools or []]
    if kind in ("any", "tool") and not names:
        raise api.ApiError(400, f"tool_choice {kind!r} needs tools", param="tool_choice")
    if kind == "tool":
        if choice.get("name") not in names:
            raise api.ApiError(400, f"tool_choice names tool {choice.get('name')!r}, which is not in tools",
                               param="tool_choice")
        return "function:" + choice["name"]
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise api.ApiError(400, "tool_choice.type must be auto, any, tool or none", param="tool_choice")
    return mapped


def thinking_kwargs(thinking: dict | None) -> dict:
    """``thinking`` switches the template's ``enable_thinking``; without it the template's default holds."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise api.ApiError(400, "thinking.type must be enabled, disabled or adaptive", param="thinking")
    return {"enable_thinking": kind != "disabled"}


# ----- responses ---------------------------------------------------------------------------------
def usage(seq) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from the ones it processed."""
    cached = seq.cached_tokens
    return {"input_tokens": len(seq.prompt) - cached, "output_tokens": len(seq.generated),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def matched_stop(seq, stops: list[str], tokenizer) -> str | None:
    """The stop sequence that ended the reply, if one did (the text is cut just before it)."""
    if seq.finish_reason != "stop" or not stops:
        return None
    full, cut = tokenizer.decode(seq.generated), seq.text.text
    return next((s for s in stops if full.startswith(s, len(cut))), None)


def stop_reason(choice: Choice, stops: list[str], tokenizer) -> tuple[str, str | None]:
    if choice.reply.calls:
        return "tool_use", None
    if choice.seq.finish_reason == "length":
        return "max_tokens", None
    stop = matched_stop(choice.seq, stops, tokenizer)
    return ("stop_sequence", stop) if stop else ("end_turn", None)


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesResponder(Responder):
    """The chat reply (reasoning, text, calls) as an Anthropic message or event stream."""
    id_prefix = "toolu"

    def __init__(self, state, req: api.GenerationRequest, jobs: list, events, kind: str = "chat"):
        super().__init__(state, req, jobs, events, kind)
        self.rid, self.model = f"msg_{uuid.uuid4().hex[:24]}", req.model
        self.block: tuple[str, int] | None = None                 # the open content block: (kind, index)
        self.n_blocks = 0

    def error_body(self, err: api.ApiError) -> dict:
        return error_body(err)

    def final_body(self) -> dict:
        c = self.choices[0]
        r, content = c.reply, []
        if r.reasoning:
            content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
        if r.content:
            content.append({"type": "text", "text": r.content})
        content += [{"type": "tool_use", "id": cid, "name": call["name"], "input": tool_input(call["arguments"])}
                    for call, cid in zip(r.calls, c.call_ids)]
        reason, stop = stop_reason(c, self.req.stop, self.tokenizer)
        return {**self._message(content, reason, stop), "usage": usage(c.seq)}

    def _message(self, content: list, reason: str | None, stop: str | None) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop}

    # ----- a stream ---------------------------------------------------------------------------
    async def sse(self):
        started = False
        try:
            async for choice, event, deltas in self._events():
                if not started:                                    # the job is admitted: cache hit known
                    started = True
                    seq = self.jobs[0].seq
                    start = {**self._message([], None, None), "usage": {**usage(seq), "output_tokens": 0}}
                    yield self._event("message_start", {"message": start})
                    yield self._event("ping", {})
                for out in self._block_events(choice, deltas):
                    yield out
            c = self.choices[0]
            for out in self._close_block():
                yield out
            reason, stop = stop_reason(c, self.req.stop, self.tokenizer)
            yield self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                                "usage": usage(c.seq)})
            yield self._event("message_stop", {})
        except api.ApiError as err:
            yield self._event("error", {"error": error_body(err)["error"]})

    @staticmethod
    def _event(kind: str, data: dict) -> bytes:
        return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}).encode() + b"\n\n"

    def _block_events(self, c: Choice, deltas: list[Delta]) -> list[bytes]:
        out = []
        for d in deltas:
            if d.kind == "tool_start":
                out += self._open_block("tool_use", {"type": "tool_use", "id": c.call_ids[d.index], "name": d.name,
                                                     "input": {}})
                continue
            kind = {"reasoning": "thinking", "content": "text", "tool_args": "tool_use"}[d.kind]
            if self.block is None or self.block[0] != kind:
                out += self._open_block(kind, {"type": kind, kind: ""} if kind == "text" else
                                        {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"thinking": {"type": "thinking_delta", "thinking": d.text},
                     "text": {"type": "text_delta", "text": d.text},
                     "tool_use": {"type": "input_json_delta", "partial_json": d.text}}[kind]
            out.append(self._event("content_block_delta", {"index": self.block[1], "delta": delta}))
        return out

    def _open_block(self, kind: str, block: dict) -> list[bytes]:
        out = self._close_block()
        self.block, self.n_blocks = (kind, self.n_blocks), self.n_blocks + 1
        return out + [self._event("content_block_start", {"index": self.block[1], "content_block": block})]

    def _close_block(self) -> list[bytes]:
        if self.block is None:
            return []
        index, self.block = self.block[1], None
        return [self._event("content_block_stop", {"index": index})]
