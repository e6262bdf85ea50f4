"""``kvslim imatrix``: a model's importance matrix on text, as llama-imatrix writes it.

llama.cpp's quantizer weighs each column's rounding error by the mean square of the inputs it
multiplies; IQ1, IQ2 and IQ3_XXS files cannot be made without that, and lower-bit K-quants gain from it.
The file this writes is llama-imatrix's GGUF format: ``kvslim convert --imatrix FILE`` and
llama-quantize --imatrix both read it. Without -f, the text is the held-out classics and Bible
text that ships with kvslim (none of it is in kvslim's perplexity text, the Austen chapters).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..data import TEXT
from ..gguf import imatrix
from ..loading import measure_importance
from .common import add_threads_arg, apply_threads, check_output

CALIBRATION_FILES = (TEXT / "classics-heldout.txt", TEXT / "bible-heldout.txt")


# llama-imatrix's defaults: tokens per chunk and chunks at most (convert measures with them too)
CTX_SIZE, CHUNKS = 512, 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim imatrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="Hugging Face folder (config.json, *.safetensors, tokenizer.json) or GGUF file")
    p.add_argument("-f", "--file", default=None, help="calibration text (default: kvslim's held-out classics and Bible)")
    p.add_argument("-o", "--output", "--output-file", dest="output", default="imatrix.gguf",
                   help="output file (llama-imatrix's GGUF format; default imatrix.gguf)")
    p.add_argument("-c", "--ctx-size", type=int, default=CTX_SIZE, help="tokens per chunk (llama-imatrix's -c)")
    p.add_argument("--chunks", type=int, default=CHUNKS, help="chunks to run at most (llama-imatrix's --chunks)")
    add_threads_arg(p)
    return p


def calibration_text(path: str | Path | None) -> tuple[str, str]:
    """(text, its name as the file records it)."""
    if path is None:
        return "\n\n".join(f.read_text(encoding="utf-8") for f in CALIBRATION_FILES), "kvslim held-out classics+bible"
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: {'a folder, not a' if path.is_dir() else 'no such'} calibration text file")
    return path.read_text(encoding="utf-8", errors="replace"), path.name


def measure_to_file(model: Path, out: Path | None, text_path: str | Path | None, n_ctx: int,
                    chunks: int) -> dict[str, imatrix.Importance]:
    """Measure, write the file (unless ``out`` is None: ``kvslim convert`` hands the entries
    straight to the quantizer), print what was run; returns the entries."""
    if n_ctx < 1 or chunks < 1:
        raise ValueError(f"-c and --chunks must be positive (got {n_ctx} and {chunks})")
    check_output(out, "-o", make_folder=True)
    text, name = calibration_text(text_path)
    start = time.perf_counter()
    entries, ran = measure_importance(model, text, n_ctx, chunks)
    if out is not None:
        imatrix.write(out, entries, [name], ran, n_ctx)
    print(f"{'wrote ' + str(out) if out else 'measured'}: {len(entries)} matrices, {ran} chunks of {n_ctx} tokens "
          f"of {name} in {time.perf_counter() - start:.1f} s")
    return entries


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    measure_to_file(Path(args.model), Path(args.output), args.file, args.ctx_size, args.chunks)
    return 0
