#!/usr/bin/env python3
"""Which part of a missed pass-key sample makes the miss: its number or its haystack?

``training/evaluate.py`` draws each pass-key sample from a fixed seed, so the same samples miss
run after run. This probe takes such samples (by length, depth and index, as the grid names
them) and scores, teacher-forced, three families of variants:

* ``original``: the sample as the grid builds it;
* ``number``: the same haystack with the pass key replaced by other 5-digit numbers;
* ``haystack``: the same number placed (at the same depth) in the haystacks of other samples.

If the other numbers pass in the same haystack while the number fails in other haystacks, the
number is the hard part (its digit pattern); the other way round, the text around it is. A
variant counts as found when the argmax at every answer position is the answer's token (what
greedy decoding would read) and the number then ends (no digit is likeliest next).

    .venv/bin/python training/probe_passkey.py --samples 16384:0.0:1,16384:0.2:3 --variants 5
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

TRAINING_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TRAINING_DIR))

import evaluate  # noqa: E402
from kvslim.eval import needle  # noqa: E402


def with_number(sample: needle.NeedleSample, number: str) -> tuple[str, str]:
    """(prompt, answer) of ``sample`` with its pass key replaced by ``number`` (the needle states
    it twice; the haystack must not hold the old number anywhere else)."""
    old = sample.answer.strip()
    if len(re.findall(rf"(?<!\d){old}(?!\d)", sample.prompt)) != 2:
        raise ValueError(f"pass key {old} is not exactly the needle's two mentions")
    return re.sub(rf"(?<!\d){old}(?!\d)", number, sample.prompt), " " + number


@torch.no_grad()
def score(model, tok, prompt: str, answer: str, digit_ids: list[int]) -> dict:
    """Teacher-forced read of ``answer`` after ``prompt``: found (argmax right everywhere and the
    number ends), the weakest probability as evaluate.py's grid scores it, and what argmax reads."""
    prompt_ids, answer_ids = tok.encode(prompt).ids, tok.encode(answer).ids
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:].float()
    read = logits.argmax(-1).tolist()
    found = read[:len(answer_ids)] == answer_ids and read[len(answer_ids)] not in digit_ids
    return {"found": found, "weakest": evaluate.weakest_answer_prob(logits[:, None], read, answer_ids, digit_ids),
            "read": tok.decode(read[:len(answer_ids)]).strip()}


def scale_queries(model, spec: str) -> None:
    """--q-scale LAYER[n|r]=S: multiply attention layer LAYER's queries by S (all dims; ``n`` only
    the dims without rotary position, ``r`` only the rotary ones) through its q_norm weight,
    which Qwen3.5 applies as (1 + weight). Keys, and so the KV cache, are untouched: only the
    temperature of that layer's attention changes."""
    match = re.fullmatch(r"(\d+)([nr]?)=([0-9.]+)", spec)
    layers = model.model.layers
    if not match or int(match[1]) >= len(layers) or not hasattr(layers[int(match[1])], "self_attn"):
        raise SystemExit(f"--q-scale {spec!r}: expected LAYER[n|r]=S with LAYER an attention layer")
    config = model.config
    rotary = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    vec = torch.ones(config.head_dim)
    if match[2] == "r":
        vec[:rotary] = float(match[3])
    elif match[2] == "n":
        vec[rotary:] = float(match[3])
    else:
        vec[:] = float(match[3])
    norm = layers[int(match[1])].self_attn.q_norm
    norm.weight.data = vec.to(norm.weight) * (1 + norm.weight.data) - 1


def parse_samples(text: str) -> list[tuple[int, float, int]]:
    out = []
    for part in text.split(","):
        try:
            length, depth, index = part.split(":")
            out.append((int(length), float(depth), int(index)))
        except ValueError:
            raise SystemExit(f"--samples: expected LENGTH:DEPTH:INDEX items, got {part!r}") from None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=evaluate.DEFAULT_MODEL)
    p.add_argument("--samples", required=True, help="LENGTH:DEPTH:INDEX,... grid samples to probe")
    p.add_argument("--variants", type=int, default=5, help="other numbers and other haystacks per sample")
    p.add_argument("--seed", type=int, default=0, help="the grid's seed (evaluate.py --seed)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--q-scale", action="append", default=[], metavar="LAYER[n|r]=S",
                   help="before scoring, multiply attention layer LAYER's queries by S (n: only the "
                        "non-rotary dims, r: only the rotary ones); repeatable")
    args = p.parse_args(argv)
    args.checkpoint, args.device = None, "cpu"
    torch.set_num_threads(args.threads)
    model, tok, _ = evaluate.load_model(args)
    for spec in args.q_scale:
        scale_queries(model, spec)
    import train

    docs = evaluate.heldout_docs(train.ensure_corpus())
    count = lambda text: len(tok.encode(text).ids)  # noqa: E731
    digit_ids = evaluate.digit_token_ids(tok)
    rng, results = random.Random(f"probe:{args.seed}"), []
    for length, depth, index in parse_samples(args.samples):
        t0 = time.time()
        sample = evaluate.grid_sample(docs, count, args.seed, length, depth, index)
        number = sample.answer.strip()
        rows = [{"variant": "original", "number": number, **score(model, tok, sample.prompt, sample.answer, digit_ids)}]
        for _ in range(args.variants):
            other = str(rng.randrange(10_000, 100_000))
            rows.append({"variant": "number", "number": other,
                         **score(model, tok, *with_number(sample, other), digit_ids)})
        for k in range(args.variants):
            host = evaluate.grid_sample(docs, count, args.seed, length, depth, 1000 + k)
            rows.append({"variant": "haystack", "number": number, "host": 1000 + k,
                         **score(model, tok, *with_number(host, number), digit_ids)})
        for r in rows:
            print(f"[probe] L={length} depth {depth:.2f} #{index} {r['variant']:8s} {r['number']}: "
                  f"{'found' if r['found'] else 'MISS '} read {r['read']:>7s} weakest {r['weakest']:.3f}", flush=True)
        numbers_found = sum(r["found"] for r in rows if r["variant"] == "number")
        hosts_found = sum(r["found"] for r in rows if r["variant"] == "haystack")
        print(f"[probe] L={length} depth {depth:.2f} #{index}: other numbers here {numbers_found}/{args.variants}, "
              f"{number} elsewhere {hosts_found}/{args.variants} ({time.time() - t0:.0f}s)", flush=True)
        results.append({"length": length, "depth": depth, "index": index, "rows": rows})
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
