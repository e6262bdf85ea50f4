"""A real ``kvslim serve`` on 127.0.0.1, driven by the official openai client."""
from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time

import httpx
import pytest

from kvslim.engine import EngineConfig
from kvslim.server import start
from kvslim.server.parsing import parse_reply

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def options(model, **over) -> dict:
    engine = {"ctx": 512, "n_parallel": 4, "type_k": "q8_0", "type_v": "turbo4", "n_ubatch": 64,
              "max_checkpoints": 8, "checkpoint_bytes": 64 << 20, "checkpoint_interval": 64}
    engine.update({k: over.pop(k) for k in list(over) if k in engine})
    base = {"model": None if model is None else str(model), "dtype": "f32", "api_key": None, "alias": "tiny",
            "max_queue": 64, "verbose": False,
            "engine_config": EngineConfig.build(device="cpu", prefix_cache=True, **engine)}
    return {**base, **over}


def wait_ready(base: str) -> None:
    for _ in range(600):
        if httpx.get(base + "/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("server did not become ready")


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = start(options(None), "127.0.0.1", port)                   # the bundled model
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    yield base
    srv.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a module."}]


def test_health_models_and_metrics(server, client):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    text = httpx.get(server + "/metrics").text
    for name in ("kvslim:prompt_tokens_total", "kvslim:kv_cache_usage_ratio", "kvslim:requests_processing",
                 "kvslim:requests_deferred", "kvslim:prefix_cache_hits_total"):
        assert f"# TYPE {name}" in text


def test_chat_plain_and_streamed_agree(client):
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens <= 12 and plain.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason


def test_completions_and_tokenize(server, client):
    done = client.completions.create(model="tiny", prompt="The json module", max_tokens=6, temperature=0)
    assert done.object == "text_completion" and done.usage.completion_tokens <= 6
    ids = httpx.post(server + "/tokenize", json={"content": "The json module"}).json()["tokens"]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}).json()["content"] == "The json module"
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == done.choices[0].text


def test_second_turn_reuses_the_whole_first_turn(client):
    first = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    history = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "And another?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    # the first turn's prompt is always reused; its reply too when it re-tokenizes the same way
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@pytest.mark.parametrize("body, status, code", [
    ({"model": "nope", "messages": CHAT}, 404, "model_not_found"),
    ({"model": "tiny", "messages": CHAT, "max_tokens": 0}, 400, "invalid_value"),
    ({"model": "tiny", "messages": CHAT, "temperature": "hot"}, 400, "invalid_type"),
    ({"model": "tiny", "messages": []}, 400, None),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ({"model": "tiny", "messages": CHAT, "n": 0}, 400, "invalid_value"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 600}]}, 400, "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors(client, body, status, code):
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == status
    error = err.value.body if "message" in err.value.body else err.value.body["error"]
    assert error["message"] and error["type"] and error["code"] == code


def test_context_error_names_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="word " * 600, max_tokens=4)
    assert "512" in err.value.message and "context_length_exceeded" in str(err.value.body)


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(server + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_tool_call_round_trip(server, client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    asked = client.chat.completions.create(model="tiny", messages=CHAT, tools=tools, max_tokens=8, temperature=0)
    assert asked.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the client sends the call and its result back; the server renders and answers
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "light rain, 7 C"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=8,
                                            temperature=0)
    assert answer.choices[0].message.role == "assistant"
    prompt = httpx.post(server + "/apply-template", json={"messages": messages}).json()["prompt"]
    assert "light rain, 7 C" in prompt


def test_qwen_tool_call_text_becomes_tool_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    reply = parse_reply(text, tools=[{"type": "function", "function": {"name": "get_weather"}}])
    assert reply.content == "Let me check." and reply.calls[0]["name"] == "get_weather"
    assert json.loads(reply.calls[0]["arguments"]) == {"city": "Oslo"}
    assert parse_reply("<tool_call>not json</tool_call>", tools=[]).content == "<tool_call>not json</tool_call>"


def test_concurrent_streams_equal_one_at_a_time(client):
    prompts = [f"Item {i}: the" for i in range(12)]

    def one(p):
        stream = client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream)

    alone = [one(p) for p in prompts]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, prompts))
    assert together == alone


def test_disconnected_client_frees_its_slot(server):
    with httpx.stream("POST", server + "/v1/completions",
                      json={"model": "tiny", "prompt": "abc", "max_tokens": 400, "stream": True}) as r:
        next(r.iter_lines())
    for _ in range(100):
        if not any(s["is_processing"] for s in httpx.get(server + "/slots").json()):
            return
        time.sleep(0.05)
    raise AssertionError("slot still busy after the client left")


def test_queue_bound_answers_503(tiny_folder):
    port = free_port()
    srv = start(options(tiny_folder("qwen3_5")[0], n_parallel=1, max_queue=1), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)

    def post(_):
        return httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 300},
                          timeout=60)
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(post, range(8)))
        codes = sorted(r.status_code for r in replies)
        assert set(codes) == {200, 503} and codes.count(200) >= 2          # one running, one queued at least
        busy = [r.json()["error"] for r in replies if r.status_code == 503]
        assert all(e["code"] == "server_busy" for e in busy)
        # 3 choices never fit 1 slot and a queue of 1: a 400, not a 503 whose retry cannot succeed
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "at most 2 choices" in r.text
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        srv.shutdown()


def test_api_key_is_enforced(tiny_folder):
    port = free_port()
    srv = start(options(tiny_folder("llama")[0], api_key="sekrit"), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        assert ok.models.list().data[0].id == "tiny"
    finally:
        srv.shutdown()
