"""``kvslim convert``: a Hugging Face folder to a GGUF file llama.cpp loads
(convert_hf_to_gguf.py and llama-quantize in one step).

f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl are written by kvslim's own
GGUF writer (ggml's reference quantizers via the gguf package; iq4_nl via kvslim's
encoder): every weight matrix gets the type, except the tensors llama.cpp's converter
keeps in F32 (norms, biases, router, conv1d) and rows that are not whole blocks (F16).
q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs and the i-quants (iq3_s, iq3_xxs, iq2_s, iq2_xs,
iq2_xxs, iq1_m, iq1_s) have no encoder in Python: they are made by llama.cpp's own quantizer
(llama-quantize's Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_M, IQ2_XS,
IQ2_XXS, IQ1_M and IQ1_S mixes) from an f32 export, which needs the peer (pip install
'kvslim[peer]'). llama.cpp refuses IQ1, IQ2 and IQ3_XXS without an importance matrix: --imatrix FILE
(llama-imatrix's GGUF or legacy .dat file, or ``kvslim imatrix``'s) gives one; without it, these types get one
measured first on kvslim's held-out calibration text (``kvslim imatrix``'s default).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from ..gguf import imatrix as gguf_imatrix
from ..gguf import writer
from ..gguf.reader import open_gguf
from ..loading import convert_hf_to_gguf
from ..tables import human_bytes
from . import imatrix as imatrix_tool
from .common import check_output

# --type -> llama.cpp file type its quantizer makes (llama-quantize: "Q4_K" = Q4_K_M, "Q5_K" = Q5_K_M)
LLAMA_QUANTIZE = {"q4_k": "q4_k_m", "q5_k": "q5_k_m", "q6_k": "q6_k", "q3_k": "q3_k_m", "q2_k": "q2_k",
                  "iq4_xs": "iq4_xs", "iq3_s": "iq3_s", "iq3_xxs": "iq3_xxs", "iq2_s": "iq2_m", "iq2_xs": "iq2_xs",
                  "iq2_xxs": "iq2_xxs", "iq1_m": "iq1_m", "iq1_s": "iq1_s"}
# llama.cpp's quantizer refuses these without an importance matrix (IQ3_XXS: its mix puts attn_q
# and attn_k in IQ2_S, which needs one)
NEEDS_IMATRIX = {"iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"}
TYPES = [*writer.QTYPE, *LLAMA_QUANTIZE]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("-o", "--outfile", default=None, help="output .gguf (default: ./<folder>-<type>.gguf)")
    p.add_argument("--type", "--outtype", dest="type", default="f16", help=f"weight type: {', '.join(TYPES)}")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads for llama.cpp's quantizer (K-quants)")
    p.add_argument("--split-max-tensors", type=int, default=0, metavar="N",
                   help="split the model into files of at most N tensors (<out>-00001-of-0000K.gguf, ...), as "
                        "llama.cpp's converter does; for the types kvslim writes itself")
    p.add_argument("--imatrix", default=None, metavar="FILE",
                   help="importance matrix for llama.cpp's quantizer (llama-imatrix's GGUF or legacy .dat file, "
                        "or kvslim imatrix's); without it " + ", ".join(sorted(NEEDS_IMATRIX)) + " measure one first")
    return p


def read_imatrix(path: Path) -> dict[str, np.ndarray]:
    """An importance matrix file -> {tensor name: mean squared input per column}, as
    llama-quantize reads it."""
    return {name: imp.means() for name, imp in gguf_imatrix.read(path).items()}


def convert(folder: Path, out: Path, out_type: str, threads: int = 2, imatrix: Path | None = None,
            split_max_tensors: int = 0) -> Path:
    """Write ``folder`` as a GGUF of ``out_type``; returns the file written (a split's first part)."""
    if out_type in writer.QTYPE:
        return convert_hf_to_gguf(folder, out, out_type, split_max_tensors)
    if out_type not in LLAMA_QUANTIZE:
        raise ValueError(f"--type {out_type!r} cannot be written; supported: {', '.join(TYPES)} "
                         "(other llama.cpp types: convert to f16, then run llama-quantize)")
    if split_max_tensors:
        raise ValueError(f"--split-max-tensors applies to the types kvslim writes itself ({', '.join(writer.QTYPE)}); "
                         f"--type {out_type} is made by llama.cpp's quantizer: split its file with llama-gguf-split")
    importance = read_imatrix(imatrix) if imatrix is not None else None
    from .. import peer
    try:
        peer.binding()
    except peer.PeerUnavailable as err:
        raise ValueError(f"--type {out_type} is made by llama.cpp's quantizer, which is not available "
                         f"({err}); install it with pip install 'kvslim[peer]'") from None
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if importance is None and out_type in NEEDS_IMATRIX:       # llama.cpp refuses these without one
            print(f"--type {out_type}: no --imatrix given; measuring one (kvslim imatrix's defaults)")
            measured = imatrix_tool.measure_to_file(folder, None, None, imatrix_tool.CTX_SIZE, imatrix_tool.CHUNKS)
            importance = {name: e.means() for name, e in measured.items()}
        source = convert_hf_to_gguf(folder, Path(tmp) / "f32.gguf", "f32")
        made = peer.quantize(source, Path(tmp) / out.name, LLAMA_QUANTIZE[out_type], threads, importance)
        os.replace(made, out)                   # whole or not at all, as writer.staged_output does
        return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.model)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a Hugging Face model folder")
    out_type = args.type.lower()
    out = Path(args.outfile) if args.outfile else Path(f"{folder.resolve().name}-{out_type}.gguf")
    if out.suffix != ".gguf":
        raise ValueError(f"{out}: the output file should end in .gguf")
    check_output(out, "-o", make_folder=True)
    start = time.perf_counter()
    first = convert(folder, out, out_type, args.threads, Path(args.imatrix) if args.imatrix else None,
                    args.split_max_tensors)
    parts = open_gguf(first).paths                               # every part of a split
    size = human_bytes(sum(p.stat().st_size for p in parts))
    print(f"wrote {first}{f' and {len(parts) - 1} more parts' if len(parts) > 1 else ''} ({out_type}, {size}) "
          f"in {time.perf_counter() - start:.1f} s")
    return 0
