"""kvslim calibrate: measure a model's value vectors on text, for the klt V formats.

    kvslim calibrate -f notes.txt                 # the bundled model; writes its calibration file
    kvslim calibrate -m ./Qwen3.5-folder -f corpus.txt -c 4096 --windows 8
    kvslim calibrate -m model.gguf -f corpus.txt -o model.kv-calibration.safetensors
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .common import add_load_args, apply_threads, load_kwargs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_args(p, dtype="f32")
    p.add_argument("-f", "--file", required=True, nargs="+", help="text file(s) to calibrate on")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="tokens per window (whole contexts)")
    p.add_argument("--windows", type=int, default=4, help="windows spread over the text (default 4)")
    p.add_argument("-o", "--output", default=None,
                   help="output file (default: where loading looks: kv-calibration.safetensors in the "
                        "model folder, <name>.kv-calibration.safetensors beside a GGUF)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    from ..engine.calibrate import calibrate
    from ..engine.llm import load
    from ..loading import calibration_path, default_model

    texts = []
    for name in args.file:
        try:
            texts.append(Path(name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"kvslim calibrate: cannot read {name}: {exc}")
    llm = load(args.model, ctx=args.ctx_size, device=args.device, **load_kwargs(args))
    ids = [t for text in texts for t in llm.tokenize(text, add_special=False)]
    started = time.perf_counter()
    try:
        cal = calibrate(llm, ids, args.ctx_size, args.windows, source=", ".join(Path(f).name for f in args.file))
    except ValueError as exc:
        raise SystemExit(f"kvslim calibrate: {exc}")
    out = Path(args.output) if args.output else calibration_path(args.model or default_model())
    cal.save(out)
    print(f"calibrated {len(cal.layers)} attention layers on {min(len(ids), args.ctx_size * args.windows)} of "
          f"{len(ids)} tokens in {time.perf_counter() - started:.1f} s -> {out}")
    return 0
