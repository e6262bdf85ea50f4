"""Load test and multi-turn prefix reuse for ``kvslim serve``, with the openai client.

    python benchmarks/server_load.py [-m MODEL] [--clients 16] [--requests 200] [-np 4] [--turns 8]

1. ``--requests`` greedy chat requests (distinct prompts) sent by ``--clients``
   concurrent streaming clients; every stream must finish without error and its
   text must equal the same request run alone (measured first, one at a time).
2. A conversation of ``--turns`` turns: per turn, prompt tokens, cached tokens
   (``usage.prompt_tokens_details.cached_tokens``) and time to first token. With
   prefix reuse the time to first token should not grow with the conversation.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.server import start  # noqa: E402
from kvslim.tools.common import markdown_table  # noqa: E402

TOPICS = ["the weather", "a letter", "the garden", "a journey", "music", "a dinner", "the sea", "a book",
          "the morning", "a visit", "the village", "an old house", "a dance", "the river", "a friend", "winter"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boot(args):
    port = free_port()
    opts = {"model": args.model, "ctx": args.ctx, "n_parallel": args.parallel, "type_k": args.ctk,
            "type_v": args.ctv, "n_ubatch": 512, "dtype": None, "api_key": None, "alias": "m",
            "max_queue": 4 * args.clients, "ctx_checkpoints": 8, "checkpoint_bytes": 256 << 20,
            "checkpoint_interval": 4096, "verbose": False}
    server = start(opts, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    while httpx.get(base + "/health").status_code != 200:
        time.sleep(0.1)
    return server, openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=600)


def chat_stream(client, i: int, max_tokens: int) -> str:
    messages = [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]} ({i})."}]
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def load_test(client, args) -> None:
    t0 = time.perf_counter()
    alone = [chat_stream(client, i, args.max_tokens) for i in range(args.requests)]
    t_alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.clients) as pool:
        futures = [pool.submit(chat_stream, client, i, args.max_tokens) for i in range(args.requests)]
        together, errors = [], 0
        for f in futures:
            try:
                together.append(f.result())
            except Exception as err:                               # counted and shown, never hidden
                errors += 1
                together.append(f"<error {err}>")
    t_together = time.perf_counter() - t0
    same = sum(a == b for a, b in zip(alone, together))
    print(f"load test: {args.requests} requests, {args.clients} concurrent streaming clients, -np {args.parallel}: "
          f"{errors} errors, {same}/{args.requests} identical to one-at-a-time; wall {t_alone:.1f} s alone vs "
          f"{t_together:.1f} s concurrent ({t_alone / t_together:.2f}x)")


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
    args = ap.parse_args()
    server, client = boot(args)
    try:
        if not args.skip_load:
            load_test(client, args)
        conversation(client, args)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
