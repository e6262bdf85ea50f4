"""``kvslim run -cnv``: a conversation in the terminal, as llama-cli's ``-cnv``.

Each turn renders the whole history with the model's chat template. The engine's prefix cache
(on in this mode) finds what it has already read, the last prompt and most of the reply, and
reads only the rest: on a hybrid model the DeltaNet layers restart from the state checkpointed
at the end of the last prompt. A turn's line on stderr says how many prompt tokens were reused.

Typing: a line ending in ``\\`` goes on to the next line; ``/clear`` forgets the history (the
system prompt stays); ``/exit`` or end of input (Ctrl-D) ends. Ctrl-C stops a reply and keeps
what it said; at the prompt it ends the conversation.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from .common import sampling_kwargs

END = ("/exit", "/quit", "/bye")


def converse(llm, args, read: Callable[[str], str] = input, out=None, err=None) -> list[dict]:
    """The conversation loop, until /exit or the end of input; its messages. ``read`` is ``input``
    in a terminal, a script's lines in the tests."""
    out, err = out or sys.stdout, err or sys.stderr
    history = opening(args.system_prompt)
    first = args.prompt                                             # -p / -f: the first user turn
    while True:
        text, first = (first, None) if first is not None else (ask(read), None)
        if text is None or text.strip() in END:
            return history
        if text.strip() == "/clear":
            history = opening(args.system_prompt)
            print("(history cleared)", file=err, flush=True)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = llm.tokenize(llm.tokenizer.apply_chat_template(history), add_special=False)
        if len(ids) >= args.ctx_size:
            history.pop()
            print(f"the conversation fills -c {args.ctx_size} ({len(ids)} tokens with this turn): /clear to "
                  f"start over, or raise -c", file=err, flush=True)
            continue
        reply, completion = answer(llm, ids, args, out)
        history.append({"role": "assistant", "content": reply})
        print(turn_line(completion, len(ids)), file=err, flush=True)


def opening(system_prompt: str | None) -> list[dict]:
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def ask(read: Callable[[str], str]) -> str | None:
    """One user turn; lines ending in a backslash continue it. None: end of input or Ctrl-C."""
    lines, prompt = [], "> "
    while True:
        try:
            line = read(prompt)
        except (EOFError, KeyboardInterrupt):
            return None if not lines else "\n".join(lines)
        if not line.endswith("\\"):
            return "\n".join(lines + [line])
        lines.append(line[:-1])
        prompt = ". "


def answer(llm, ids: list[int], args, out) -> tuple[str, object]:
    """Stream one reply; (its text, its Completion, or None when Ctrl-C stopped it)."""
    limit = args.n_predict if args.n_predict and args.n_predict > 0 else args.ctx_size - len(ids)
    chunks = llm.generate(ids, limit, stream=True, stop=args.stop, **sampling_kwargs(args))
    pieces, completion, started = [], None, time.perf_counter()
    try:
        for chunk in chunks:
            out.write(chunk.text)
            out.flush()
            pieces.append(chunk.text)
            completion = chunk.completion or completion
    except KeyboardInterrupt:
        chunks.close()                                              # frees the slot; the cache keeps the tokens
        out.write(f"\n[stopped after {time.perf_counter() - started:.1f} s]")
    out.write("\n")
    return "".join(pieces), completion


def turn_line(completion, n_prompt: int) -> str:
    if completion is None:
        return f"prompt {n_prompt} tok | reply stopped"
    t = completion.timings
    return (f"prompt {n_prompt} tok ({t['cache_n']} reused, {t['prompt_n']} read at {t['prompt_per_second']:.1f} "
            f"tok/s) | reply {t['predicted_n']} tok {t['predicted_per_second']:.1f} tok/s | {completion.finish_reason}")
