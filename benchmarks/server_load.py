"""Load, robustness and multi-turn prefix reuse for ``kvslim serve``, with the openai client.

    python benchmarks/server_load.py [-m MODEL] [--clients 16] [--requests 200] [-np 4] [--turns 8]
                                     [--chaos] [--oversize] [--json-schema 50] [--server-process]

1. ``--requests`` greedy chat requests (distinct prompts) sent by ``--clients``
   concurrent streaming clients; every stream must finish without error and its
   text must equal the same request run alone (measured first, one at a time).
   Prints throughput (generated tokens/s) and time to first token under load.
2. A conversation of ``--turns`` turns: per turn, prompt tokens, cached tokens
   and time to first token. With prefix reuse the time to first token should
   not grow with the conversation.
3. ``--chaos``: the load test again with 30% of the clients leaving mid-stream
   and one poisoned request in ten (overflowing sampling values, invalid UTF-8,
   an oversize body); survivors must be exact, no slot may leak, and /metrics
   must return to idle.
4. ``--oversize``: a 32 MB body sent while a stream runs: time to the refusal,
   and the stream's inter-token gaps during it against its median.
5. ``--json-schema N``: N chat requests at temperature 0.8 with a json_schema
   response_format; every output is validated against the schema.
6. ``--sigterm``: ``kvslim serve`` as a process, SIGTERM while 4 streams run
   and 2 more wait: what each client received, exit code and time to exit.
``--server-process`` runs the server of 1-5 in its own process too (by default it runs on
threads in this one, where the clients' Python shares its GIL: the oversize upload's
client's threads then show up in the server's token gaps). ``--oversize`` uploads from a
process of its own, and each run has a control: the same upload to a sink process that
refuses it and does nothing else, so what the upload costs a 2-core machine is told apart
from what it costs the server.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import statistics
import subprocess
from types import SimpleNamespace
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.engine import EngineConfig  # noqa: E402
from kvslim.server import start  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

TOPICS = ["the weather", "a letter", "the garden", "a journey", "music", "a dinner", "the sea", "a book",
          "the morning", "a visit", "the village", "an old house", "a dance", "the river", "a friend", "winter"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boot(args):
    port = free_port()
    config = EngineConfig.build(args.ctx, args.parallel, args.ctk, args.ctv, n_ubatch=512,
                                prefix_cache=True, max_checkpoints=8, checkpoint_bytes=256 << 20,
                                checkpoint_interval=4096)
    opts = {"model": args.model, "engine_config": config, "dtype": None, "api_key": None, "alias": "m",
            "max_queue": 4 * args.clients, "verbose": False, "max_connections": 4 * args.clients + 64}
    server = start(opts, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    while httpx.get(base + "/health").status_code != 200:
        if server.state.load_error:
            raise SystemExit(f"the server could not load the model: {server.state.load_error}")
        time.sleep(0.1)
    return server, base, openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=600)


def chat_stream(client, i: int, max_tokens: int, leave_after: int | None = None) -> tuple[str, float, int]:
    """Text, time to first token and completion tokens (chunks) of one greedy streamed chat request."""
    messages = [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]} ({i})."}]
    t0, ttft, text, n = time.perf_counter(), float("nan"), "", 0
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    for chunk in stream:
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            ttft = ttft if n else time.perf_counter() - t0
            text, n = text + piece, n + 1
            if leave_after is not None and n >= leave_after:
                stream.close()                                     # the client goes away mid-stream
                return text, ttft, n
    return text, ttft, n


def run_all(pool_size: int, jobs: list) -> tuple[list, int, float]:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(pool_size) as pool:
        futures = [pool.submit(*job) for job in jobs]
        results, errors = [], 0
        for f in futures:
            try:
                results.append(f.result())
            except Exception as err:                               # counted and shown, never hidden
                errors += 1
                results.append(err)
    return results, errors, time.perf_counter() - t0


def load_test(client, args) -> list[str]:
    t0 = time.perf_counter()
    alone = [chat_stream(client, i, args.max_tokens)[0] for i in range(args.requests)]
    t_alone = time.perf_counter() - t0
    results, errors, wall = run_all(args.clients, [(chat_stream, client, i, args.max_tokens)
                                                   for i in range(args.requests)])
    ok = [r for r in results if isinstance(r, tuple)]
    same = sum(isinstance(r, tuple) and r[0] == a for a, r in zip(alone, results))
    tokens = sum(r[2] for r in ok)
    ttfts = sorted(1000 * r[1] for r in ok if r[2])
    print(f"load test: {args.requests} requests, {args.clients} concurrent streaming clients, -np {args.parallel}: "
          f"{errors} errors, {same}/{args.requests} identical to one-at-a-time; wall {t_alone:.1f} s alone vs "
          f"{wall:.1f} s concurrent ({t_alone / wall:.2f}x); {tokens / wall:.1f} generated tokens/s; TTFT median "
          f"{statistics.median(ttfts):.0f} ms, p90 {ttfts[int(0.9 * (len(ttfts) - 1))]:.0f} ms")
    return alone


def conversation(client, args) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    rows = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Tell me more about {TOPICS[turn % len(TOPICS)]}, "
                                                    f"in the style of a long old novel. " * 6})
        t0 = time.perf_counter()
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=args.max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        ttft, text, usage = None, "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        messages.append({"role": "assistant", "content": text})
        rows.append([turn + 1, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                     usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens,
                     f"{1000 * (ttft or float('nan')):.0f}"])
    print(markdown_table(["turn", "prompt tokens", "cached", "prefilled", "TTFT ms"], rows))
    later = [float(r[4]) for r in rows[1:]]
    print(f"TTFT over turns 2..{args.turns}: median {statistics.median(later):.0f} ms, first {later[0]:.0f} ms, "
          f"last {later[-1]:.0f} ms")


# ----- robustness ---------------------------------------------------------------------------------
def poison(base: str, i: int) -> int:
    """One poisoned request; returns its HTTP status (never expected to be 500)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    bodies = [json.dumps({**chat, "temperature": 1e-40}).encode(),
              json.dumps({**chat, "repeat_penalty": 1e-300, "temperature": 0.9}).encode(),
              b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
              b'{"model": "m", "prompt": "' + b"x" * (33 << 20) + b'"}']
    try:
        return httpx.post(base + "/v1/chat/completions", content=bodies[i % len(bodies)], timeout=120,
                          headers={"Content-Type": "application/json"}).status_code
    except httpx.TransportError:
        return -1                                                  # the connection was closed on a refusal


def chaos(client, base: str, alone: list[str], args) -> None:
    rng, jobs, kinds = random.Random(0), [], []
    for i in range(args.requests):
        if i % 10 == 9:
            jobs.append((poison, base, i // 10)), kinds.append("poison")
        elif rng.random() < 0.3:
            jobs.append((chat_stream, client, i, 400, rng.randint(1, 4))), kinds.append("leaves")
        else:
            jobs.append((chat_stream, client, i, args.max_tokens)), kinds.append("survivor")
    results, errors, wall = run_all(32, jobs)
    survivors = [(r, alone[i]) for i, (r, k) in enumerate(zip(results, kinds)) if k == "survivor"]
    bad = sum(not isinstance(r, tuple) for r, _ in survivors)
    exact = sum(isinstance(r, tuple) and r[0] == a for r, a in survivors)
    codes = sorted(r for r, k in zip(results, kinds) if k == "poison")
    for _ in range(200):
        if not any(s["is_processing"] for s in httpx.get(base + "/slots").json()):
            break
        time.sleep(0.05)
    leaked = sum(s["is_processing"] for s in httpx.get(base + "/slots").json())
    metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(base + "/metrics").text.splitlines()
               if line.startswith("kvslim:requests_")}
    print(f"chaos: {args.requests} requests from 32 concurrent clients, {kinds.count('leaves')} leave mid-stream, "
          f"{kinds.count('poison')} poisoned (HTTP {codes}): {bad} survivor errors, {exact}/{len(survivors)} "
          f"survivors identical to serial, {leaked} slots leaked, requests_processing "
          f"{metrics.get('kvslim:requests_processing')}, requests_deferred {metrics.get('kvslim:requests_deferred')}"
          f" ({errors} exceptions in all, {wall:.1f} s)")


UPLOADER = """
import socket, sys, threading, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = b'{"model": "m", "prompt": "' + b"x" * size + b'"}'
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
sock = socket.create_connection((host, port))
sock.sendall(("POST /v1/completions HTTP/1.1\\r\\nHost: %s\\r\\nContent-Type: application/json\\r\\n"
              "Content-Length: %d\\r\\n\\r\\n" % (host, len(body))).encode())
def push():
    try:
        sock.sendall(body)
    except OSError:
        pass
threading.Thread(target=push, daemon=True).start()
answer = sock.recv(4096).split(b"\\r\\n", 1)[0].decode()
print(answer, time.perf_counter() - t0, flush=True)
"""


SINK = """
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b"HTTP/1.1 413 Refused by the sink\\r\\nConnection: close\\r\\n\\r\\n")
    c.close()
"""


def sink_process() -> tuple[subprocess.Popen, str]:
    """A process that refuses every upload after its headers and does nothing else: the same
    32 MiB sent there shows what the upload costs the machine, with no kvslim in the way."""
    proc = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


class Uploader:
    """A 32 MiB upload from its own process, started and its body built before the window
    opens: nothing of it runs on the watching client's GIL, so the watched stream's gaps are
    the server's and the machine's."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").split(":")
        self.proc = subprocess.Popen([sys.executable, "-c", UPLOADER, host, port, str(32 << 20)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def __call__(self) -> tuple[str, float]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        status, seconds = self.proc.stdout.readline().strip().rsplit(" ", 1)
        self.proc.wait(60)
        return status, float(seconds)


def oversize(client, base: str, args, target: str | None = None) -> None:
    """A 32 MiB body sent while another client streams: the refusal's time, and the stream's
    inter-token gaps while the upload runs against the same stream's gaps before it.
    ``target``: send the body there instead of to the server (the sink's control run)."""
    stamps, done = [], threading.Event()
    upload = Uploader(target or base)

    def watch():
        messages = [{"role": "user", "content": "Tell me a long story."}]
        for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=args.gap_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
            stamps.append(time.perf_counter())
        done.set()
    threading.Thread(target=watch, daemon=True).start()
    while len(stamps) < args.gap_tokens // 2:
        time.sleep(0.01)
    t0 = time.perf_counter()
    status, t_refused = upload()
    t_end = time.perf_counter()
    done.wait(600)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    before = sorted(g for g, b in zip(gaps, stamps[1:]) if b < t0)     # gaps that ended before the upload began
    during = [g for a, g, b in zip(stamps, gaps, stamps[1:]) if b >= t0 and a <= t_end + 0.05] or [0.0]
    ordered = [g for g, b in zip(gaps, stamps[1:]) if b < t0]
    control = ordered[-len(during):]                                  # as many gaps, just before the upload
    median, p99 = statistics.median(before), before[int(0.99 * (len(before) - 1))]
    print(f"oversize{' (control: to the sink)' if target else ''}: 32 MiB body answered {status} in {1000 * t_refused:.0f} ms; the running stream's "
          f"inter-token gap before the upload: median {1000 * median:.2f} ms, p99 {1000 * p99:.2f} ms, "
          f"max {1000 * before[-1]:.2f} ms ({len(before)} gaps); during it ({1000 * (t_end - t0):.0f} ms, "
          f"{len(during)} gaps): median {1000 * statistics.median(during):.2f} ms "
          f"({statistics.median(during) / median:.2f}x), max {1000 * max(during):.2f} ms against "
          f"{1000 * max(control):.2f} ms over the {len(control)} gaps just before it")


SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                     "maxItems": 3},
                                            "ok": {"type": "boolean"}},
          "required": ["title", "year", "tags", "ok"], "additionalProperties": False}


def json_schema_runs(client, args) -> None:
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}
    valid, lengths, t0 = 0, [], time.perf_counter()
    for seed in range(args.json_schema):
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a book."}],
                                             max_tokens=200, temperature=0.8, seed=seed, response_format=fmt)
        try:
            jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as err:
            print(f"  seed {seed}: invalid ({out.choices[0].finish_reason}): {err}")
        lengths.append(out.usage.completion_tokens)
    print(f"json_schema: {valid}/{args.json_schema} outputs valid at temperature 0.8 (median "
          f"{statistics.median(lengths)} tokens, {time.perf_counter() - t0:.1f} s)")


def sse_outcome(base: str, i: int) -> str:
    """'complete', 'error event + [DONE]', 'HTTP <status>' or what went wrong."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}],
            "max_tokens": 100_000, "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                r.read()
                return f"HTTP {r.status_code} {r.json()['error']['code']}"
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.TransportError as err:
        return f"transport error {type(err).__name__}"
    if not lines or lines[-1] != "[DONE]":
        return "cut without [DONE]"
    return "error event + [DONE]" if any('"error"' in ln for ln in lines[:-1]) else "complete"


def spawn(flags: list[str], model: str | None) -> tuple[subprocess.Popen, str]:
    """``kvslim serve`` in its own process (as a deployment runs it: no GIL shared with the
    clients), once /health answers 200; its output goes to $KVSLIM_SERVE_LOG if set."""
    port, root = free_port(), Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "kvslim", "serve", "--port", str(port), "-a", "m", *flags] + \
        (["-m", model] if model else [])
    log = open(os.environ.get("KVSLIM_SERVE_LOG", os.devnull), "w")
    proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"kvslim serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/health").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def sigterm(args) -> None:
    proc, base = spawn(["-c", str(args.ctx * 4), "-np", "4", "--grace", str(args.grace)], args.model)
    with cf.ThreadPoolExecutor(6) as pool:
        outcomes = [pool.submit(sse_outcome, base, i) for i in range(6)]
        while not {"kvslim:requests_processing 4.0", "kvslim:requests_deferred 2.0"} <= \
                set(httpx.get(base + "/metrics").text.splitlines()):
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in outcomes]
        t_clients = time.perf_counter() - t0
    code = proc.wait(timeout=120)
    print(f"sigterm: 4 streams running, 2 queued; every client answered {t_clients:.2f} s and exit code {code} "
          f"{time.perf_counter() - t0:.2f} s after SIGTERM "
          f"(--grace {args.grace:g}); clients: " + ", ".join(f"{r} x{results.count(r)}" for r in sorted(set(results))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="context per slot")
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-ctv", default="f16")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-conversation", action="store_true")
    ap.add_argument("--chaos", action="store_true")
    ap.add_argument("--oversize", action="store_true")
    ap.add_argument("--server-process", action="store_true",
                    help="run kvslim serve in its own process (default: in this one, on threads)")
    ap.add_argument("--oversize-runs", type=int, default=5,
                    help="--oversize: runs, each beside a control upload to a sink process")
    ap.add_argument("--gap-tokens", type=int, default=400, help="length of the stream watched by --oversize")
    ap.add_argument("--json-schema", type=int, default=0, metavar="N")
    ap.add_argument("--sigterm", action="store_true", help="only the SIGTERM drain test (a separate process)")
    ap.add_argument("--grace", type=float, default=2.0, help="--grace given to the server in --sigterm")
    args = ap.parse_args()
    if args.sigterm:
        sigterm(args)
        return 0
    if args.server_process:
        proc, base = spawn(["-c", str(args.ctx * args.parallel), "-np", str(args.parallel), "-ctk", args.ctk,
                            "-ctv", args.ctv, "--max-queue", str(4 * args.clients),
                            "--max-connections", str(4 * args.clients + 64)], args.model)
        server = SimpleNamespace(shutdown=lambda: (proc.terminate(), proc.wait(60)))
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=600)
    else:
        server, base, client = boot(args)
    try:
        alone = None if args.skip_load else load_test(client, args)
        if not args.skip_conversation:
            conversation(client, args)
        if args.chaos:
            chaos(client, base, alone or [chat_stream(client, i, args.max_tokens)[0] for i in range(args.requests)],
                  args)
        if args.oversize:                                             # each run beside a control run
            sink, sink_base = sink_process()
            try:
                for _ in range(args.oversize_runs):
                    oversize(client, base, args)
                    oversize(client, base, args, target=sink_base)
            finally:
                sink.kill()
        if args.json_schema:
            json_schema_runs(client, args)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
