"""Coding agents as clients: reasoning, streamed tool calls, Anthropic's Messages API, long sessions.

A real ``kvslim serve`` on the bundled model with the Qwen3.5-format template
(``kvslim/data/templates/qwen3_5.jinja``), driven by the official ``openai`` and
``anthropic`` clients. The tiny model never writes a thinking block or a
``<tool_call>`` on its own, so where a test needs one, the ``forced`` fixture
makes the server constrain that request's reply to a scripted text (a literal
llguidance grammar through the real sampler path: the model still runs every
step and the server parses, streams and caches the tokens it produced).
Everything else (plain answers, forced tool calls from ``tool_choice``,
the long session's replies) is the model's own greedy output.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest

from kvslim.server import app as server_app
from kvslim.server import start
from tests.test_server import free_port, options, wait_ready

openai = pytest.importorskip("openai")
# the anthropic client is imported where a test uses it (2.5 s: every xdist worker collects this file)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("anthropic") is None, reason="anthropic is not installed")
TEMPLATE = Path(server_app.__file__).parents[1] / "data" / "templates" / "qwen3_5.jinja"
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "limit": {"type": "integer"}},
                                               "required": ["path"]}}},
         {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
THOUGHT = "A module?\nJSON."                              # short: the tiny model decodes slowly on a busy CPU
ANSWER = "Use json."
TWO_CALLS = ("Both.\n\n<tool_call>\n<function=read_file>\n<parameter=limit>\n20\n</parameter>\n</function>\n"
             "</tool_call>\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = start(options(None, ctx=2048, n_parallel=2, chat_template=TEMPLATE.read_text()), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    yield base
    srv.shutdown()


@pytest.fixture
def forced(server, monkeypatch):
    """``forced.append(text)``: the next chat request's reply is constrained to exactly ``text``."""
    script: list[str] = []
    real = server_app.constraints_for

    def constraints(s, req):
        if not script:
            return real(s, req)
        grammar = f"start: {json.dumps(script.pop(0))}\n"
        return [s.grammars.constraint(grammar, "test script")]
    monkeypatch.setattr(server_app, "constraints_for", constraints)
    return script


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


USER = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a module."}]


def prompt_of(server: str, body: dict) -> str:
    return httpx.post(server + "/apply-template", json=body).json()["prompt"]


# ----- reasoning ----------------------------------------------------------------------------------
def test_openai_streamed_reasoning_then_answer(server, oai, forced):
    forced.append(THOUGHT + "\n</think>\n\n" + ANSWER)
    stream = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=60, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks]
    content = [c.choices[0].delta.content for c in chunks]
    assert "".join(r for r in reasoning if r) == THOUGHT and "".join(c for c in content if c) == ANSWER
    assert sum(1 for r in reasoning if r) > 1                             # deltas, as generated
    first_answer = next(i for i, c in enumerate(content) if c)
    assert all(not r for r in reasoning[first_answer:])                  # thinking first, then the answer
    assert chunks[-1].choices[0].finish_reason == "stop"
    forced.append(THOUGHT + "\n</think>\n\n" + ANSWER)
    whole = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=60, extra_body={"temperature": 0})
    message = whole.choices[0].message
    assert message.content == ANSWER and message.model_extra["reasoning_content"] == THOUGHT


def test_reasoning_format_none_and_template_kwargs(server, oai, forced):
    forced.append(THOUGHT + "\n</think>\n\n" + ANSWER)
    raw = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=60, temperature=0,
                                      extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == THOUGHT + "\n</think>\n\n" + ANSWER
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    # enable_thinking=false reaches the template: the prompt closes an empty thinking block
    assert prompt_of(server, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content and "reasoning_content" not in plain.choices[0].message.model_extra
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=USER, extra_body={"reasoning_format": "loud"})


def test_thinking_sent_back_keeps_the_prefix_cache(server, oai, forced):
    """The client returns reasoning_content; the template re-renders the turn token for token."""
    forced.append(THOUGHT + "\n</think>\n\n" + ANSWER)
    first = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=60, extra_body={"temperature": 0})
    reply = first.choices[0].message
    history = USER + [{"role": "assistant", "content": reply.content,
                       "reasoning_content": reply.model_extra["reasoning_content"]},
                      {"role": "user", "content": "Another?"}]
    kwargs = {"preserve_thinking": True}
    assert prompt_of(server, {"messages": history, "chat_template_kwargs": kwargs}).startswith(
        prompt_of(server, {"messages": USER}) + THOUGHT + "\n</think>\n\n" + ANSWER)
    second = oai.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": kwargs})
    n_first = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= n_first - 2


# ----- tool calls ----------------------------------------------------------------------------------
def collect_calls(chunks) -> tuple[dict, int]:
    """Tool calls put together from streamed deltas, and how many chunks carried arguments."""
    calls, n_arg_chunks = {}, 0
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
            n_arg_chunks += bool(d.function.arguments)
    return calls, n_arg_chunks


def test_openai_streamed_parallel_tool_calls_round_trip(server, oai, forced):
    forced.append("\n</think>\n\n" + TWO_CALLS)
    stream = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=120, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    calls, n_arg_chunks = collect_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("read_file", {"limit": 20}), ("get_weather", {"city": "Oslo"})]
    assert n_arg_chunks > 4 and all(c["id"].startswith("call_") for c in calls.values())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Both."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    usage = chunks[-1].usage
    # the client runs the tools and sends the calls and results back: the turn re-renders as generated
    history = USER + [{"role": "assistant", "content": "Both.", "reasoning_content": "",
                       "tool_calls": [{"id": c["id"], "type": "function",
                                       "function": {"name": c["name"], "arguments": c["arguments"]}}
                                      for c in calls.values()]},
                      {"role": "tool", "tool_call_id": calls[0]["id"], "content": "127.0.0.1 localhost"},
                      {"role": "tool", "tool_call_id": calls[1]["id"], "content": "light rain, 7 C"}]
    prompt = prompt_of(server, {"messages": history, "tools": TOOLS})
    assert prompt.startswith(prompt_of(server, {"messages": USER, "tools": TOOLS}) + "\n</think>\n\n" + TWO_CALLS)
    answer = oai.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=6,
                                         temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens + usage.completion_tokens - 2


def test_forced_tool_call_uses_the_template_format(server, oai):
    """tool_choice "required": the model's own greedy call, constrained to Qwen3.5's XML form."""
    r = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                    max_tokens=80, extra_body={"temperature": 0})
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("read_file", "get_weather")
    assert isinstance(args.get("path", args.get("city")), str)


# ----- Anthropic's Messages API ---------------------------------------------------------------------
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
A_USER = [{"role": "user", "content": "Name a module."}]


@pytest.fixture
def ant(server):
    import anthropic
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def test_anthropic_streamed_thinking_then_text(ant, forced):
    forced.append(THOUGHT + "\n</think>\n\n" + ANSWER)
    with ant.messages.stream(model="claude-any-name", max_tokens=60, system=[{"type": "text", "text": "Be brief."}],
                             messages=A_USER, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.count("thinking_delta") > 1 and "text_delta" in deltas
    assert deltas.index("text_delta") > max(i for i, d in enumerate(deltas) if d == "thinking_delta")
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER
    assert final.stop_reason == "end_turn" and final.model == "claude-any-name"
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0


def test_anthropic_streamed_parallel_tool_use_round_trip(ant, forced):
    forced.append("\n</think>\n\n" + TWO_CALLS)
    with ant.messages.stream(model="tiny", max_tokens=120, messages=A_USER, tools=A_TOOLS) as stream:
        events = list(stream)
        first = stream.get_final_message()
    json_deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(json_deltas) > 4 and first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("read_file", {"limit": 20}),
                                                ("get_weather", {"city": "Oslo"})]
    assert all(u.id.startswith("toolu_") for u in uses) and first.content[0].text == "Both."
    # results go back as tool_result blocks; the assistant turn (with its empty thinking) re-renders as
    # generated, so the next request reads all of it from the cache
    history = A_USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": uses[0].id, "content": "127.0.0.1 localhost"},
                            {"type": "tool_result", "tool_use_id": uses[1].id,
                             "content": [{"type": "text", "text": "light rain, 7 C"}]}]}]
    answer = ant.messages.create(model="tiny", max_tokens=4, messages=history, tools=A_TOOLS,
                                 thinking={"type": "disabled"})
    n_first = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert answer.usage.cache_read_input_tokens >= n_first - 2
    counted = ant.messages.count_tokens(model="tiny", messages=history, tools=A_TOOLS, thinking={"type": "disabled"})
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_anthropic_stop_sequence_forced_tool_and_errors(server, ant):
    plain = ant.messages.create(model="tiny", max_tokens=12, messages=A_USER, thinking={"type": "disabled"},
                                extra_body={"temperature": 0})
    text = plain.content[0].text
    assert plain.stop_reason in ("max_tokens", "end_turn")
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    cut = ant.messages.create(model="tiny", max_tokens=12, messages=A_USER, thinking={"type": "disabled"},
                              stop_sequences=[stop], extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text if cut.content else "")
    forced_call = ant.messages.create(model="tiny", max_tokens=80, messages=A_USER, tools=A_TOOLS,
                                      tool_choice={"type": "tool", "name": "get_weather"},
                                      extra_body={"temperature": 0})
    assert forced_call.stop_reason == "tool_use" and forced_call.content[-1].name == "get_weather"
    assert isinstance(forced_call.content[-1].input["city"], str)
    import anthropic
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    bad_call = A_USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                             "input": "not an object"}]}]
    r = httpx.post(server + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": bad_call})
    assert r.status_code == 400 and "a tool_use block needs 'name' as a string and 'input' as a JSON object" \
        in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/messages", json={"model": "tiny", "messages": A_USER})      # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")
    r = httpx.post(server + "/v1/messages", json={}, headers={"Host": "evil.example"})   # DNS rebinding check
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


# ----- a long agent session, small -----------------------------------------------------------------
def load_bench():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "agent_session.py"
    spec = importlib.util.spec_from_file_location("agent_session", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                                   # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_agent_session_prefills_only_new_tokens_and_matches_a_cold_server():
    """benchmarks/agent_session.py's scripted session, short: tool calls (the model's own, forced by
    tool_choice), tool results of real text, a text answer and a new user turn. Every turn after the
    first reads the whole previous prompt and reply from the cache; the Anthropic session renders the
    same prompts and answers the same; a server without prefix reuse answers the same too."""
    bench = load_bench()
    turns, chars, every, kv = 4, 600, 3, ("q8_0", "turbo4")
    handle, base = bench.serve(1536, *kv)
    try:
        warm = bench.openai_session(base, turns, chars, every=every)
        other = bench.anthropic_session(base, turns, chars, every=every)
    finally:
        handle.shutdown()
    handle, base = bench.serve(1536, *kv, prefix_cache=False)
    try:
        cold = bench.openai_session(base, turns, chars, every=every)
    finally:
        handle.shutdown()
    assert warm.turns[-1].prompt > 700 and any(t.reply[1] for t in warm.turns) and warm.turns[2].reply[1] == ()
    for s in (warm, other):
        assert all(t.cached >= s.reusable(i) - 1 for i, t in enumerate(s.turns) if i > 0)
    assert [t.reply for t in warm.turns] == [t.reply for t in other.turns] == [t.reply for t in cold.turns]
    assert all(t.cached == 0 for t in cold.turns)


def test_thirty_turn_session_reads_every_earlier_turn_from_the_cache():
    """The 30-turn session of the agents' issue, with short tool results so that it fits the suite:
    through both APIs, every turn after the first reads the whole previous prompt and reply from
    the cache, and at the last turn the cache holds nearly all of the prompt."""
    bench = load_bench()
    turns, chars = 30, 40
    handle, base = bench.serve(6144, "q8_0", "turbo4")
    try:
        sessions = [bench.openai_session(base, turns, chars, max_text=4),
                    bench.anthropic_session(base, turns, chars, max_text=4)]
    finally:
        handle.shutdown()
    for s in sessions:
        assert len(s.turns) == turns
        assert all(t.cached >= s.reusable(i) - 1 for i, t in enumerate(s.turns) if i > 0)
        assert s.turns[-1].cached / s.turns[-1].prompt >= 0.95
    assert [t.reply for t in sessions[0].turns] == [t.reply for t in sessions[1].turns]
