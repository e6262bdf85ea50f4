"""``kvslim serve`` tried as an attacker or an orchestrator would: a real server on 127.0.0.1.

Each test reproduces a defect of the hand-written ``http.server`` layer (poisoned
sampling values, keep-alive desync, slow or huge bodies, slowloris, SIGTERM,
malformed input answered 500, ...) and checks the behaviour that replaced it.
"""
from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvslim.engine import EngineConfig
from kvslim.engine import Engine, SamplingParams
from kvslim.engine.sampling import Sampler
from kvslim.loading import load_model
from kvslim.server import start
from kvslim.server.scheduler import Job, Scheduler, SequenceFailed

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Name a module."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def options(model=None, **over) -> dict:
    engine = {"ctx": 512, "n_parallel": 4, "type_k": "q8_0", "type_v": "q8_0", "n_ubatch": 64,
              "max_checkpoints": 8, "checkpoint_bytes": 64 << 20, "checkpoint_interval": 64}
    engine.update({k: over.pop(k) for k in list(over) if k in engine})
    base = {"model": None if model is None else str(model), "dtype": "f32", "api_key": None, "alias": "tiny",
            "max_queue": 64, "verbose": False, "max_body": 1 << 20, "read_timeout": 1.0,
            "engine_config": EngineConfig.build(device="cpu", prefix_cache=True, **engine)}
    return {**base, **over}


def wait_ready(base: str, headers: dict | None = None) -> None:
    for _ in range(1200):
        try:
            if httpx.get(base + "/health", headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("server did not become ready")


@pytest.fixture(scope="module")
def server(tiny_folder):
    port = free_port()
    srv = start(options(tiny_folder("qwen3_5")[0]), "127.0.0.1", port)   # a hybrid: KV cache and DeltaNet state
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    yield base
    srv.shutdown()


def stream_text(base: str, body: dict, timeout: float = 120) -> tuple[str, list[str]]:
    """Concatenated text and the raw SSE data lines of a streamed completion."""
    lines, text = [], ""
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line[6:] != "[DONE]" and "choices" in (obj := json.loads(line[6:])) and obj["choices"]:
                    text += obj["choices"][0]["text"]
    return text, lines


def greedy(i: int, n: int = 24) -> dict:
    return {"model": "tiny", "prompt": f"Item {i}: the", "max_tokens": n, "temperature": 0}


# ----- 1. one request's sampling cannot end the others ---------------------------------------
def test_poisoned_sampling_values_leave_other_streams_alone(server):
    alone = [stream_text(server, greedy(i, 12))[0] for i in range(3)]
    poisons = [{"temperature": 1e-40}, {"repeat_penalty": 1e-300, "temperature": 0.8}]
    with cf.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_text, server, greedy(i, 12)) for i in range(3)]
        time.sleep(0.1)
        bad = [httpx.post(server + "/v1/completions", json={**greedy(9, 4), **p}, timeout=60) for p in poisons]
        together = [f.result() for f in streams]
    assert [r.status_code for r in bad] == [200, 400], [r.text for r in bad]  # greedy, or refused; never 500
    for (text, lines), expected in zip(together, alone):
        assert lines[-1] == "[DONE]" and not any('"error"' in ln for ln in lines)
        assert text == expected


class Exploding:
    """A constraint whose mask fails on its ``after``-th call: a sampling failure in one sequence."""

    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def allowed(self, n_vocab: int):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("boom")
        import torch
        return torch.ones(n_vocab, dtype=torch.bool)

    def accept(self, token: int) -> None:
        pass


def run_jobs(engine, prompts, poison: bool) -> tuple[list[list[int]], list]:
    import queue
    sched, out = Scheduler(engine), queue.Queue()
    jobs = [Job(p, 16, SamplingParams(temperature=0), [], emit=lambda ev, i=i: out.put((i, ev)), index=i)
            for i, p in enumerate(prompts)]
    if poison:
        jobs.append(Job(prompts[0], 16, SamplingParams(temperature=0), [], emit=lambda ev: out.put((-1, ev)),
                        constraint=Exploding(after=3), index=-1))
    sched.submit(jobs)
    ends = {}
    while len(ends) < len(jobs):
        i, ev = out.get(timeout=120)
        if ev[0] != "text":
            ends[i] = ev
    sched.shutdown()
    return [ends[i][1].generated for i in range(len(prompts))], ends.get(-1)


def test_failing_sequence_ends_alone_and_survivors_match(tiny_folder):
    """The scheduler and engine end only the failing sequence; the others (DeltaNet state and KV cache
    sharing the batch) produce exactly what they produce without it, and the slot serves again."""
    model, tok, eos = load_model(str(tiny_folder("qwen3_5")[0]), "f32")
    prompts = [tok.encode(f"Item {i}: the json module") for i in range(3)]

    def engine():
        return Engine(model, tok, EngineConfig.build(256, 4, "q8_0", "turbo4", device="cpu", n_ubatch=64, prefix_cache=True))
    clean, _ = run_jobs(engine(), prompts, poison=False)
    e = engine()
    survivors, failed = run_jobs(e, prompts, poison=True)
    assert failed[0] == "error" and isinstance(failed[1], SequenceFailed) and "boom" in str(failed[1])
    assert survivors == clean
    again, _ = run_jobs(e, prompts, poison=False)                      # slots, prefix cache still sound
    assert again == clean


def test_sampler_treats_tiny_temperature_as_greedy_and_checks_penalties():
    import torch
    logits = torch.randn(300)
    assert Sampler(SamplingParams(temperature=1e-40))(logits) == int(logits.argmax())
    for bad in ({"repeat_penalty": 1e-300}, {"repeat_penalty": float("nan")}, {"temperature": float("inf")},
                {"frequency_penalty": 1e308}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ----- 2. early replies keep the connection in sync ----------------------------------------
def test_early_error_leaves_no_body_behind(server):
    port = int(server.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/nothing", body=b'{"prompt": "' + b"x" * 5000 + b'"}',
                 headers={"Content-Type": "application/json"})
    first = conn.getresponse()
    assert first.status == 404 and json.loads(first.read())["error"]["code"] == "not_found"
    conn.request("GET", "/health")                                    # same connection, if the server kept it
    second = conn.getresponse()
    assert second.status == 200 and json.loads(second.read()) == {"status": "ok"}


def test_pooled_client_survives_a_404(server):
    with httpx.Client(base_url=server) as client:                     # what the openai client does underneath
        assert client.post("/v1/nothing", json={"model": "tiny", "messages": CHAT}).status_code == 404
        ok = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"


# ----- 3. big bodies: refused before reading or before tokenizing ----------------------------
def test_body_over_the_limit_is_refused_before_reading(server):
    r = httpx.post(server + "/v1/completions", content=b"x" * (2 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_prompt_too_long_by_characters_is_refused_before_tokenizing(server):
    r = httpx.post(server + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "word " * 180_000}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and "characters" in error["message"]


# ----- 5. slow clients are cut off; streams are not --------------------------------------------
def test_slowloris_and_short_bodies_are_closed(server):
    port = int(server.rsplit(":", 1)[1])
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")      # headers never finish
        socks.append(s)
    short = socket.create_connection(("127.0.0.1", port))
    short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{\"a\"")
    for s in socks + [short]:
        s.settimeout(10)
    assert all(s.recv(100) == b"" for s in socks)                      # closed by the server (read timeout 1 s)
    reply = short.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408")
    for s in socks + [short]:
        s.close()


def test_long_stream_outlives_the_read_timeout(tiny_folder):
    # its own server with a read timeout far shorter than the stream: the shared one's 1 s was
    # longer than a whole 500-token stream (0.8 s with the torch step, 0.15 s with the native
    # one), and 500 tokens took 0.07 s on a fast AMD EPYC, under a 0.05 s timeout's margin;
    # 1,500 tokens against 0.01 s leave room on faster machines
    timeout = 0.01
    port = free_port()
    srv = start(options(tiny_folder("qwen3_5")[0], read_timeout=timeout), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        t0 = time.monotonic()
        text, lines = stream_text(base, {**greedy(3, 1500), "temperature": 1.0, "seed": 5})
        took = time.monotonic() - t0
    finally:
        srv.shutdown()
    assert lines[-1] == "[DONE]" and not any('"error"' in ln for ln in lines)
    assert took > 5 * timeout, f"the stream took {took:.3f} s: too short to outlive the {timeout} s read timeout"


# ----- malformed input: 400, never 500 ------------------------------------------------------------
MALFORMED = {
    "text part not a string": json.dumps({"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(),
    "100k-deep JSON": b"[" * 100_000 + b"]" * 100_000,
    "lone surrogate": b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
    "invalid UTF-8": b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    # past Python's 4300-digit limit json.loads raises a plain ValueError (it was a 500)
    "5000-digit integer": b'{"model": "tiny", "messages": [], "max_tokens": 1' + b"0" * 5000 + b"}",
    # tools the template and the grammar cannot read (a string function was a 500)
    "function as a string": json.dumps({"model": "tiny", "messages": CHAT,
                                        "tools": [{"type": "function", "function": "get_time"}]}).encode(),
    "tools of numbers": json.dumps({"model": "tiny", "messages": CHAT, "tools": [1, 2]}).encode(),
    "tool_choice function as a string": json.dumps({
        "model": "tiny", "messages": CHAT, "tools": [{"type": "function", "function": {"name": "get_time"}}],
        "tool_choice": {"type": "function", "function": "get_time"}}).encode(),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_bodies_are_client_errors(server, case):
    r = httpx.post(server + "/v1/chat/completions", content=MALFORMED[case],
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]


@pytest.mark.parametrize("turn, field", [
    ({"role": "assistant", "tool_calls": ["get_time"]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": {"function": {"name": "f"}}}, "messages[1].tool_calls"),
    ({"role": "tool", "content": "12:00", "tool_call_id": 7}, "messages[1].tool_call_id"),
])
def test_a_turn_the_template_cannot_read_is_named(server, turn, field):
    # these reached the chat template and came back as "'str' object has no attribute 'get'"
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": [CHAT[0], turn]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and error["message"].startswith(field)


def test_apply_template_with_a_non_object_body(server):
    r = httpx.post(server + "/apply-template", json=[1, 2])
    assert r.status_code == 400


def test_bad_content_length_is_400(server):
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ²\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.1 400")


def test_head_and_options(server):
    head = httpx.head(server + "/health")
    assert head.status_code == 200 and head.content == b""
    options_ = httpx.options(server + "/v1/chat/completions")
    assert options_.status_code == 204 and "POST" in options_.headers["allow"]


def test_top_logprobs_needs_logprobs(server):
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "top_logprobs": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_null_max_completion_tokens_leaves_max_tokens_in_force(server):
    """Clients that serialize unset fields send ``max_completion_tokens: null``: the reply ran to the context."""
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 3, "max_completion_tokens": None, "ignore_eos": True}
    usage = httpx.post(server + "/v1/chat/completions", json=body, timeout=120).json()["usage"]
    assert usage["completion_tokens"] == 3
    r = httpx.post(server + "/v1/chat/completions", json={**body, "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_top_p_zero_is_greedy(server):
    """OpenAI's top_p range includes 0 (the server's own check said so, then the sampler refused it)."""
    greedy_text = httpx.post(server + "/v1/completions", json=greedy(4, 8)).json()["choices"][0]["text"]
    r = httpx.post(server + "/v1/completions", json={**greedy(4, 8), "temperature": 1.0, "top_p": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text


def test_seed_outside_64_bits_is_named_and_minus_one_is_random(server):
    from kvslim.server.openai_api import parse_sampling
    r = httpx.post(server + "/v1/completions", json={**greedy(1, 2), "seed": 2 ** 64})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "seed" and "64-bit" in error["message"]
    assert parse_sampling({"seed": -1}).seed is None                  # llama-server's "random seed"
    assert parse_sampling({"seed": 7}).seed == 7


def test_tokenize_with_pieces(server):
    r = httpx.post(server + "/tokenize", json={"content": "The json module", "with_pieces": True}).json()
    ids = httpx.post(server + "/tokenize", json={"content": "The json module"}).json()["tokens"]
    assert [t["id"] for t in r["tokens"]] == ids and "".join(t["piece"] for t in r["tokens"]) == "The json module"


def test_host_header_is_checked_without_a_key(server):
    port = server.rsplit(":", 1)[1]
    assert httpx.get(server + "/v1/models", headers={"Host": f"localhost:{port}"}).status_code == 200
    r = httpx.get(server + "/v1/models", headers={"Host": f"attacker.example:{port}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_host"


def test_metrics_parse_as_prometheus(server):
    from prometheus_client.parser import text_string_to_metric_families
    names = {f.name for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    assert {"kvslim:requests_processing", "kvslim:prompt_tokens", "kvslim:kv_cache_usage_ratio"} <= names


# ----- chaos: disconnects and poison among concurrent streams --------------------------------------
def test_disconnects_and_poison_leave_survivors_exact_and_slots_free(server):
    alone = {i: stream_text(server, greedy(i, 8))[0] for i in range(6)}

    def leave_early(i):
        with httpx.stream("POST", server + "/v1/completions", json={**greedy(i, 400), "stream": True},
                          timeout=60) as r:
            next(r.iter_lines())

    def poison(i):
        bodies = [b'{"model": "tiny", "prompt": "\xff\xfe", "stream": true}',
                  json.dumps({**greedy(i), "temperature": 1e-40, "stream": True}).encode(),
                  json.dumps({**greedy(i), "prompt": "x" * 2_000_000}).encode()]
        return httpx.post(server + "/v1/completions", content=bodies[i % 3], timeout=60).status_code

    with cf.ThreadPoolExecutor(16) as pool:
        survivors = {i: pool.submit(stream_text, server, greedy(i, 8)) for i in range(6)}
        gone = [pool.submit(leave_early, 100 + i) for i in range(3)]
        codes = [pool.submit(poison, i).result() for i in range(3)]
        results = {i: f.result() for i, f in survivors.items()}
        [f.result() for f in gone]
    assert sorted(codes) == [200, 400, 413]
    assert {i: r[0] for i, r in results.items()} == alone
    assert all(r[1][-1] == "[DONE]" for r in results.values())
    for _ in range(200):
        if not any(s["is_processing"] for s in httpx.get(server + "/slots").json()):
            break
        time.sleep(0.05)
    metrics = httpx.get(server + "/metrics").text
    assert "kvslim:requests_processing 0.0" in metrics and "kvslim:requests_deferred 0.0" in metrics


def metric(base: str, name: str) -> float:
    line = next(ln for ln in httpx.get(base + "/metrics").text.splitlines() if ln.startswith(f"kvslim:{name} "))
    return float(line.split()[1])


def wait_for(check, what: str, seconds: float = 30) -> None:
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(what)


def test_client_leaving_while_queued_frees_its_place_and_handler(tiny_folder):
    """A non-streamed request whose client leaves while it waits for a slot: its queue place frees at
    once (it kept a later client out with 503) and its handler ends (it waited forever for an event)."""
    port = free_port()
    # a long context: the running stream must outlast the steps below on a fast machine
    srv = start(options(tiny_folder("qwen3_5")[0], n_parallel=1, max_queue=1, ctx=16384), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        with httpx.stream("POST", base + "/v1/completions", timeout=60,
                          json={**greedy(1, 100_000), "stream": True, "ignore_eos": True}) as running:
            lines = running.iter_lines()                              # (a dropped iterator closes the stream)
            next(lines)                                               # it holds the only slot
            with pytest.raises(httpx.ReadTimeout):                    # queued, then gone
                httpx.post(base + "/v1/completions", json=greedy(2, 2), timeout=0.5)
            wait_for(lambda: metric(base, "requests_deferred") == 0, "the departed request still holds its place")
            with cf.ThreadPoolExecutor(1) as pool:
                later = pool.submit(httpx.post, base + "/v1/completions", json=greedy(3, 2), timeout=60)
                wait_for(lambda: metric(base, "requests_deferred") == 1 or later.done(), "it never queued")
                running.close()                                       # frees the slot for it
                assert later.result().status_code == 200
        wait_for(lambda: not srv.server.server_state.tasks, "a request handler is still running")
    finally:
        srv.shutdown()


# ----- features agents use -------------------------------------------------------------------------
def test_logprobs_chat_and_completions(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="-", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:                                            # greedy: the chosen token is the top one
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    done = client.completions.create(model="tiny", prompt="The json module", max_tokens=4, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.top_logprobs[0]) == 2


def test_n_choices(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="-", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, n=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1        # greedy: three equal answers
    stream = client.completions.create(model="tiny", prompt="abc", max_tokens=3, n=2, temperature=1.0, seed=3,
                                       stream=True)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "count": {"type": "integer", "minimum": 0, "maximum": 999},
                                            "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}


def test_json_schema_output_validates(server):
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=server + "/v1", api_key="-", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for seed in range(2):
        out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=120, temperature=0.8,
                                             seed=seed, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    obj = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0.8, seed=1,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_forced_tool_calls(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="-", max_retries=0)
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
        for name in ("get_weather", "get_time")]
    for choice, names in [("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})]:
        out = client.chat.completions.create(model="tiny", messages=CHAT, tools=tools, tool_choice=choice,
                                             max_tokens=80, temperature=0.8, seed=0)
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name in names
        assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_unknown_fields_ignored_unless_strict(server, tiny_folder):
    ok = httpx.post(server + "/v1/completions", json={**greedy(1, 2), "frobnicate": 1})
    assert ok.status_code == 200
    port = free_port()
    srv = start(options(tiny_folder("llama")[0], strict=True), "127.0.0.1", port)
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={**greedy(1, 2), "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    finally:
        srv.shutdown()


# ----- auth ------------------------------------------------------------------------------------------
def test_api_key_file_and_x_api_key(tiny_folder, tmp_path):
    from kvslim.tools.serve import api_keys, build_parser
    (tmp_path / "keys").write_text("# team keys\nalpha\n\nbeta\n")
    args = build_parser().parse_args(["--api-key-file", str(tmp_path / "keys")])
    keys = api_keys(args)
    assert keys == ["alpha", "beta"]
    with pytest.raises(ValueError, match="empty"):
        api_keys(build_parser().parse_args(["--api-key", ""]))
    port = free_port()
    srv = start(options(tiny_folder("llama")[0], api_keys=keys), "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/v1/models", headers={"X-Api-Key": "beta"}).status_code == 200
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer alpha"}).status_code == 200
        assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer gamma"}).status_code == 401
    finally:
        srv.shutdown()


def test_serve_help_says_c_is_the_total():
    from kvslim.tools.serve import build_parser
    assert "total context" in build_parser().format_help()


# ----- 4. lifecycle: load failure, SIGTERM -----------------------------------------------------------
def test_failed_model_load_exits_nonzero(tmp_path):
    """A folder whose config.json parses (so the server starts) but whose weights are missing:
    the background load fails and the server exits with 1. (A -m that is no model at all is
    refused before listening: tests/test_tools.py.)"""
    import shutil

    from kvslim.loading import default_model
    from kvslim.tools.serve import main
    shutil.copy(default_model() / "config.json", tmp_path / "config.json")
    t0 = time.monotonic()
    assert main(["-m", str(tmp_path), "--port", str(free_port())]) == 1
    assert time.monotonic() - t0 < 60


def sse_outcome(base: str, i: int) -> str:
    """'complete', 'error' (an error event, then [DONE]) or 'refused' (an HTTP error answer)."""
    try:
        with httpx.stream("POST", base + "/v1/completions", timeout=120,
                          json={**greedy(i, 100_000), "stream": True, "ignore_eos": True}) as r:
            if r.status_code != 200:
                r.read()
                return "refused" if r.json()["error"]["message"] else "bad"
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.TransportError as err:
        return f"transport error {err!r}"
    if lines[-1] != "[DONE]":
        return "cut"
    return "error" if any('"error"' in ln for ln in lines[:-1]) else "complete"


def test_sigterm_drains_and_exits_zero(tiny_folder):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvslim", "serve", "-m", str(tiny_folder("qwen3_5")[0]),
                             "-c", "65536", "-np", "4", "--port", str(port), "--grace", "2", "-a", "tiny"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_ready(base)
        with cf.ThreadPoolExecutor(6) as pool:
            # 4 running, 2 queued; EOS ignored and 16K tokens of context each, so the streams
            # outlast the wait below at the native step's speed (they stopped at an EOS first)
            outcomes = [pool.submit(sse_outcome, base, i) for i in range(6)]
            for _ in range(600):                                      # 4 running and 2 queued, then SIGTERM
                metrics = httpx.get(base + "/metrics").text
                if "kvslim:requests_processing 4.0" in metrics and "kvslim:requests_deferred 2.0" in metrics:
                    break
                time.sleep(0.05)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results = [f.result() for f in outcomes]
        answered = time.monotonic() - t0
        code = proc.wait(timeout=60)
        exited = time.monotonic() - t0
    finally:
        proc.kill()
    assert code == 0, proc.stdout.read().decode()[-2000:]
    assert all(r in ("complete", "error", "refused") for r in results), results
    assert results.count("refused") + results.count("error") >= 2
    # --grace 2: running streams end 0.75 s before it (transport.exit_reserve), every client
    # answered and the process gone within it; it took 2.4-3.4 s more when torch's teardown ran
    assert answered < 2.0, f"clients answered {answered:.2f} s after SIGTERM"
    assert exited < 2.0, f"exited {exited:.2f} s after SIGTERM with --grace 2"
