"""Speculative decoding from prompt-lookup drafts, against decoding one token at a time.

    python benchmarks/speculative.py [-m MODEL] [--draft 4,8] [-n 200] [-r 3] [--device cpu] [--dtype f32]

The prompt is a passage of held-out text followed by its opening again, so that the reply
tends to copy it (the case drafts are for: code edits, quotes). Printed per setting: generated
tokens/s (median of -r runs), drafted and kept tokens, and whether the tokens equal the plain
run's (the first row). Each decode step runs the C step where it applies (``--native``; a drafted
chunk then goes through it as rows of one slot) and torch's eager one without (a drafted chunk
through a prompt-style forward). A chunk of n tokens costs about one step where the weights'
bytes outweigh the compute (big models, GPUs); on a small CPU model its GEMVs cost more per row.
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
    ap.add_argument("--dtype", default="f32", help="f32 (default: the torch and C steps then give the same tokens) or bf16")
    args = ap.parse_args(argv)
    text = (TEXT / "austen-heldout.txt").read_text(encoding="utf-8")[:2400]
    prompt = text[:1200] + "\n\n" + text[:200]
    rows, plain = [], None
    drafts = [0] + [int(d) for d in args.draft.split(",")]
    settings = [(d, native) for native in (True, False) for d in drafts]
    for draft, native in settings:
        config = EngineConfig.build(4096, 1, "f16", "f16", draft_max=draft, native=native, device=args.device)
        llm = kvslim.load(args.model, dtype=args.dtype, config=config)
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
