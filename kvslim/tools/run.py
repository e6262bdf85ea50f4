"""``kvslim run``: complete one prompt, then print timings and KV/state memory."""
from __future__ import annotations

import argparse
import sys
import time

from ..bench.memory import rss_kib
from ..engine import load
from ..tables import human_bytes, to_json
from ..weights import weight_bytes
from .common import add_model_args, add_sampling_args, apply_threads, load_kwargs, sampling_kwargs, warn_context
from .conversation import converse, opening
from .engine_args import add_draft_args, engine_config

__all__ = ["add_model_args", "add_sampling_args", "sampling_kwargs", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim run", description=__doc__)
    add_model_args(p)
    add_sampling_args(p)
    add_draft_args(p)
    p.add_argument("-p", "--prompt", default=None, help="prompt text")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=None,
                   help="tokens to generate (-1: until the context is full; default 128, with -cnv until the reply ends)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("-cnv", "--conversation", action="store_true",
                   help="talk with the model in the terminal (llama-cli's -cnv): -p, if given, is the first turn; "
                        "the prefix cache reuses each earlier turn; /clear forgets them, /exit or Ctrl-D ends")
    p.add_argument("-sys", "--system-prompt", default=None, help="a system message first (with --chat or -cnv)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    return p


def read_prompt(args) -> str:
    if args.prompt is not None and args.file is not None:
        raise ValueError("give the prompt with -p or -f, not both")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except OSError as err:
            raise ValueError(f"cannot read prompt file: {err}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"prompt file {args.file} is not UTF-8 text: byte {err.start} "
                             f"(0x{err.object[err.start]:02x}) {err.reason}") from None
    if args.prompt is None and not args.conversation:
        raise ValueError("no prompt: use -p TEXT or -f FILE (or -cnv to talk)")
    return args.prompt


def check_args(args) -> None:
    """Refuse numbers that make no sense, naming the flag."""
    if args.n_predict is None:
        args.n_predict = -1 if args.conversation else 128
    if args.n_predict == 0 or args.n_predict < -1:
        raise ValueError(f"-n must be at least 1, or -1 to generate until the context is full; got {args.n_predict}")
    if args.conversation and args.output == "json":
        raise ValueError("-o json reports one completion; a conversation (-cnv) prints its turns")
    if args.system_prompt is not None and not (args.chat or args.conversation):
        raise ValueError("-sys goes with --chat or -cnv (a plain prompt has no messages)")
    if args.ctx_size < 2:
        raise ValueError(f"-c must be at least 2 tokens, got {args.ctx_size}")
    from .. import formats
    # the names as kvslim and llama.cpp print them: -ctk Q8_0 runs q8_0 and reports q8_0
    args.cache_type_k, args.cache_type_v = formats.get(args.cache_type_k).name, formats.get(args.cache_type_v).name


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    apply_threads(args)
    prompt = read_prompt(args)
    warn_context(args.model, args.ctx_size)
    llm = load(args.model, **load_kwargs(args), config=engine_config(args, prefix_cache=args.conversation))
    if (args.chat or args.conversation) and not llm.tokenizer.chat_template:
        raise ValueError(f"{'-cnv' if args.conversation else '--chat'} needs a chat template, and this model's "
                         f"tokenizer has none")
    if args.conversation:
        args.prompt = prompt                                    # -p or -f: the first turn
        converse(llm, args)
        return 0
    if args.chat:
        messages = opening(args.system_prompt) + [{"role": "user", "content": prompt}]
        prompt = llm.tokenize(llm.tokenizer.apply_chat_template(messages), add_special=False)
    ids = prompt if isinstance(prompt, list) else llm.tokenize(prompt)
    n_predict = args.n_predict if args.n_predict > 0 else max(1, args.ctx_size - len(ids))
    completion = stream(llm, ids, n_predict, args)
    if completion is None:
        return 130                                              # Ctrl-C: what was made is printed, as llama.cpp does
    note_context_full(completion, args)
    rss = rss_kib()
    memory = {"weights_bytes": weight_bytes(llm.model), "rss_bytes": rss * 1024 if rss >= 0 else -1}
    if args.output == "json":
        print(to_json({**result_record(completion, args), **memory}))
    else:
        print("\n\n" + timing_line(completion, args) + memory_line(memory))
    return 0


def stream(llm, ids: list[int], n_predict: int, args):
    """Print the completion as it comes; the final Completion, or None after Ctrl-C (with timings so far)."""
    chunks = llm.generate(ids, n_predict, stream=True, stop=args.stop, **sampling_kwargs(args))
    completion, start, first, n_gen = None, time.perf_counter(), None, 0
    try:
        for chunk in chunks:
            if args.output == "text":
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            n_gen += len(chunk.token_ids)
            first = first or (time.perf_counter() if n_gen else None)
            completion = chunk.completion or completion
    except KeyboardInterrupt:
        chunks.close()                                          # frees the sequence's slot
        print("\n\n" + interrupted_line(len(ids), n_gen, start, first), flush=True)
        return None
    return completion


def interrupted_line(n_prompt: int, n_gen: int, start: float, first: float | None) -> str:
    now = time.perf_counter()
    prompt_s = (first or now) - start
    gen = f"{(n_gen - 1) / (now - first):.1f} tok/s" if first and n_gen > 1 and now > first else "-"
    return (f"interrupted: prompt {n_prompt} tok in {prompt_s:.2f} s | gen {n_gen} tok {gen} "
            f"(wall clock; first token counted with the prompt)")


def note_context_full(c, args) -> None:
    """Say so when generation stopped because the context filled, not because -n was reached."""
    if c.finish_reason == "length" and 0 < args.n_predict and len(c.token_ids) < args.n_predict:
        print(f"\nnote: stopped after {len(c.token_ids)} of -n {args.n_predict} tokens: -c {args.ctx_size} is full "
              f"({c.prompt_tokens} prompt + {len(c.token_ids)} generated tokens); raise -c for more", file=sys.stderr)


def result_record(c, args) -> dict:
    return {"text": c.text, "finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.token_ids), "prompt_tps": c.prompt_tps, "gen_tps": c.gen_tps,
            "kv_bytes": c.kv_bytes, "state_bytes": c.state_bytes, "type_k": args.cache_type_k,
            "type_v": args.cache_type_v, "ctx": args.ctx_size, "timings": c.timings}


def timing_line(c, args) -> str:
    t = c.timings
    return (f"prompt {t['prompt_n']} tok {c.prompt_tps:.1f} tok/s | gen {t['predicted_n']} tok "
            f"{c.gen_tps:.1f} tok/s | KV {human_bytes(c.kv_bytes)} ({args.cache_type_k}/{args.cache_type_v}) | "
            f"state {human_bytes(c.state_bytes)} | {c.finish_reason}")


def memory_line(m: dict) -> str:
    """Weights as held (quantized blocks count as stored) and the process's resident memory
    after generating (memory-mapped weights count once touched)."""
    return f" | weights {human_bytes(m['weights_bytes'])} | RSS {human_bytes(m['rss_bytes'])}"
