"""A long tool-using agent session through ``kvslim serve``: per turn, how much of the prompt came from
the cache and the time to first token, through the OpenAI and the Anthropic API.

    python benchmarks/agent_session.py [--turns 30] [--result-chars 2000] [-c 20480]
                                       [--kv f16/f16,q8_0/turbo4] [--api openai,anthropic] [--check-identical]

A scripted agent (the real clients, streaming, greedy) works through documents:
most turns the model must call ``read_file`` (``tool_choice`` required: its own
call, constrained to the template's Qwen3.5 XML form) and the agent answers with
the next ``--result-chars`` of held-out text (kvslim/data/text) as the tool result;
every 6th turn the model answers in text and the agent asks for the next file.
The bundled model runs with the Qwen3.5-format template, thinking off and
``preserve_thinking`` on (so earlier turns re-render as generated).

Per turn: prompt tokens, tokens read from the cache, their share of the prompt,
their share of what the cache could hold (the previous prompt and reply: the
goal is >= 95% after turn 1), and TTFT (goal: within 2x of turn 2's).
``--check-identical`` runs each session again on a server without prefix
reuse and compares every reply.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvslim.cache import backend_names  # noqa: E402
from kvslim.engine import EngineConfig  # noqa: E402
from kvslim.server import start  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

TEMPLATE = ROOT / "kvslim" / "data" / "templates" / "qwen3_5.jinja"
TEXTS = sorted((ROOT / "kvslim" / "data" / "text").glob("*.txt"))
SYSTEM = "You are a careful assistant. Read the files with read_file and summarise each in one sentence."
TASK = "Summarise the held-out documents, one file at a time."
NEXT = "Good. Go on with the next file."
TOOL = {"name": "read_file", "description": "Read the next part of a file",
        "parameters": {"type": "object", "properties": {"index": {"type": "integer", "minimum": 0, "maximum": 999}},
                       "required": ["index"]}}
TEXT_EVERY = 6                                       # every 6th turn the model answers in text


@dataclass
class Turn:
    prompt: int
    cached: int
    completion: int
    ttft: float
    reply: tuple = ()
    prefill_ms: float = float("nan")                 # the server's prompt time (OpenAI stream's timings)

    @property
    def share(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)

    def reusable(self, i: int) -> int:
        """Tokens the cache could hold for turn i: the previous turn's prompt and reply."""
        prev = self.turns[i - 1]
        return prev.prompt + prev.completion


def corpus() -> str:
    return "\n\n".join(p.read_text() for p in TEXTS)


def tool_result(turn: int, chars: int, text: str) -> str:
    start = (turn * chars * 7) % (len(text) - chars)              # spread over the corpus
    return text[start:start + chars]


def progress(i: int, t: Turn) -> None:
    print(f"  turn {i + 1}: prompt {t.prompt}, cached {t.cached}, reply {t.completion}, TTFT {1000 * t.ttft:.0f} ms, "
          f"prefill {t.prefill_ms:.0f} ms", file=sys.stderr, flush=True)


def is_text_turn(turn: int, every: int = TEXT_EVERY) -> bool:
    return turn % every == every - 1


def normal_reply(text: str, calls: list[tuple[str, str]]) -> tuple:
    """A reply as both APIs can be compared on: text and (name, canonical JSON arguments) per call."""
    return text, tuple((name, json.dumps(json.loads(args or "{}"), sort_keys=True)) for name, args in calls)


# ----- the OpenAI client ---------------------------------------------------------------------------
def openai_session(base: str, turns: int, chars: int, max_text: int = 16, every: int = TEXT_EVERY) -> Session:
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=1200)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    tools, text, out = [{"type": "function", "function": TOOL}], corpus(), Session()
    for t in range(turns):
        talk = is_text_turn(t, every)
        turn, content, calls = openai_turn(client, messages, tools, "none" if talk else "required",
                                           max_text if talk else 48)
        progress(t, turn)
        out.turns.append(turn)
        messages.append({"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(t, chars, text)} for c in calls]
        if not calls:
            messages.append({"role": "user", "content": NEXT})
    return out


def openai_turn(client, messages, tools, choice: str, max_tokens: int):
    t0, ttft, content, calls, usage, timings = time.perf_counter(), None, "", {}, None, {}
    stream = client.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice=choice,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        timings = (chunk.model_extra or {}).get("timings") or timings
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None or not (delta.content or delta.tool_calls):
            continue
        ttft = ttft or time.perf_counter() - t0
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += d.function.name or ""
            call["function"]["arguments"] += d.function.arguments or ""
    calls = list(calls.values())
    reply = normal_reply(content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    return Turn(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens,
                ttft or float("nan"), reply, timings.get("prompt_ms", float("nan"))), content, calls


# ----- the Anthropic client --------------------------------------------------------------------------
def anthropic_session(base: str, turns: int, chars: int, max_text: int = 16, every: int = TEXT_EVERY) -> Session:
    import anthropic
    client = anthropic.Anthropic(base_url=base, api_key="-", max_retries=0, timeout=1200)
    messages = [{"role": "user", "content": TASK}]
    tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
    text, out = corpus(), Session()
    for t in range(turns):
        talk = is_text_turn(t, every)
        turn, message = anthropic_turn(client, messages, tools, {"type": "none" if talk else "any"},
                                       max_text if talk else 48)
        progress(t, turn)
        out.turns.append(turn)
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in message.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                      "content": tool_result(t, chars, text)} for u in uses]
                         if uses else NEXT})
    return out


def anthropic_turn(client, messages, tools, choice: dict, max_tokens: int):
    t0, ttft = time.perf_counter(), None
    with client.messages.stream(model="m", system=SYSTEM, messages=messages, tools=tools, tool_choice=choice,
                                max_tokens=max_tokens, thinking={"type": "disabled"},
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            if ttft is None and event.type == "content_block_delta":
                ttft = time.perf_counter() - t0
        message = stream.get_final_message()
    u = message.usage
    reply = normal_reply("".join(b.text for b in message.content if b.type == "text"),
                         [(b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"])
    return Turn(u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, u.output_tokens,
                ttft or float("nan"), reply), message


SESSIONS = {"openai": openai_session, "anthropic": anthropic_session}


# ----- the server ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(ctx: int, type_k: str, type_v: str, prefix_cache: bool = True, model: str | None = None,
          dtype: str | None = "f32", backend: str = "bf16"):
    """The bundled model (or ``model``) behind a server with the Qwen3.5-format template; (handle, base URL)."""
    config = EngineConfig.build(ctx=ctx, n_parallel=1, type_k=type_k, type_v=type_v, device="cpu",
                                prefix_cache=prefix_cache, n_ubatch=512, max_checkpoints=8, backend=backend,
                                checkpoint_bytes=256 << 20, checkpoint_interval=4096)
    options = {"model": model, "dtype": dtype, "api_key": None, "alias": "m", "max_queue": 8, "verbose": False,
               "engine_config": config, "chat_template": TEMPLATE.read_text(),
               "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}
    port = free_port()
    handle, base = start(options, "127.0.0.1", port), f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(base + "/health").status_code == 200:
                return handle, base
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server did not start")


def run(api: str, turns: int, chars: int, ctx: int, type_k: str, type_v: str, prefix_cache: bool = True,
        **server) -> Session:
    handle, base = serve(ctx, type_k, type_v, prefix_cache, **server)
    try:
        return SESSIONS[api](base, turns, chars)
    finally:
        handle.shutdown()


# ----- report -------------------------------------------------------------------------------------
def summary(s: Session) -> dict:
    """Worst reuse after turn 1; TTFT and server prefill time of turn 2 against the later turns
    (the largest and the median of the last five: one slow turn on a busy machine shows in the first)."""
    reuse = [min(1.0, t.cached / s.reusable(i)) for i, t in enumerate(s.turns) if i > 0]
    out = {"turns": len(s.turns), "final_prompt": s.turns[-1].prompt, "min_reuse": round(min(reuse), 4),
           "median_share": round(statistics.median(t.share for t in s.turns[1:]), 4)}
    for name, values in (("ttft_ms", [1000 * t.ttft for t in s.turns[1:]]),
                         ("prefill_ms", [t.prefill_ms for t in s.turns[1:]])):
        if any(v != v for v in values):                          # no server timings (Anthropic's stream)
            continue
        late = statistics.median(values[-5:])
        out.update({f"{name}_turn2": round(values[0]), f"{name}_max": round(max(values)),
                    f"{name}_last5_median": round(late), f"{name}_last5_vs_turn2": round(late / values[0], 2)})
    return out


def table(s: Session) -> str:
    rows = []
    for i, t in enumerate(s.turns):
        reuse = "-" if i == 0 else f"{100 * min(1.0, t.cached / s.reusable(i)):.1f}%"
        rows.append([i + 1, t.prompt, t.cached, f"{100 * t.share:.1f}%", reuse, t.completion, f"{1000 * t.ttft:.0f}",
                     f"{t.prefill_ms:.0f}"])
    return markdown_table(["turn", "prompt", "cached", "cached/prompt", "cached/reusable", "reply", "TTFT ms",
                           "prefill ms"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=30)
    p.add_argument("--result-chars", type=int, default=2000, help="characters of each tool result")
    p.add_argument("-c", "--ctx-size", type=int, default=20480)
    p.add_argument("--kv", default="f16/f16,q8_0/turbo4", help="K/V cache types, comma-separated K/V pairs")
    p.add_argument("--api", default="openai,anthropic")
    p.add_argument("--check-identical", action="store_true", help="rerun without prefix reuse and compare")
    p.add_argument("--attn-backend", default="bf16", choices=backend_names(),
                   help="the server's attention backend (default bf16, as kvslim serve's; torch: float32)")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md")
    args = p.parse_args(argv)
    results = []
    for kv in args.kv.split(","):
        type_k, type_v = kv.split("/")
        for api in args.api.split(","):
            s = run(api, args.turns, args.result_chars, args.ctx_size, type_k, type_v, backend=args.attn_backend)
            row = {"api": api, "type_k": type_k, "type_v": type_v, "attn_backend": args.attn_backend, **summary(s)}
            if args.check_identical:
                cold = run(api, args.turns, args.result_chars, args.ctx_size, type_k, type_v, prefix_cache=False,
                           backend=args.attn_backend)
                row["identical"] = [t.reply for t in s.turns] == [t.reply for t in cold.turns]
            results.append(row)
            if args.output == "md":
                print(f"\n### {api}, -ctk {type_k} -ctv {type_v}\n\n{table(s)}\n\n{json.dumps(row)}", flush=True)
    if args.output == "json":
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
