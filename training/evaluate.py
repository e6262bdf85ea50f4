#!/usr/bin/env python3
"""Evaluate the bundled tiny model: held-out perplexity and needle retrieval.

1. Held-out perplexity per corpus source, token-level and in bits per byte
   (independent of the tokenizer), beside a unigram baseline: token unigram
   frequencies of the training split with add-one smoothing.  The held-out
   token stream of a source (documents followed by ``<|endoftext|>``) is cut
   into non-overlapping windows of ``--window`` tokens; every token but the
   first of a window is predicted.  Bytes are the UTF-8 bytes of the
   predicted tokens; ``<|endoftext|>`` counts as one byte (the separator).
2. Needle retrieval (``kvslim.eval.needle``, canonical pass-key kind) over a
   grid of depths and context lengths, with filler from the *held-out*
   documents, through ``transformers`` with greedy decoding and the model's
   ordinary (full precision) cache: the reference for kvslim's compressed
   caches.  A sample counts as retrieved when the generated text starts with
   the expected number (and no further digit follows it).
3. With ``--ruler "ARGS"``: ``kvslim eval ruler -m MODEL ARGS`` on the exported
   folder (kvslim's runtime, f16 cache, greedy), e.g. the multi-key needle at
   16K; the card quotes it, so its figure is the command a user runs.

Writes ``training/runs/<name>/eval.json`` and ``eval.md``.

Usage::

    .venv/bin/python training/evaluate.py                              # exported model
    .venv/bin/python training/evaluate.py --checkpoint training/runs/tiny-qwen35/ckpt/last.pt
    .venv/bin/python training/evaluate.py --lengths 1024 --samples 1 --skip-ppl --out /tmp/e
    .venv/bin/python training/evaluate.py --skip-ppl --skip-needle --out /tmp/e \
        --ruler "-c 16384 --lengths 16384 --tasks niah_multikey -n 2"
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TRAINING_DIR = Path(__file__).resolve().parent
REPO_ROOT = TRAINING_DIR.parent
sys.path.insert(0, str(TRAINING_DIR))
sys.path.insert(0, str(REPO_ROOT))

import corpus  # noqa: E402
from kvslim.eval import needle, ruler  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "kvslim" / "data" / "tiny-qwen35"
DEFAULT_LENGTHS = "1024,2048,4096,8192,16384"
DEFAULT_DEPTHS = ",".join(f"{i / 10:.1f}" for i in range(11))


def load_model(args):
    """(model, tokenizers.Tokenizer, description) from --checkpoint or --model."""
    from tokenizers import Tokenizer

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.checkpoint is not None:
        import train

        state = torch.load(args.checkpoint, weights_only=False, map_location="cpu")
        saved = argparse.Namespace(**state["args"])
        model = train.build_model(saved)
        model.load_state_dict(state["model"])
        tok = Tokenizer.from_file(str(train.TOKENIZER_PATH))
        source = f"checkpoint {args.checkpoint} (step {state['step']})"
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                     attn_implementation="sdpa")
        tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
        source = f"{args.model}"
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device=device, dtype=dtype).eval()
    return model, tok, source


def token_bytes(tok) -> np.ndarray:
    """UTF-8 byte length of every token id (special tokens: 1)."""
    vocab = tok.get_vocab_size()
    lengths = np.zeros(vocab, dtype=np.int64)
    for i in range(vocab):
        piece = tok.decode([i], skip_special_tokens=False)
        text = tok.id_to_token(i)
        lengths[i] = 1 if text.startswith("<|") and text.endswith("|>") else len(piece.encode("utf-8"))
    # Tokens holding part of a multi-byte character decode to U+FFFD alone;
    # count their raw bytes from the byte-level alphabet instead.
    alphabet = _byte_level_alphabet()
    for i in range(vocab):
        text = tok.id_to_token(i)
        if "\ufffd" in tok.decode([i]) and all(c in alphabet for c in text):
            lengths[i] = len(text)
    return lengths


def _byte_level_alphabet() -> set[str]:
    """The 256 printable characters byte-level BPE uses for raw bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = set(chr(b) for b in keep), 0
    for b in range(256):
        if b not in keep:
            chars.add(chr(256 + extra))
            extra += 1
    return chars


def stream(tok, source: str, split: str) -> np.ndarray:
    docs = corpus.read_documents(corpus.DEFAULT_DATA_DIR / f"{source}.{split}.txt")
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, dtype=np.int64)


def train_stream(tok, source: str) -> np.ndarray:
    """Training-split tokens, from train.py's cache when it matches the tokenizer."""
    import train

    if tok.to_str() == train.load_tokenizer().to_str():
        return train.token_cache(source, "train", tok).astype(np.int64)
    return stream(tok, source, "train")


@torch.no_grad()
def perplexity(model, tok, sources, args) -> dict:
    nbytes = token_bytes(tok)
    vocab = tok.get_vocab_size()
    counts = np.ones(vocab, dtype=np.float64)  # add-one smoothing
    for s in sources:
        counts += np.bincount(train_stream(tok, s), minlength=vocab)
    unigram_logp = np.log(counts / counts.sum())
    results = {}
    for s in sources:
        ids = stream(tok, s, "heldout")
        if args.max_tokens and len(ids) > args.max_tokens:
            ids = ids[: args.max_tokens]
        nll, n_tok, n_bytes, uni = 0.0, 0, 0, 0.0
        t0 = time.time()
        for start in range(0, len(ids) - 1, args.window):
            window = torch.from_numpy(ids[start:start + args.window])
            if len(window) < 2:
                break
            logits = model(input_ids=window[None].to(model.device)).logits[0, :-1].float().cpu()
            targets = window[1:]
            nll += F.cross_entropy(logits, targets, reduction="sum").item()
            n_tok += len(targets)
            n_bytes += int(nbytes[targets.numpy()].sum())
            uni -= float(unigram_logp[targets.numpy()].sum())
        results[s] = {
            "tokens": n_tok, "bytes": n_bytes,
            "ppl": math.exp(nll / n_tok), "bpb": nll / math.log(2) / n_bytes,
            "unigram_ppl": math.exp(uni / n_tok), "unigram_bpb": uni / math.log(2) / n_bytes,
            "seconds": round(time.time() - t0, 1),
        }
        print(f"[ppl] {s:16s} ppl {results[s]['ppl']:8.2f} (unigram {results[s]['unigram_ppl']:8.1f})"
              f"  bpb {results[s]['bpb']:.3f} (unigram {results[s]['unigram_bpb']:.3f})"
              f"  {n_tok} tokens", flush=True)
    return results


def samples_for(length: int, args) -> int:
    """Samples per (depth) cell at `length` tokens."""
    special = dict(tuple(int(v) for v in part.split(":"))
                   for part in args.long_samples.split(",") if part)
    return special.get(length, args.samples)


def _digits_prefix(text: str) -> str:
    out = ""
    for ch in text.lstrip():
        if not ch.isdigit():
            break
        out += ch
    return out


def weakest_answer_prob(scores, generated: list[int], want: list[int], digit_ids: list[int] = ()) -> float:
    """The lowest probability greedy decoding gave the expected answer's next token, over the
    answer's tokens up to and including the first one it got wrong, and, after a whole right
    answer, the probability that the number ends there (mass off ``digit_ids``: a run-on digit
    is a miss too).

    A continuous score beside right/wrong: a retrieval that holds by a wide margin scores near 1,
    one that barely holds or fails at a digit scores that digit's probability, so two models that
    retrieve the same share can still be told apart on the same samples. ``scores``: one
    [1, vocab] logit row per generated token, as ``generate(output_scores=True)`` returns them.
    """
    weakest = 1.0
    for step, token in enumerate(want):
        weakest = min(weakest, torch.softmax(scores[step][0].float(), dim=-1)[token].item())
        if step >= len(generated) or generated[step] != token:
            return weakest
    if digit_ids and len(scores) > len(want):
        ends = 1.0 - torch.softmax(scores[len(want)][0].float(), dim=-1)[list(digit_ids)].sum().item()
        weakest = min(weakest, ends)
    return weakest


def digit_token_ids(tok) -> list[int]:
    """Ids of the tokens that read as one digit (the tokenizer splits numbers into digits)."""
    return [i for i in range(tok.get_vocab_size()) if tok.decode([i]).strip().isdigit()]


def heldout_docs(sources: list[str]) -> list[str]:
    """The held-out documents of ``sources``: the filler of the pass-key grid."""
    return [d for s in sources for d in corpus.read_documents(corpus.DEFAULT_DATA_DIR / f"{s}.heldout.txt")]


def grid_sample(docs: list[str], count, seed: int, length: int, depth: float, index: int) -> needle.NeedleSample:
    """The grid's ``index``-th pass-key sample at ``length`` tokens and ``depth`` (a fixed draw per cell)."""
    rng = random.Random(f"kvslim-niah:{seed}:{length}:{depth:.3f}:{index}")
    return needle.build_sample(docs, rng, depth, kind=needle.CANONICAL_KIND, target_tokens=length,
                               count_tokens=count, canonical=True)


@torch.no_grad()
def needle_grid(model, tok, docs, args) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    count = lambda text: len(tok.encode(text).ids)  # noqa: E731
    digit_ids = digit_token_ids(tok)
    grid = {}
    for length in lengths:
        cells, t0 = {}, time.time()
        for depth in depths:
            hits = []
            for i in range(samples_for(length, args)):
                sample = grid_sample(docs, count, args.seed, length, depth, i)
                ids = torch.tensor([tok.encode(sample.prompt).ids], device=model.device)
                want = tok.encode(sample.answer).ids
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=len(want) + 1, do_sample=False,
                                     pad_token_id=0, eos_token_id=None,
                                     output_scores=True, return_dict_in_generate=True)
                new = out.sequences[0, ids.shape[1]:].tolist()
                text = tok.decode(new)
                ok = _digits_prefix(text) == sample.answer.strip()
                hits.append({"ok": ok, "answer": sample.answer.strip(), "output": text,
                             "prompt_tokens": int(ids.shape[1]),
                             "p_weakest": weakest_answer_prob(out.scores, new, want, digit_ids)})
            cells[f"{depth:.2f}"] = hits
            acc = sum(h["ok"] for h in hits) / len(hits)
            print(f"[niah] L={length:6d} depth {depth:.2f}: {acc:.2f} "
                  f"{[h['output'] for h in hits]}", flush=True)
        flat = [h for hits in cells.values() for h in hits]
        weakest = sorted(h["p_weakest"] for h in flat)
        grid[str(length)] = {"accuracy": sum(h["ok"] for h in flat) / len(flat), "samples": len(flat),
                             "p_weakest_median": weakest[len(weakest) // 2], "p_weakest_min": weakest[0],
                             "seconds": round(time.time() - t0, 1), "cells": cells}
        print(f"[niah] L={length}: {grid[str(length)]['accuracy']:.3f}, weakest answer-token probability "
              f"median {weakest[len(weakest) // 2]:.3f} lowest {weakest[0]:.3f} ({time.time() - t0:.0f}s)", flush=True)
    return grid


def ruler_eval(args) -> dict:
    """``kvslim eval ruler`` on the exported folder, as a user runs it; its JSON, plus the command."""
    if args.checkpoint is not None:
        raise SystemExit("--ruler runs kvslim on an exported folder: give --model, not --checkpoint")
    flags = shlex.split(args.ruler)
    cmd = [sys.executable, "-m", "kvslim", "eval", "ruler", "-m", str(args.model), "-o", "json", "--no-progress", *flags]
    print("[ruler] " + shlex.join(cmd[2:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise SystemExit(f"kvslim eval ruler failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    out["command"] = "kvslim eval ruler -m MODEL " + shlex.join(flags)
    for r in out["results"]:
        for task, g in r["tasks"].items():
            print(f"[ruler] {r['type_k']}/{r['type_v']} {task}: {g['overall']:.3f} of {g['items']}", flush=True)
    return out


def ruler_counts(result: dict, task: str, length: int) -> tuple[int, int]:
    """(answers found, answers asked) of one K/V pair's ruler result for ``task`` at ``length``."""
    hits = [h for q in result["queries"] if q["task"] == task and q["length"] == length for h in q["hits"]]
    return sum(hits), len(hits)


def markdown(report: dict) -> str:
    lines = [f"# Evaluation of {report['model']}", "",
             f"dtype {report['dtype']}, torch {report['torch']}, transformers {report['transformers']}.", ""]
    if report.get("perplexity"):
        lines += ["## Held-out perplexity", "",
                  "| source | tokens | ppl | unigram ppl | bits/byte | unigram bits/byte |",
                  "|---|---:|---:|---:|---:|---:|"]
        for s, r in report["perplexity"].items():
            lines.append(f"| {s} | {r['tokens']} | {r['ppl']:.2f} | {r['unigram_ppl']:.1f} | "
                         f"{r['bpb']:.3f} | {r['unigram_bpb']:.3f} |")
        lines.append("")
    if report.get("needle"):
        grid = report["needle"]
        depths = list(next(iter(grid.values()))["cells"])
        lines += ["## Needle retrieval (pass key, greedy, full-precision cache)", "",
                  "Share of samples retrieved per context length (rows) and needle depth (columns).", "",
                  "| tokens | " + " | ".join(depths) + " | all |",
                  "|---:|" + "---:|" * (len(depths) + 1)]
        for length, r in grid.items():
            row = [f"{sum(h['ok'] for h in r['cells'][d]) / len(r['cells'][d]):.2f}" for d in depths]
            lines.append(f"| {length} | " + " | ".join(row) + f" | **{r['accuracy']:.3f}** |")
        lines.append("")
    if report.get("ruler"):
        lines += ["## RULER tasks (kvslim runtime, greedy)", "", f"`{report['ruler']['command']}`", "",
                  ruler.render(report["ruler"]["results"], report["ruler"]["depths"]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--name", default="tiny-qwen35", help="writes training/runs/<name>/eval.*")
    p.add_argument("--out", type=Path, default=None, help="output prefix instead of runs/<name>/eval")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=0, help="cap held-out tokens per source (0: all)")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS)
    p.add_argument("--depths", default=DEFAULT_DEPTHS)
    p.add_argument("--samples", type=int, default=3, help="samples per (length, depth) cell")
    p.add_argument("--long-samples", default="8192:2,16384:1",
                   help="fewer samples per cell for long contexts (slow on a CPU), as len:n")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--skip-needle", action="store_true")
    p.add_argument("--ruler", default="", help='also run `kvslim eval ruler -m MODEL ARGS` on the exported '
                   'folder, e.g. "-c 16384 --lengths 16384 --tasks niah_multikey -n 2"')
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    needs_model = not (args.skip_ppl and args.skip_needle)  # the ruler alone runs in its own process
    model, tok, source = load_model(args) if needs_model else (None, None, str(args.checkpoint or args.model))
    import train

    sources = train.ensure_corpus()
    report = {"model": source, "dtype": args.dtype, "torch": torch.__version__,
              "transformers": transformers.__version__, "window": args.window,
              "needle_kind": needle.CANONICAL_KIND, "needle_filler": "held-out documents, all sources",
              "args": {k: str(v) for k, v in vars(args).items()}}
    t0 = time.time()
    if not args.skip_ppl:
        report["perplexity"] = perplexity(model, tok, sources, args)
    if not args.skip_needle:
        report["needle"] = needle_grid(model, tok, heldout_docs(sources), args)
    if args.ruler:
        del model  # free its memory: the ruler loads the exported folder in its own process
        report["ruler"] = ruler_eval(args)
    report["seconds"] = round(time.time() - t0, 1)
    prefix = args.out or (TRAINING_DIR / "runs" / args.name / "eval")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{prefix}.md").write_text(markdown(report))
    print(f"[eval] wrote {prefix}.json and {prefix}.md ({report['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
