"""What the attention kernel asks of an H100 per program, without a GPU: registers, stack, shared
memory, and the instructions of one block of keys.

    python benchmarks/gpu_resources.py [-p f16/f16,turbo4/turbo4,q8_0/q8_0] [--rows 8] [--head-dim 256]
                                       [--codecs units,per-value]

Compiles ``paged_prefill_tile`` for sm_90 with Triton's CUDA backend (it needs no device) at
each launch setting of ``gpu_decode.VARIANTS`` and reads the cubin's resource usage with the
``cuobjdump`` Triton ships. Registers times threads and shared memory per program decide how
many programs an SM holds at once (65,536 registers, 228 KB of shared memory), and stack bytes
are register spills: what a lease's timings then confirm or not (``gpu_decode.py --sweep``).
"loop" counts the SASS instructions (and global loads) of the kernel's loop over key blocks,
per thread and per block of BLOCK_N keys: the work each block of keys costs.
Decode's shape by default: one KV head's 8 query rows, head_dim 256 (Qwen3.6-35B-A3B).
The figures depend on Triton's version (3.6 on the lent GPUs, 3.9 here): run it under the
device's too, ``PYTHONPATH=$PWD /tmp/kvslim-image-venv/bin/python benchmarks/gpu_resources.py``
(that venv from ``bash benchmarks/gpu_session.sh image``).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_decode import VARIANTS  # noqa: E402
from kvslim import formats  # noqa: E402
from kvslim.gpu import paged_prefill  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

SM90_REGISTERS, SM90_SHARED = 65536, 228 * 1024


def loop_counts(sass: str) -> tuple[int, int]:
    """(instructions, global loads) of the longest loop in cuobjdump's SASS: the addresses from
    a backward branch's target to the branch."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)[^;]*;", sass)]
    loops = [(int(t, 16), int(a, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA[^;]*?0x([0-9a-f]+)", sass)
             if int(t, 16) < int(a, 16)]
    if not loops:
        return 0, 0
    first, last = max(loops, key=lambda span: span[1] - span[0])
    body = [op for at, op in code if first <= at <= last]
    return len(body), sum(op.startswith("LDG") for op in body)


def usage(name_k: str, name_v: str, rows: int, head_dim: int, tune: dict) -> dict:
    """Registers per thread, stack bytes per thread, shared bytes, programs per SM and the key
    loop's instructions and global loads of one launch setting."""
    import triton

    from kvslim.gpu import _paged_prefill_kernel as kernel
    from kvslim.gpu import compile_sm90
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    config = paged_prefill._launch_config(fmt_k, fmt_v, rows, head_dim, tune)
    # a decode step's launch at depth (step_output past SPLIT_KEYS keys: the splits' states, merged after;
    # one split stores the output itself, NORMALISE, a few registers more where occupancy is moot)
    config.update(AT_END=True, BY_SLOT=True)
    options = {"num_warps": config.pop("num_warps")}
    if "num_stages" in config:
        options["num_stages"] = config.pop("num_stages")
    pointers = dict(paged_prefill.POINTER_ARGS, q_ptr="*bf16")          # the layer's bf16 queries, read in place
    compiled = compile_sm90(kernel.paged_prefill_tile, pointers, config,
                            paged_prefill.aligned_args(fmt_k, fmt_v, head_dim), **options)   # as a launch aligns
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        report = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
    section = report[report.find("Function paged_prefill_tile"):]
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK):(\d+)", section)}
    threads, shared = 32 * options["num_warps"], compiled.metadata.shared
    by_regs = SM90_REGISTERS // max(1, found.get("REG", 0) * threads)
    instructions, loads = loop_counts(sass)
    return {"regs": found.get("REG"), "stack": found.get("STACK"), "shared": shared,
            "per_sm": min(by_regs, SM90_SHARED // shared if shared else by_regs),
            "loop": instructions, "loads": loads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--pairs", default="f16/f16,q8_0/q8_0,turbo4/turbo4")
    ap.add_argument("--rows", type=int, default=8, help="query rows per KV head (the GQA group)")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--variants", type=int, default=len(VARIANTS), help="the first N of gpu_decode.VARIANTS (1: the default)")
    ap.add_argument("--codecs", default="units", help="how codes are read: units (the default), per-value (session 31's), or both")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:
        sys.exit("this triton has no CUDA backend")
    import triton
    print(f"Triton {triton.__version__}, sm_90 cubins; {args.rows} query rows, head_dim {args.head_dim}\n")
    rows = []
    for block_n, warps, stages, dot, prefetch in VARIANTS[:args.variants]:
        for pair in args.pairs.split(","):
            for codecs in args.codecs.split(","):
                tune = {"BLOCK_N": block_n, "num_warps": warps, "DOT": dot, "CODECS": codecs, "PREFETCH": prefetch,
                        **({"num_stages": stages} if stages else {})}
                cells = [pair, codecs, block_n, warps, stages or "", dot, "yes" if prefetch else ""]
                try:
                    u = usage(*pair.split("/"), args.rows, args.head_dim, tune)
                except Exception as exc:                                # a setting that does not compile
                    rows.append(cells + [""] * 6 + [type(exc).__name__])
                    continue
                rows.append(cells + [u["regs"], u["stack"], f"{u['shared'] // 1024} KB", u["per_sm"], u["loop"],
                                     u["loads"], ""])
    print(markdown_table(["K/V", "codes", "BLOCK_N", "warps", "stages", "dot", "prefetch", "registers", "stack B",
                          "shared", "programs / SM", "loop instr.", "loop loads", "error"], rows,
                         ["l", "l"] + ["r"] * 11 + ["l"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
