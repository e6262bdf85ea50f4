"""Speculative decoding from prompt-lookup drafts, against decoding one token at a time.

    python benchmarks/speculative.py [-m MODEL] [--draft 4,8] [-n 200] [-r 3] [--device cpu]

The prompt is a passage of held-out text followed by its opening again, so that the reply
tends to copy it (the case drafts are for: code edits, quotes). Printed per setting: generated
tokens/s (median of -r runs), drafted and kept tokens, and whether the tokens equal the plain
run's. The plain decode step is the C step where it applies (``--native``) and torch's eager one
without; drafts are checked by a torch forward over the draft, so they pay off where a forward
of several tokens costs about what one costs (a GPU, Apple silicon, a model whose weights
outweigh its compute), not on a small CPU model, whose one-token C step is many times cheaper
than a torch forward.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvslim  # noqa: E402
from kvslim.data import TEXT  # noqa: E402
from kvslim.engine import EngineConfig  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--draft", default="4,8", help="--draft-max values to time beside 0")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    text = (TEXT / "austen-heldout.txt").read_text(encoding="utf-8")[:2400]
    prompt = text[:1200] + "\n\n" + text[:200]
    rows, plain = [], None
    settings = [(0, True), (0, False)] + [(int(d), True) for d in args.draft.split(",")]
    for draft, native in settings:
        config = EngineConfig.build(4096, 1, "f16", "f16", draft_max=draft, native=native, device=args.device)
        llm = kvslim.load(args.model, dtype="f32", config=config)     # float32: no bf16 ties between paths
        llm.generate(prompt, max_tokens=8, temperature=0)                               # warm-up
        outs = [llm.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True) for _ in range(args.r)]
        tokens = outs[0].token_ids
        plain = plain or tokens
        t = outs[0].timings
        rows.append([draft or "off", "C" if llm.engine.decode_step.native is not None else "torch",
                     f"{statistics.median(o.gen_tps for o in outs):.1f}", t.get("draft_n", "-"),
                     t.get("draft_n_accepted", "-"), "yes" if tokens == plain else "no"])
    print(markdown_table(["--draft-max", "decode step", "tg t/s", "drafted", "kept", "same tokens"], rows,
                         ["r", "l", "r", "r", "r", "l"]))


if __name__ == "__main__":
    main()
