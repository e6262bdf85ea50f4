"""OpenAI request validation and response shapes.

Every user mistake becomes an :class:`ApiError` in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``; nothing a client sends
reaches the engine unchecked. Unknown fields are ignored and logged once, as
vLLM and llama-server do, unless the server runs with ``--strict``.
"""
from __future__ import annotations

import logging
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
    "store": (bool, type(None)), "service_tier": (str, type(None)), "response_format": (dict, type(None)),
    # llama.cpp's extensions that clients written for llama-server send
    "top_k": (int, type(None)), "min_p": NUMBER + (type(None),), "repeat_penalty": NUMBER + (type(None),),
    "repeat_last_n": (int, type(None)), "n_predict": (int, type(None)), "cache_prompt": (bool, type(None)),
    "ignore_eos": (bool, type(None)),
}
MAX_N = 16
CHAT_FIELDS = {**COMMON_FIELDS, "messages": list, "max_completion_tokens": (int, type(None)),
               "tools": (list, type(None)), "tool_choice": (str, dict, type(None)),
               "parallel_tool_calls": (bool, type(None)), "top_logprobs": (int, type(None)),
               # llama-server's: extra variables for the chat template, and how to return thinking
               "chat_template_kwargs": (dict, type(None)), "reasoning_format": (str, type(None))}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": (str, list), "echo": (bool, type(None)), "logprobs": (int, type(None)),
                     "suffix": (str, type(None)), "best_of": (int, type(None))}
ROLES = ("system", "developer", "user", "assistant", "tool")
log = logging.getLogger("kvslim.server")
_logged_unknown: set[str] = set()


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
    n: int = 1
    response_format: dict | None = None                          # {"type": "json_object" | "json_schema", ...}
    template_kwargs: dict = field(default_factory=dict)          # chat_template_kwargs (enable_thinking, ...)
    reasoning_format: str | None = None                          # None: the server's --reasoning-format
    thinking_open: bool = False                                  # the rendered prompt ends inside <think>


def check_fields(body, allowed: dict, strict: bool = False) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name not in allowed:
            if strict:
                raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                               code="unknown_parameter")
            if name not in _logged_unknown and len(_logged_unknown) < 256:   # once per name, bounded
                _logged_unknown.add(name)
                log.warning("ignoring unknown request field %r (--strict refuses it)", name[:64])
            continue
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
                              frequency_penalty=get("frequency_penalty", 0.0), seed=body.get("seed"),
                              ignore_eos=get("ignore_eos", False))
    except ValueError as err:                # its messages start with the field they refuse
        field = str(err).split(" ", 1)[0]
        raise ApiError(400, str(err), param=field if field in body else None, code="invalid_value") from None


# the first of these that is set caps the reply: OpenAI's current name, its older one, llama-server's
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")


def parse_max_tokens(body: dict) -> int | None:
    """A field sent as null counts as absent: a client may send ``max_completion_tokens: null`` beside
    ``max_tokens: 5``, and the 5 must hold."""
    name = next((n for n in MAX_TOKENS_FIELDS if body.get(n) is not None), None)
    if name is None:
        return None
    if body[name] < 1:
        raise ApiError(400, f"{name} must be at least 1, got {body[name]}", param=name, code="invalid_value")
    return body[name]


def parse_common(body: dict, allowed: dict, strict: bool = False) -> GenerationRequest:
    check_fields(body, allowed, strict)
    if "model" not in body:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    n = 1 if body.get("n") is None else body["n"]
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be in 1..{MAX_N}, got {n}", param="n", code="invalid_value")
    max_tokens = parse_max_tokens(body)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops) or len(stops) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", param="stop")
    options = body.get("stream_options") or {}
    req = GenerationRequest(body["model"], max_tokens, parse_sampling(body), stops, bool(body.get("stream")),
                            bool(options.get("include_usage")), n=n)
    req.response_format = parse_response_format(body.get("response_format"))
    return req


def parse_response_format(fmt: dict | None) -> dict | None:
    """None for plain text; else {"type": "json_object"} or {"type": "json_schema", "schema": {...}}."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ApiError(400, "response_format json_schema needs {'json_schema': {'name', 'schema': {...}}}",
                           param="response_format.json_schema")
        return {"type": "json_schema", "schema": spec.get("schema", {})}
    raise ApiError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                   param="response_format.type", code="invalid_value")


def set_logprobs(req: GenerationRequest, top: int | None, allowed: int, param: str) -> None:
    if top is not None and not 0 <= top <= allowed:
        raise ApiError(400, f"'{param}' must be in 0..{allowed}, got {top}", param=param, code="invalid_value")
    req.sampling.logprobs = top


def parse_chat(body: dict, strict: bool = False) -> GenerationRequest:
    req = parse_common(body, CHAT_FIELDS, strict)
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    if body.get("logprobs"):
        set_logprobs(req, body.get("top_logprobs") or 0, 20, "top_logprobs")
    req.messages = [check_message(i, m) for i, m in enumerate(body["messages"])] if "messages" in body else []
    if not req.messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    req.tools, req.tool_choice = check_tools(body.get("tools")), parse_tool_choice(body)
    req.template_kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    req.reasoning_format = check_reasoning_format(body.get("reasoning_format"))
    if isinstance(req.tool_choice, str) and req.tool_choice not in ("auto", "none") and req.response_format:
        raise ApiError(400, "a forced tool call and response_format cannot be combined", param="tool_choice")
    return req


# names the server passes to the template itself; a request may not override them
TEMPLATE_RESERVED = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def check_template_kwargs(kwargs: dict | None) -> dict:
    bad = sorted(TEMPLATE_RESERVED & set(kwargs or {}))
    if bad:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    return dict(kwargs or {})


def check_reasoning_format(fmt: str | None) -> str | None:
    from .parsing import REASONING_FORMATS
    if fmt is not None and fmt not in REASONING_FORMATS:
        raise ApiError(400, f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {fmt!r}",
                       param="reasoning_format", code="invalid_value")
    return fmt


def check_tools(tools: list | None) -> list | None:
    """Each tool is {"type": "function", "function": {"name", "description"?, "parameters"?}}: the
    template, the grammar of a forced call and the reply parser all read these fields."""
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                           param=where, code="invalid_value")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"{where}.function.name must be a non-empty string", param=f"{where}.function.name",
                           code="invalid_value")
        for key, kind in (("description", str), ("parameters", dict)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise ApiError(400, f"{where}.function.{key} must be a {'string' if kind is str else 'JSON object'}",
                               param=f"{where}.function.{key}", code="invalid_type")
    return tools


def parse_tool_choice(body: dict) -> str | None:
    """None, "auto", "none", "required", or the name of the one function the reply must call."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(400, "tool_choice as an object must be {'type': 'function', 'function': {'name': ...}}",
                           param="tool_choice", code="invalid_value")
        if name not in names:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not in 'tools'",
                           param="tool_choice", code="invalid_value")
        return "function:" + name
    if choice not in (None, "auto", "none", "required"):
        raise ApiError(400, "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}",
                       param="tool_choice", code="invalid_value")
    if choice == "required" and not names:
        raise ApiError(400, "tool_choice 'required' needs a non-empty 'tools' list", param="tool_choice")
    return choice


def check_message(i: int, m) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"messages[{i}] must be an object with a role in {', '.join(ROLES)}",
                       param=f"messages[{i}]")
    content = m.get("content")
    if isinstance(content, list):                                    # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{i}]: content parts must be {{'type': 'text', 'text': <string>}}",
                           param=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                       param=f"messages[{i}].content")
    if content is None and not m.get("tool_calls"):
        raise ApiError(400, f"messages[{i}] has no content", param=f"messages[{i}].content")
    check_tool_calls(i, m.get("tool_calls"))
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise ApiError(400, f"messages[{i}].{key} must be a string", param=f"messages[{i}].{key}",
                           code="invalid_type")
    out = {"role": m["role"], "content": content or ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if key in m:
            out[key] = m[key]
    reasoning = m.get("reasoning_content", m.get("reasoning"))        # thinking sent back, kept for the template
    if isinstance(reasoning, str):
        out["reasoning_content"] = reasoning
    return out


def check_tool_calls(i: int, calls) -> None:
    """An assistant turn's calls as OpenAI sends them back: [{"id", "type", "function": {"name",
    "arguments"}}], arguments a JSON string (or an object); the chat template reads each field."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls",
                       code="invalid_type")
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name': <string>, "
                                f"'arguments': <JSON string>}}}}", param=where, code="invalid_value")


def parse_completion(body: dict, strict: bool = False) -> GenerationRequest:
    req = parse_common(body, COMPLETION_FIELDS, strict)
    if body.get("echo") or body.get("suffix") or body.get("best_of") not in (None, 1):
        raise ApiError(400, "echo, suffix and best_of are not supported", code="unsupported_value")
    if body.get("logprobs") is not None:
        set_logprobs(req, body["logprobs"], 5, "logprobs")
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


def usage(seqs: list) -> dict:
    """Prompt counted once (the choices share it), completions summed over the choices."""
    n_prompt, n_gen = len(seqs[0].prompt), sum(len(s.generated) for s in seqs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": seqs[0].cached_tokens}}


def chat_response(rid: str, model: str, choices: list[dict], seqs: list) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(seqs), "timings": seqs[0].timings()}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None, index: int = 0,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def completion_response(rid: str, model: str, choices: list[dict], seqs: list | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": choices}
    if seqs:
        out["usage"] = usage(seqs)
    return out


def completion_choice(text: str, finish_reason: str | None, index: int = 0, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def usage_chunk(rid: str, model: str, obj: str, seqs: list) -> dict:
    """The last chunk of a stream: usage, and llama-server's ``timings`` (prompt_ms: the prefill alone)."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(seqs), "timings": seqs[0].timings()}


# ----- logprobs ----------------------------------------------------------------------------
def chat_logprobs(entries: list, piece) -> dict:
    """OpenAI chat shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    def one(tok: int, lp: float) -> dict:
        text = piece(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "surrogatepass"))}
    return {"content": [{**one(tok, lp), "top_logprobs": [one(t, v) for t, v in top]} for tok, lp, top in entries]}


def completion_logprobs(entries: list, piece, offset: int = 0) -> dict:
    """OpenAI legacy completions shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
    tokens, offsets = [piece(tok) for tok, _, _ in entries], []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{piece(t): v for t, v in top} for _, _, top in entries], "text_offset": offsets}
