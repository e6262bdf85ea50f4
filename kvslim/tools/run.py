"""``kvslim run``: complete one prompt, then print timings and KV/state memory."""
from __future__ import annotations

import argparse
import sys

from .. import formats
from ..bench.memory import rss_kib
from ..engine import load
from ..weights import encodable_names, weight_bytes
from .common import human_bytes, to_json
from .engine_args import add_device_args, engine_config


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model/cache options every tool shares, with llama.cpp's names."""
    p.add_argument("-m", "--model", default=None, help="HF folder or .gguf file (default: the bundled model)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size per sequence (tokens)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="K cache type: " + ", ".join(formats.names()))
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="V cache type (same choices)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="tokens per forward pass in prefill")
    p.add_argument("--dtype", default=None, help="weights dtype: f32, bf16, f16 (default: as stored)")
    p.add_argument("--weights", default=None, choices=encodable_names(),
                   help="quantize a Hugging Face folder's weight matrices at load (a GGUF keeps its own types)")
    p.add_argument("--allow-dequant", action="store_true",
                   help="expand GGUF tensors of types that cannot stay quantized instead of refusing the file")
    add_device_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("-s", "--seed", type=int, default=None)


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim run", description=__doc__)
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("-p", "--prompt", default=None, help="prompt text")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
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
    if args.prompt is None:
        raise ValueError("no prompt: use -p TEXT or -f FILE")
    return args.prompt


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    prompt = read_prompt(args)
    llm = load(args.model, dtype=args.dtype, weights=args.weights, allow_dequant=args.allow_dequant,
               config=engine_config(args))
    if args.chat:
        prompt = llm.tokenize(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                              add_special=False)
    chunks = llm.generate(prompt, args.n_predict, stream=True, stop=args.stop, **sampling_kwargs(args))
    completion = None
    for chunk in chunks:
        if args.output == "text":
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        completion = chunk.completion or completion
    rss = rss_kib()
    memory = {"weights_bytes": weight_bytes(llm.model), "rss_bytes": rss * 1024 if rss >= 0 else -1}
    if args.output == "json":
        print(to_json({**result_record(completion, args), **memory}))
    else:
        print("\n\n" + timing_line(completion, args) + memory_line(memory))
    return 0


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
