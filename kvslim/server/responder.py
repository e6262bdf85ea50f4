"""Turns the events of a request's jobs (one per choice) into one JSON response or an SSE stream.

Every stream ends with ``data: [DONE]``, after an error event when generation
failed or the server is shutting down; a client that leaves cancels its jobs.
"""
from __future__ import annotations

import asyncio
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine import ContextLengthExceeded
from . import openai_api as api
from .scheduler import SequenceFailed, ShuttingDown
from .parsing import Delta, OutputParser, ParsedReply
from .tools import call_id, openai_call


def engine_error(err: Exception) -> api.ApiError:
    if isinstance(err, ContextLengthExceeded):
        return api.ApiError(400, str(err), code="context_length_exceeded")
    if isinstance(err, ShuttingDown):
        return api.ApiError(503, str(err) or "the server is shutting down", "unavailable_error",
                            code="shutting_down")
    if isinstance(err, SequenceFailed):
        return api.ApiError(500, str(err), "server_error", code="generation_failed")
    if isinstance(err, ValueError):
        return api.ApiError(400, str(err))
    return api.ApiError(500, f"generation failed: {type(err).__name__}: {err}", "server_error")


class JobStream(StreamingResponse):
    """A streaming response that cancels its jobs however it ends (finished, client gone, server stopping)."""

    def __init__(self, content, jobs):
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.jobs = jobs

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


class Choice:
    """What one choice has produced so far; a chat choice parses its text into reasoning, content, calls."""

    def __init__(self, index: int, parser: OutputParser | None):
        self.index, self.text, self.logprobs, self.seq = index, "", [], None
        self.parser, self.reply, self.call_ids = parser, ParsedReply(), []

    def parse(self, text: str, done: bool, id_prefix: str) -> list[Delta]:
        if self.parser is None:
            return []
        deltas = self.parser.feed(text) + (self.parser.finish() if done else [])
        self.reply.add(deltas)
        self.call_ids += [call_id(id_prefix) for d in deltas if d.kind == "tool_start"]
        return deltas


def reply_parser(req: api.GenerationRequest) -> OutputParser:
    """How a chat reply is split: thinking unless --reasoning-format none, tool calls when tools were given
    and not refused (with tool_choice "none" the tools stay in the prompt, so its cached prefix holds)."""
    calls = req.tools if req.tools and req.tool_choice != "none" else None
    return OutputParser(reasoning=req.reasoning_format != "none", thinking_open=req.thinking_open, tools=calls)


class Responder:
    id_prefix = "call"                                             # of tool call ids

    def __init__(self, state, req: api.GenerationRequest, jobs: list, events: asyncio.Queue, kind: str):
        self.req, self.jobs, self.events, self.kind = req, jobs, events, kind
        self.rid = api.new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.model = state.model_id
        self.tokenizer = state.engine.tokenizer
        self.choices = [Choice(j.index, reply_parser(req) if kind == "chat" else None) for j in jobs]

    async def respond(self, request: Request):
        if self.req.stream:
            return JobStream(self.sse(), self.jobs)
        collect, left = asyncio.create_task(self._collect()), asyncio.create_task(self._client_left(request))
        try:
            await asyncio.wait({collect, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            answered = collect.done()
            collect.cancel()
            left.cancel()
            self._cancel()
        if not answered:
            # the client left first: a job still queued sends no event, so waiting on would never end
            return Response(status_code=499)                      # nginx's "client closed request"; unsent
        try:
            collect.result()
        except api.ApiError as err:
            return JSONResponse(self.error_body(err), err.status)
        return JSONResponse(self.final_body())

    def error_body(self, err: api.ApiError) -> dict:
        return err.body()

    async def _collect(self) -> None:
        async for _ in self._events():
            pass

    @staticmethod
    async def _client_left(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def _cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    async def _events(self):
        """(choice, event, deltas) until every choice is done; an error raises ApiError (the rest cancelled)."""
        pending = len(self.jobs)
        while pending:
            index, event = await self.events.get()
            choice = self.choices[index]
            if event[0] == "error":
                self._cancel()
                raise engine_error(event[1])
            if event[0] == "text":
                choice.text += event[1]
                choice.logprobs += event[2]
                deltas = choice.parse(event[1], False, self.id_prefix)
            else:
                choice.seq = event[1]
                pending -= 1
                deltas = choice.parse("", True, self.id_prefix)
            yield choice, event, deltas

    # ----- one JSON body ----------------------------------------------------------------------
    def final_body(self) -> dict:
        seqs = [c.seq for c in self.choices]
        if self.kind == "completion":
            return api.completion_response(self.rid, self.model, [
                api.completion_choice(c.text, c.seq.finish_reason, c.index, self._logprobs(c.logprobs))
                for c in self.choices], seqs)
        return api.chat_response(self.rid, self.model, [self._chat_choice(c) for c in self.choices], seqs)

    def _chat_choice(self, c: Choice) -> dict:
        r, finish = c.reply, c.seq.finish_reason
        message = {"role": "assistant", "content": r.content}
        if r.reasoning:
            message["reasoning_content"] = r.reasoning
        if r.calls:
            message["content"] = r.content or None
            message["tool_calls"] = [openai_call(call, cid) for call, cid in zip(r.calls, c.call_ids)]
            finish = "tool_calls"
        return {"index": c.index, "message": message, "finish_reason": finish, "logprobs": self._logprobs(c.logprobs)}

    def _logprobs(self, entries: list, offset: int = 0) -> dict | None:
        if self.req.sampling.logprobs is None:
            return None
        piece = self._piece
        if self.kind == "chat":
            return api.chat_logprobs(entries, piece)
        return api.completion_logprobs(entries, piece, offset)

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special=False)

    # ----- a stream ----------------------------------------------------------------------------
    async def sse(self):
        try:
            if self.kind == "chat":
                for c in self.choices:
                    yield self._data(api.chat_chunk(self.rid, self.model, {"role": "assistant", "content": ""},
                                                    index=c.index))
            async for choice, event, deltas in self._events():
                done = event[0] != "text"
                chunks = self._delta_chunks(choice, deltas) + self._end_chunks(choice) if done else \
                    self._text_chunks(choice, event, deltas)
                for chunk in chunks:
                    yield self._data(chunk)
            if self.req.include_usage:
                obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
                yield self._data(api.usage_chunk(self.rid, self.model, obj, [c.seq for c in self.choices]))
        except api.ApiError as err:
            yield self._data(err.body())
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _data(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def _text_chunks(self, c: Choice, event, deltas: list[Delta]) -> list[dict]:
        text, entries = event[1], event[2]
        lp = self._logprobs(entries, len(c.text) - len(text)) if entries else None
        if self.kind == "completion":
            return [api.completion_response(self.rid, self.model, [api.completion_choice(text, None, c.index, lp)])] \
                if text or entries else []
        chunks = self._delta_chunks(c, deltas)
        if lp is not None:                                            # logprobs ride on the first chunk
            if not chunks:
                chunks = [api.chat_chunk(self.rid, self.model, {"content": ""}, index=c.index)]
            chunks[0]["choices"][0]["logprobs"] = lp
        return chunks

    def _delta_chunks(self, c: Choice, deltas: list[Delta]) -> list[dict]:
        """OpenAI chunks for parsed deltas: content, reasoning_content (llama-server's name), tool_calls."""
        out = []
        for d in deltas:
            if d.kind == "content":
                delta = {"content": d.text}
            elif d.kind == "reasoning":
                delta = {"reasoning_content": d.text}
            elif d.kind == "tool_start":
                delta = {"tool_calls": [{"index": d.index, "id": c.call_ids[d.index], "type": "function",
                                         "function": {"name": d.name, "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}
            out.append(api.chat_chunk(self.rid, self.model, delta, index=c.index))
        return out

    def _end_chunks(self, c: Choice) -> list[dict]:
        finish = "tool_calls" if c.reply.calls else c.seq.finish_reason
        if self.kind == "chat":
            return [api.chat_chunk(self.rid, self.model, {}, finish, index=c.index)]
        return [api.completion_response(self.rid, self.model, [api.completion_choice("", finish, c.index)])]
