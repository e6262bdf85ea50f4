"""OpenAI request validation and response shapes.

Every user mistake becomes an :class:`ApiError` in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``; nothing a client sends
reaches the engine unchecked.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


NUMBER = (int, float)
# field -> accepted types; fields outside these tables are refused, as OpenAI does
COMMON_FIELDS = {
    "model": str, "max_tokens": (int, type(None)), "temperature": NUMBER + (type(None),),
    "top_p": NUMBER + (type(None),), "n": (int, type(None)), "stream": (bool, type(None)),
    "stream_options": (dict, type(None)), "stop": (str, list, type(None)), "seed": (int, type(None)),
    "presence_penalty": NUMBER + (type(None),), "frequency_penalty": NUMBER + (type(None),),
    "user": (str, type(None)), "logprobs": (bool, type(None)), "metadata": (dict, type(None)),
    "store": (bool, type(None)), "service_tier": (str, type(None)),
    # llama.cpp's extensions that clients written for llama-server send
    "top_k": (int, type(None)), "min_p": NUMBER + (type(None),), "repeat_penalty": NUMBER + (type(None),),
    "repeat_last_n": (int, type(None)), "n_predict": (int, type(None)), "cache_prompt": (bool, type(None)),
}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": list, "max_completion_tokens": (int, type(None)),
               "tools": (list, type(None)), "tool_choice": (str, dict, type(None)),
               "parallel_tool_calls": (bool, type(None)), "response_format": (dict, type(None)),
               "top_logprobs": (int, type(None))}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": (str, list), "echo": (bool, type(None)),
                     "suffix": (str, type(None)), "best_of": (int, type(None))}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GenerationRequest:
    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    stream: bool = False
    include_usage: bool = False
    messages: list[dict] = field(default_factory=list)
    prompt: str | list[int] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


def check_fields(body, allowed: dict) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")
        if not type_ok(value, allowed[name]):
            raise ApiError(400, f"'{name}' has the wrong type: got {type(value).__name__}", param=name,
                           code="invalid_type")


def type_ok(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types:               # JSON true is not a number here
        return False
    return isinstance(value, types)


def parse_sampling(body: dict) -> SamplingParams:
    """OpenAI's defaults (temperature 1, top_p 1) with llama.cpp's extensions off unless given."""
    def get(name, default):
        return default if body.get(name) is None else body[name]
    ranges = [("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
              ("min_p", 0, 1)]
    for name, lo, hi in ranges:
        if body.get(name) is not None and not lo <= body[name] <= hi:
            raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {body[name]}", param=name,
                           code="invalid_value")
    try:
        return SamplingParams(temperature=get("temperature", 1.0), top_k=get("top_k", 0), top_p=get("top_p", 1.0),
                              min_p=get("min_p", 0.0), repeat_penalty=get("repeat_penalty", 1.0),
                              repeat_last_n=get("repeat_last_n", 64),
                              presence_penalty=get("presence_penalty", 0.0),
                              frequency_penalty=get("frequency_penalty", 0.0), seed=body.get("seed"))
    except ValueError as err:
        raise ApiError(400, str(err), code="invalid_value") from None


def parse_common(body: dict, allowed: dict) -> GenerationRequest:
    check_fields(body, allowed)
    if "model" not in body:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
    if body.get("logprobs"):
        raise ApiError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", body.get("n_predict")))
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens",
                       code="invalid_value")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops) or len(stops) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", param="stop")
    options = body.get("stream_options") or {}
    return GenerationRequest(body["model"], max_tokens, parse_sampling(body), stops, bool(body.get("stream")),
                             bool(options.get("include_usage")))


def parse_chat(body: dict) -> GenerationRequest:
    req = parse_common(body, CHAT_FIELDS)
    fmt = (body.get("response_format") or {}).get("type", "text")
    if fmt != "text":
        raise ApiError(400, f"response_format {fmt!r} is not supported (only 'text')", param="response_format",
                       code="unsupported_value")
    req.messages = [check_message(i, m) for i, m in enumerate(body["messages"])] if "messages" in body else []
    if not req.messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    req.tools, req.tool_choice = body.get("tools"), body.get("tool_choice")
    if req.tool_choice not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice must be 'auto' or 'none' (forcing a call is not supported yet)",
                       param="tool_choice", code="unsupported_value")
    if req.tool_choice == "none":
        req.tools = None
    return req


def check_message(i: int, m) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"messages[{i}] must be an object with a role in {', '.join(ROLES)}",
                       param=f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):                                    # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ApiError(400, f"messages[{i}]: only text content parts are supported", param=f"messages[{i}]")
        content = "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                       param=f"messages[{i}].content")
    if content is None and not m.get("tool_calls"):
        raise ApiError(400, f"messages[{i}] has no content", param=f"messages[{i}].content")
    out = {"role": m["role"], "content": content or ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if key in m:
            out[key] = m[key]
    return out


def parse_completion(body: dict) -> GenerationRequest:
    req = parse_common(body, COMPLETION_FIELDS)
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise ApiError(400, "echo, suffix and best_of are not supported", code="unsupported_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(400, "'prompt' must be a string, a one-string list or a list of token ids",
                           param="prompt")
    if prompt is None or prompt == "":
        raise ApiError(400, "'prompt' is required and must not be empty", param="prompt")
    req.prompt = prompt
    if req.max_tokens is None:
        req.max_tokens = 16                                           # OpenAI's default for completions
    return req


# ----- responses ------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(seq) -> dict:
    n_prompt, n_gen = len(seq.prompt), len(seq.generated)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens}}


def chat_response(rid: str, model: str, message: dict, finish_reason: str, seq, timings: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage(seq), "timings": timings}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, seq=None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
    if seq is not None:
        out["usage"] = usage(seq)
    return out


def usage_chunk(rid: str, model: str, obj: str, seq) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(seq)}
