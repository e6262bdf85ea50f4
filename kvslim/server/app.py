"""The HTTP layer of ``kvslim serve``: routes, validation, server-sent events, auth.

A Starlette app served by uvicorn (see ``transport.py`` for limits, timeouts
and shutdown). Handlers parse and check on the event loop, do heavy parsing
and tokenizing in worker threads, and hand jobs to the scheduler thread that
runs the model. The model loads in the background while /health answers 503.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import Engine
from . import openai_api as api
from .metrics import metrics_text, slots_view
from .responder import Responder
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("kvslim.server")
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


class ServerState:
    """What every request handler shares: the model once loaded, the scheduler, settings."""

    def __init__(self, options: dict):
        self.options = options
        self.model_id = options.get("alias") or Path(options.get("model") or "tiny-qwen35").name.removesuffix(".gguf")
        self.api_keys = list(options.get("api_keys") or ([options["api_key"]] if options.get("api_key") else []))
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.grammars = None
        self.max_token_chars = 1 << 30
        self.load_error: str | None = None
        self.on_load_failed = lambda: None
        self.started = time.time()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def load(self) -> None:
        try:
            self._load()
        except Exception as err:                                          # reported by /health, then exit 1
            self.load_error = f"{type(err).__name__}: {err}"
            log.error("model failed to load: %s", self.load_error)
            self.on_load_failed()

    def _load(self) -> None:
        from ..loading import load_model
        from .grammar import Grammars
        o = self.options
        config = o["engine_config"]                                      # built once by the tool (or the tests)
        model, tokenizer, eos = load_model(o.get("model"), o.get("dtype"), config.device, weights=o.get("weights"),
                                           allow_dequant=bool(o.get("allow_dequant")))
        eog = tokenizer.eog_ids(sorted(eos))
        if o.get("chat_template"):                                    # --chat-template-file
            tokenizer.chat_template = o["chat_template"]
        engine = Engine(model, tokenizer, config, eog)
        engine.warm_up()                                              # --compile: compiled before "ready"
        self.max_token_chars = longest_token(tokenizer)
        eos_id = tokenizer.token_id(tokenizer.eos_token)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, eos_id if eos_id is not None else min(eog))
        self.engine = engine
        self.scheduler = Scheduler(engine, o["max_queue"])


def longest_token(tokenizer) -> int:
    """An upper bound on the characters one token covers (its stored form is never shorter than its text)."""
    return max((len(t) for t in tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)


# ----- plumbing ---------------------------------------------------------------------------
def state_of(request: Request) -> ServerState:
    return request.app.state.kvslim


async def read_json(request: Request):
    """The body as JSON: bounded in size and time, parsed in a worker thread."""
    o = state_of(request).options
    limit, timeout = o.get("max_body", 8 << 20), o.get("read_timeout", 30.0)
    length = request.headers.get("content-length")
    if length is not None and int(length) > limit:                    # refused before reading a byte
        raise api.ApiError(413, f"request body of {length} bytes is over the limit of {limit} bytes "
                                f"(--max-body-mib)", code="body_too_large")
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise api.ApiError(413, f"request body over the limit of {limit} bytes (--max-body-mib)",
                                       code="body_too_large")
    except TimeoutError:
        raise api.ApiError(408, f"request body not received within {timeout:g} s", code="timeout") from None
    return await asyncio.to_thread(parse_json, bytes(raw))


def parse_json(raw: bytes):
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()                   # lone surrogates fail here, not later
        return body
    except ValueError as err:             # bad syntax, bad UTF-8, an integer past Python's 4300 digits
        raise api.ApiError(400, f"malformed JSON body: {err}", code="invalid_json") from None
    except RecursionError:
        raise api.ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None


def check_key(request: Request) -> None:
    keys = state_of(request).api_keys
    if not keys:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
        raise api.ApiError(401, "Invalid API Key", "authentication_error", code="invalid_api_key")


def check_host(request: Request) -> None:
    """Without a key, a loopback server answers only loopback Host names: a page that rebinds
    its DNS name to 127.0.0.1 cannot drive it from a browser."""
    s = state_of(request)
    if s.api_keys or not s.options.get("loopback_only", False):
        return
    host = request.headers.get("host", "")
    name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    if name.lower() not in LOOPBACK_NAMES | set(s.options.get("allowed_hosts") or []):
        raise api.ApiError(403, f"Host {host[:100]!r} is not allowed (loopback server without --api-key; "
                                f"--allowed-host adds names)", "permission_error", code="invalid_host")


def check_ready(request: Request) -> ServerState:
    s = state_of(request)
    if s.load_error:
        raise api.ApiError(500, f"model failed to load: {s.load_error}", "server_error")
    if not s.ready:
        raise api.ApiError(503, "Loading model", "unavailable_error", code="model_loading")
    return s


def guarded(public: bool = False):
    """Host check, then auth and readiness (unless public) before the handler runs."""
    def wrap(handler):
        async def endpoint(request: Request):
            check_host(request)
            if not public:
                check_key(request)
                check_ready(request)
            return await handler(request)
        endpoint.__name__ = handler.__name__
        return endpoint
    return wrap


# ----- simple endpoints -------------------------------------------------------------------
WEB_UI = Path(__file__).with_name("webui.html")
# the page's script and styles are inline; nothing else may load, and no other site may frame it
WEB_UI_POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                 "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


@guarded(public=True)
async def web_ui(request: Request):
    """A chat page, as llama-server has at /: it calls /v1/chat/completions with the key typed in it."""
    return Response(WEB_UI.read_bytes(), media_type="text/html; charset=utf-8",
                    headers={"content-security-policy": WEB_UI_POLICY, "x-content-type-options": "nosniff"})


@guarded(public=True)
async def health(request: Request):
    s = state_of(request)
    if s.load_error:
        raise api.ApiError(500, f"model failed to load: {s.load_error}", "server_error")
    if not s.ready:
        raise api.ApiError(503, "Loading model", "unavailable_error", code="model_loading")
    return JSONResponse({"status": "ok"})


@guarded()
async def models(request: Request):
    s = state_of(request)
    e = s.engine
    meta = {"n_ctx": e.ctx, "n_parallel": e.n_parallel, "type_k": e.type_k, "type_v": e.type_v,
            "n_vocab": e.model.config.vocab_size}
    return JSONResponse({"object": "list", "data": [{"id": s.model_id, "object": "model", "created": int(s.started),
                                                     "owned_by": "kvslim", "meta": meta}]})


@guarded()
async def metrics(request: Request):
    s = state_of(request)
    return Response(metrics_text(s.engine, s.scheduler), media_type="text/plain; version=0.0.4; charset=utf-8")


@guarded()
async def slots(request: Request):
    s = state_of(request)
    return JSONResponse(slots_view(s.engine, s.scheduler))


@guarded()
async def tokenize(request: Request):
    body = await read_json(request)
    api.check_fields(body, {"content": str, "add_special": bool, "with_pieces": bool}, strict=True)
    if "content" not in body:
        raise api.ApiError(400, "'content' is required", param="content")
    tok = state_of(request).engine.tokenizer
    ids = await asyncio.to_thread(tok.encode, body["content"], body.get("add_special", False))
    if body.get("with_pieces"):                                      # llama-server's shape: id and its text
        return JSONResponse({"tokens": [{"id": i, "piece": tok.decode([i], skip_special=False)} for i in ids]})
    return JSONResponse({"tokens": ids})


@guarded()
async def detokenize(request: Request):
    body = await read_json(request)
    api.check_fields(body, {"tokens": list}, strict=True)
    tokens = body.get("tokens")
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise api.ApiError(400, "'tokens' must be a list of integers", param="tokens")
    try:
        return JSONResponse({"content": state_of(request).engine.tokenizer.decode(tokens, skip_special=False)})
    except ValueError as err:
        raise api.ApiError(400, str(err), param="tokens") from None


@guarded()
async def apply_template(request: Request):
    body = await read_json(request)
    s = state_of(request)
    if not isinstance(body, dict):
        raise api.ApiError(400, "the request body must be a JSON object")
    req = api.parse_chat({"model": s.model_id, **body}, s.options.get("strict", False))
    return JSONResponse({"prompt": await asyncio.to_thread(render, s, req)})


# ----- generation --------------------------------------------------------------------------
@guarded()
async def chat(request: Request):
    s = state_of(request)
    req = api.parse_chat(await read_json(request), s.options.get("strict", False))
    check_model(s, req.model)
    prompt = await chat_prompt(s, req)
    return await generate(request, s, req, prompt, "chat")


async def chat_prompt(s: ServerState, req: api.GenerationRequest) -> list[int]:
    """Render and tokenize a chat request (off the event loop); notes whether the reply starts inside <think>."""
    from .parsing import thinking_opened
    text = await asyncio.to_thread(render, s, req)
    check_chars(s, len(text), "messages")
    req.reasoning_format = req.reasoning_format or s.options.get("reasoning_format") or "auto"
    req.thinking_open = thinking_opened(text)
    return await asyncio.to_thread(encode_prompt, s.engine.tokenizer, text)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a chat prompt, split the way the next turn's prompt will split them.

    A prompt often ends in whitespace (``<think>\\n\\n</think>\\n\\n``); in the next turn's prompt
    the reply follows it, and a GPT-2-style pre-tokenizer then splits that whitespace differently
    ("\\n\\n" alone is one token, "\\n\\nX" is "\\n", "\\n", "X"), so the cached prompt would stop
    matching one token before its end. Encoding the prompt with a letter after it and dropping the
    letter's token gives the split the continuation (and the training text) has."""
    if not text or not text[-1].isspace():
        return tokenizer.encode(text, False)
    ids = tokenizer.encode(text + "x", False)
    if ids and tokenizer.decode(ids[:-1], skip_special=False) == text:
        return ids[:-1]
    return tokenizer.encode(text, False)                                 # the letter merged with a space


@guarded()
async def completions(request: Request):
    s = state_of(request)
    req = api.parse_completion(await read_json(request), s.options.get("strict", False))
    check_model(s, req.model)
    tok = s.engine.tokenizer
    if isinstance(req.prompt, str):
        check_chars(s, len(req.prompt), "prompt")
        prompt = await asyncio.to_thread(tok.encode, req.prompt)
    else:
        prompt = list(req.prompt)
    if any(not 0 <= t < tok.vocab_size for t in prompt):
        raise api.ApiError(400, f"prompt token ids must be in 0..{tok.vocab_size - 1}", param="prompt")
    return await generate(request, s, req, prompt, "completion")


# ----- Anthropic's Messages API ---------------------------------------------------------------
@guarded()
async def messages(request: Request):
    from .anthropic_api import MessagesResponder, parse_messages
    s = state_of(request)
    req = api_model(s, parse_messages(await read_json(request), s.options.get("strict", False)))
    prompt = await chat_prompt(s, req)
    return await generate(request, s, req, prompt, "chat", MessagesResponder)


@guarded()
async def count_tokens(request: Request):
    from .anthropic_api import parse_messages
    s = state_of(request)
    req = api_model(s, parse_messages(await read_json(request), s.options.get("strict", False), counting=True))
    return JSONResponse({"input_tokens": len(await chat_prompt(s, req))})


def api_model(s: ServerState, req: api.GenerationRequest) -> api.GenerationRequest:
    """Any model name is served: Anthropic clients send their own (Claude Code's background model too)."""
    if req.model != s.model_id and req.model not in _logged_models and len(_logged_models) < 64:
        _logged_models.add(req.model)
        log.info("serving model %r for requests naming %r", s.model_id, req.model[:100])
    return req


_logged_models: set[str] = set()


def render(s: ServerState, req: api.GenerationRequest) -> str:
    from .tools import template_messages
    kwargs = {**(s.options.get("chat_template_kwargs") or {}), **req.template_kwargs}
    try:
        return s.engine.tokenizer.apply_chat_template(template_messages(req.messages), add_generation_prompt=True,
                                                      tools=req.tools, **kwargs)
    except Exception as err:                                         # template errors are the request's
        raise api.ApiError(400, f"chat template failed: {err}", param="messages") from None


def check_model(s: ServerState, name: str) -> None:
    if name != s.model_id:
        raise api.ApiError(404, f"The model '{name}' does not exist; this server serves '{s.model_id}'",
                           code="model_not_found", param="model")


def context_error(s: ServerState, n: int, unit: str, param: str) -> api.ApiError:
    return api.ApiError(400, f"This model's maximum context length is {s.engine.ctx} tokens. However, your "
                             f"request has {n} prompt {unit}. Please reduce the length.",
                        code="context_length_exceeded", param=param)


def check_chars(s: ServerState, n_chars: int, param: str) -> None:
    """Refuse a prompt that cannot fit on its length alone, before paying for tokenizing it."""
    if n_chars > s.engine.ctx * s.max_token_chars:
        raise context_error(s, n_chars, "characters", param)


async def generate(request: Request, s: ServerState, req: api.GenerationRequest, prompt: list[int], kind: str,
                   responder=Responder):
    if len(prompt) >= s.engine.ctx:
        raise context_error(s, len(prompt), "tokens", "messages" if kind == "chat" else "prompt")
    room = s.scheduler.max_queue + s.engine.n_parallel                 # every slot free, the queue empty
    if req.n > room:                                                   # a 503's "retry later" would never come true
        raise api.ApiError(400, f"'n' is {req.n}, but this server holds at most {room} choices at once "
                                f"(-np {s.engine.n_parallel} + --max-queue {s.scheduler.max_queue})",
                           param="n", code="invalid_value")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    constraints = await asyncio.to_thread(constraints_for, s, req)
    jobs = []
    for i in range(req.n):
        sampling = req.sampling if req.n == 1 or req.sampling.seed is None else \
            type(req.sampling)(**{**vars(req.sampling), "seed": req.sampling.seed + i})
        jobs.append(Job(prompt, req.max_tokens or s.engine.ctx - len(prompt), sampling, req.stop,
                        emit=lambda ev, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, ev)),
                        constraint=constraints[i], index=i))
    try:
        s.scheduler.submit(jobs)
    except QueueFull as err:
        raise api.ApiError(503, f"server busy: {err}; retry later", "unavailable_error", code="server_busy") from None
    except ShuttingDown as err:
        raise api.ApiError(503, str(err), "unavailable_error", code="shutting_down") from None
    return await responder(s, req, jobs, events, kind).respond(request)


def constraints_for(s: ServerState, req: api.GenerationRequest) -> list:
    """One grammar constraint per choice (a forced tool call or a JSON response format), or None each."""
    from .grammar import CLOSE_THINKING, json_grammar, tool_call_grammar
    prefix = CLOSE_THINKING if req.thinking_open else ""
    if req.tools and req.tool_choice and req.tool_choice not in ("auto", "none"):
        name = req.tool_choice.removeprefix("function:") if req.tool_choice.startswith("function:") else None
        xml = "<function=" in (s.engine.tokenizer.chat_template or "")          # Qwen3.5's call format
        grammar, param = tool_call_grammar(req.tools, name, xml, prefix), "tools"
    elif req.response_format:
        grammar, param = json_grammar(req.response_format.get("schema"), prefix), "response_format"
    else:
        return [None] * req.n
    return [s.grammars.constraint(grammar, param) for _ in range(req.n)]


# ----- the app ------------------------------------------------------------------------------
def is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def error_json(request: Request, err: api.ApiError) -> dict:
    """OpenAI's error shape, or Anthropic's on its routes."""
    if is_anthropic(request):
        from .anthropic_api import error_body
        return error_body(err)
    return err.body()


async def api_error(request: Request, err: api.ApiError):
    return JSONResponse(error_json(request, err), err.status, headers=close_if_unread(request, err.status))


async def http_error(request: Request, err: HTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
    message = f"no route {request.method} {request.url.path}" if err.status_code == 404 else str(err.detail)
    body = error_json(request, api.ApiError(err.status_code, message, code=code))
    return JSONResponse(body, err.status_code, headers={**(err.headers or {}),
                                                        **close_if_unread(request, err.status_code)})


async def server_error(request: Request, err: Exception):
    log.exception("internal error on %s %s", request.method, request.url.path)
    body = error_json(request, api.ApiError(500, f"internal error: {type(err).__name__}", "server_error"))
    return JSONResponse(body, 500, headers={"connection": "close"})


def close_if_unread(request: Request, status: int) -> dict:
    """A refused upload may still be arriving: close the connection after the answer (as nginx does for 413)
    rather than read megabytes nobody wants; other early answers let the server discard the rest."""
    return {"connection": "close"} if status in (408, 413) else {}


ROUTES = [("/", web_ui, ["GET"]), ("/health", health, ["GET"]), ("/v1/health", health, ["GET"]), ("/v1/models", models, ["GET"]),
          ("/models", models, ["GET"]), ("/metrics", metrics, ["GET"]), ("/slots", slots, ["GET"]),
          ("/v1/chat/completions", chat, ["POST"]), ("/chat/completions", chat, ["POST"]),
          ("/v1/completions", completions, ["POST"]), ("/completions", completions, ["POST"]),
          ("/tokenize", tokenize, ["POST"]), ("/detokenize", detokenize, ["POST"]),
          ("/apply-template", apply_template, ["POST"]), ("/v1/messages", messages, ["POST"]),
          ("/v1/messages/count_tokens", count_tokens, ["POST"])]


def options_route(path: str, methods: list[str]):
    allow = ", ".join(methods + (["HEAD"] if "GET" in methods else []) + ["OPTIONS"])

    async def answer(request: Request):
        return Response(status_code=204, headers={"allow": allow})
    return Route(path, answer, methods=["OPTIONS"])


def build_app(state: ServerState) -> Starlette:
    routes = [Route(path, fn, methods=methods) for path, fn, methods in ROUTES]
    routes += [options_route(path, methods) for path, _, methods in ROUTES]
    app = Starlette(routes=routes, exception_handlers={api.ApiError: api_error, HTTPException: http_error,
                                                      Exception: server_error})
    app.state.kvslim = state
    return app
