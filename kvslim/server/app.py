"""The HTTP layer of ``kvslim serve``: routes, JSON, server-sent events, auth.

Standard library only (``ThreadingHTTPServer``): one thread per connection
parses and validates, the scheduler thread runs the model. The model loads in
the background while /health answers 503.
"""
from __future__ import annotations

import json
import queue
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ..engine import ContextLengthExceeded, Engine
from ..loading import load_model
from . import openai_api as api
from .metrics import prometheus_text, slots_view
from .scheduler import Job, QueueFull, Scheduler
from .tools import ToolStreamFilter, parse_tool_calls, template_messages

MAX_BODY = 32 << 20


class ServerState:
    """What every request handler shares: the model once loaded, the scheduler, settings."""

    def __init__(self, options: dict):
        self.options = options
        self.model_id = options.get("alias") or Path(options.get("model") or "tiny-qwen35").name.removesuffix(".gguf")
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.load_error: str | None = None
        self.started = time.time()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def load(self) -> None:
        o = self.options
        try:
            config = o["engine_config"]
            model, tokenizer, eos = load_model(o.get("model"), o.get("dtype"), config.device,
                                               weights=o.get("weights"), allow_dequant=bool(o.get("allow_dequant")))
            self.engine = Engine(model, tokenizer, config, tokenizer.eog_ids(sorted(eos)))
            self.scheduler = Scheduler(self.engine, o["max_queue"])
        except Exception as err:                                          # reported by /health
            self.load_error = f"{type(err).__name__}: {err}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvslim"

    # ----- plumbing --------------------------------------------------------------------
    @property
    def state(self) -> ServerState:
        return self.server.state

    def log_message(self, fmt, *args):                                   # quiet unless asked
        if self.state.options.get("verbose"):
            super().log_message(fmt, *args)

    def send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, status: int, text: str, content_type: str = "text/plain; version=0.0.4") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_json(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise api.ApiError(411, "a Content-Length header is required")
        if int(length) > MAX_BODY:
            raise api.ApiError(413, f"request body over {MAX_BODY} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise api.ApiError(400, f"malformed JSON body: {err}", code="invalid_json") from None

    def client_gone(self) -> bool:
        """True when the client closed its connection (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # ----- dispatch --------------------------------------------------------------------
    def do_GET(self):
        self.dispatch({"/health": self.health, "/v1/health": self.health, "/v1/models": self.models,
                       "/models": self.models, "/metrics": self.metrics, "/slots": self.slots})

    def do_POST(self):
        self.dispatch({"/v1/chat/completions": self.chat, "/chat/completions": self.chat,
                       "/v1/completions": self.completions, "/completions": self.completions,
                       "/tokenize": self.tokenize, "/detokenize": self.detokenize,
                       "/apply-template": self.apply_template})

    def dispatch(self, routes: dict) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path not in routes:
                raise api.ApiError(404, f"no route {self.command} {path}", code="not_found")
            if path not in ("/health", "/v1/health"):
                self.check_key()
                self.check_ready()
            routes[path]()
        except api.ApiError as err:
            self.send_json(err.status, err.body())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as err:                                         # a bug: answer, stay up
            self.send_json(500, api.ApiError(500, f"internal error: {type(err).__name__}: {err}",
                                             "server_error").body())

    def check_key(self) -> None:
        key = self.state.options.get("api_key")
        if key and self.headers.get("Authorization", "") != f"Bearer {key}":
            raise api.ApiError(401, "Invalid API Key", "authentication_error", code="invalid_api_key")

    def check_ready(self) -> None:
        if not self.state.ready:
            raise api.ApiError(503, "Loading model", "unavailable_error", code="model_loading")

    # ----- simple endpoints ------------------------------------------------------------
    def health(self):
        s = self.state
        if s.load_error:
            self.send_json(500, api.ApiError(500, f"model failed to load: {s.load_error}", "server_error").body())
        elif not s.ready:
            self.send_json(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
        else:
            self.send_json(200, {"status": "ok"})

    def models(self):
        s = self.state
        meta = {"n_ctx": s.engine.ctx, "n_parallel": s.engine.n_parallel, "type_k": s.engine.type_k,
                "type_v": s.engine.type_v, "n_vocab": s.engine.vocab_size}
        self.send_json(200, {"object": "list", "data": [{"id": s.model_id, "object": "model",
                                                           "created": int(s.started), "owned_by": "kvslim",
                                                           "meta": meta}]})

    def metrics(self):
        self.send_text(200, prometheus_text(self.state.engine, self.state.scheduler))

    def slots(self):
        self.send_json(200, slots_view(self.state.engine, self.state.scheduler))

    def tokenize(self):
        body = self.read_json()
        api.check_fields(body, {"content": str, "add_special": bool, "with_pieces": bool})
        if "content" not in body:
            raise api.ApiError(400, "'content' is required", param="content")
        ids = self.state.engine.tokenizer.encode(body["content"], body.get("add_special", False))
        self.send_json(200, {"tokens": ids})

    def detokenize(self):
        body = self.read_json()
        api.check_fields(body, {"tokens": list})
        tokens = body.get("tokens")
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise api.ApiError(400, "'tokens' must be a list of integers", param="tokens")
        try:
            self.send_json(200, {"content": self.state.engine.tokenizer.decode(tokens, skip_special=False)})
        except ValueError as err:
            raise api.ApiError(400, str(err), param="tokens") from None

    def apply_template(self):
        body = self.read_json()
        req = api.parse_chat({"model": self.state.model_id, **body})
        self.send_json(200, {"prompt": self.render(req)})

    # ----- generation ------------------------------------------------------------------
    def chat(self):
        req = api.parse_chat(self.read_json())
        self.check_model(req.model)
        prompt = self.state.engine.tokenizer.encode(self.render(req), add_special=False)
        self.generate(req, prompt, "chat")

    def completions(self):
        req = api.parse_completion(self.read_json())
        self.check_model(req.model)
        tok = self.state.engine.tokenizer
        prompt = tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if any(not 0 <= t < tok.vocab_size for t in prompt):
            raise api.ApiError(400, f"prompt token ids must be in 0..{tok.vocab_size - 1}", param="prompt")
        self.generate(req, prompt, "completion")

    def render(self, req: api.GenerationRequest) -> str:
        try:
            return self.state.engine.tokenizer.apply_chat_template(template_messages(req.messages),
                                                                   add_generation_prompt=True, tools=req.tools)
        except Exception as err:                                         # template errors are the request's
            raise api.ApiError(400, f"chat template failed: {err}", param="messages") from None

    def check_model(self, name: str) -> None:
        if name != self.state.model_id:
            raise api.ApiError(404, f"The model '{name}' does not exist; this server serves "
                                    f"'{self.state.model_id}'", code="model_not_found", param="model")

    def generate(self, req: api.GenerationRequest, prompt: list[int], kind: str) -> None:
        engine = self.state.engine
        if len(prompt) >= engine.ctx:
            raise api.ApiError(400, f"This model's maximum context length is {engine.ctx} tokens. However, your "
                                    f"request has {len(prompt)} prompt tokens. Please reduce the length.",
                               code="context_length_exceeded", param="messages" if kind == "chat" else "prompt")
        job = Job(prompt, req.max_tokens or engine.ctx - len(prompt), req.sampling, req.stop)
        try:
            self.state.scheduler.submit(job)
        except QueueFull as err:
            raise api.ApiError(503, f"server busy: {err}; retry later", "unavailable_error",
                               code="server_busy") from None
        Responder(self, req, job, kind).run()


class Responder:
    """Turns a job's events into one JSON response or an SSE stream."""

    def __init__(self, handler: Handler, req: api.GenerationRequest, job: Job, kind: str):
        self.h, self.req, self.job, self.kind = handler, req, job, kind
        self.rid = api.new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.model = handler.state.model_id
        self.tools = ToolStreamFilter() if req.tools and kind == "chat" else None

    def events(self):
        """The job's events; cancels the job if the client goes away while waiting."""
        while True:
            try:
                event = self.job.events.get(timeout=0.05)
            except queue.Empty:
                if self.h.client_gone():
                    self.job.cancel()
                    return
                continue
            if event[0] == "error":
                raise _engine_error(event[1])
            yield event
            if event[0] == "done":
                return

    def run(self) -> None:
        if self.req.stream:
            self.stream()
            return
        text, seq = "", None
        for kind, value in self.events():
            if kind == "text":
                text += value
            else:
                seq = value
        if seq is not None:
            self.h.send_json(200, self.final_body(text, seq))

    def final_body(self, text: str, seq) -> dict:
        finish = seq.finish_reason
        if self.kind == "completion":
            return api.completion_response(self.rid, self.model, text, finish, seq)
        message = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = parse_tool_calls(text)
            if calls:
                message, finish = {"role": "assistant", "content": content or None, "tool_calls": calls}, \
                    "tool_calls"
        return api.chat_response(self.rid, self.model, message, finish, seq, seq.timings())

    # ----- streaming ----------------------------------------------------------------------
    def stream(self) -> None:
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        try:
            if self.kind == "chat":
                self.send(api.chat_chunk(self.rid, self.model, {"role": "assistant", "content": ""}))
            for kind, value in self.events():
                if kind == "text":
                    self.send_text(value)
                else:
                    self.send_end(value)
            h.wfile.write(b"data: [DONE]\n\n")
            h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.job.cancel()
        except api.ApiError as err:
            self.send(err.body())

    def send(self, obj: dict) -> None:
        self.h.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.h.wfile.flush()

    def send_text(self, text: str) -> None:
        if self.tools is not None:
            text = self.tools.feed(text)
        if not text:
            return
        if self.kind == "chat":
            self.send(api.chat_chunk(self.rid, self.model, {"content": text}))
        else:
            self.send(api.completion_response(self.rid, self.model, text, None))

    def send_end(self, seq) -> None:
        finish = seq.finish_reason
        if self.tools is not None:
            rest, calls = self.tools.finish()
            if rest and not calls:
                self.send(api.chat_chunk(self.rid, self.model, {"content": rest}))
            if calls:
                deltas = [{"index": i, **c} for i, c in enumerate(calls)]
                self.send(api.chat_chunk(self.rid, self.model, {"tool_calls": deltas}))
                finish = "tool_calls"
        if self.kind == "chat":
            self.send(api.chat_chunk(self.rid, self.model, {}, finish))
        else:
            self.send(api.completion_response(self.rid, self.model, "", finish))
        if self.req.include_usage:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            self.send(api.usage_chunk(self.rid, self.model, obj, seq))


def _engine_error(err: Exception) -> api.ApiError:
    if isinstance(err, ContextLengthExceeded):
        return api.ApiError(400, str(err), code="context_length_exceeded")
    if isinstance(err, ValueError):
        return api.ApiError(400, str(err))
    return api.ApiError(500, f"generation failed: {type(err).__name__}: {err}", "server_error")


class KvslimServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, state: ServerState):
        super().__init__(address, Handler)
        self.state = state

    def shutdown(self) -> None:
        super().shutdown()
        self.server_close()
        if self.state.scheduler is not None:
            self.state.scheduler.shutdown()


def start(options: dict, host: str = "127.0.0.1", port: int = 8080) -> KvslimServer:
    """Bind, start loading the model in the background, serve in a thread; returns the server."""
    state = ServerState(options)
    server = KvslimServer((host, port), state)
    threading.Thread(target=state.load, name="kvslim-load", daemon=True).start()
    threading.Thread(target=server.serve_forever, name="kvslim-http", daemon=True).start()
    return server
