"""What the attention kernel asks of an H100 per program, without a GPU: registers, stack, shared
memory, and the instructions of one block of keys.

    python benchmarks/gpu_resources.py [-p f16/f16,turbo4/turbo4,q8_0/q8_0] [--rows 8] [--head-dim 256]
                                       [--codecs units,per-value] [--no-warps]
    python benchmarks/gpu_resources.py --gemm q4_0,q4_k [--gemm-rows 16,32,64,128] [--gemm-dot bf16]
    (either with --ops N: each row's N commonest opcodes in the loop)

Compiles ``paged_prefill_tile`` for sm_90 with Triton's CUDA backend (it needs no device) at
each launch setting of ``gpu_decode.VARIANTS`` and reads the cubin's resource usage with the
``cuobjdump`` Triton ships. Registers times threads and shared memory per program decide how
many programs an SM holds at once (65,536 registers, 228 KB of shared memory), and stack bytes
are register spills: what a lease's timings then confirm or not (``gpu_decode.py --sweep``).
"loop" counts the SASS instructions (and global loads) of the kernel's loop over key blocks,
per thread and per block of BLOCK_N keys: the work each block of keys costs. "load lead" is the
median (and least) number of instructions from one of its loads to the first that reads it
(``kvslim.gpu.load_leads``): a load's wait on memory (several hundred cycles) is hidden by its
own warp only where the lead is long, else by other warps, of which the one-warp kernels have few.
Decode's shape by default: one KV head's 8 query rows, head_dim 256 (Qwen3.6-35B-A3B).
The figures depend on Triton's version (3.6 on the lent GPUs, 3.9 here): run it under the
device's too, ``PYTHONPATH=$PWD /tmp/kvslim-image-venv/bin/python benchmarks/gpu_resources.py``
(that venv from ``bash benchmarks/gpu_session.sh image``).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_decode import MMA_VARIANTS, VARIANTS, WARP_VARIANTS, mma_launch  # noqa: E402
from kvslim import formats  # noqa: E402
from kvslim.gpu import paged_prefill  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

SM90_REGISTERS, SM90_SHARED = 65536, 228 * 1024


def loop_counts(sass: str) -> tuple[int, int]:
    """(instructions, global loads) of the longest loop in cuobjdump's SASS."""
    from kvslim.gpu import loop_ops
    body = loop_ops(sass)
    return len(body), sum(op.startswith("LDG") for op in body)


def usage(name_k: str, name_v: str, rows: int, head_dim: int, tune: dict) -> dict:
    """Registers per thread, stack bytes per thread, shared bytes, programs per SM and the key
    loop's instructions and global loads of one launch setting."""
    from kvslim.gpu import _decode_mma_kernel, _decode_warps_kernel, _paged_prefill_kernel
    from kvslim.gpu import compile_sm90
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    config = paged_prefill._launch_config(fmt_k, fmt_v, rows, head_dim, tune)
    # a decode step's launch at depth (step_output past SPLIT_KEYS keys: the splits' states, merged after;
    # one split stores the output itself, NORMALISE, a few registers more where occupancy is moot)
    config.update(BY_SLOT=True)
    kernel = config.pop("KERNEL", "tiles")
    if kernel == "warps":
        fn = _decode_warps_kernel.paged_decode_warps
    elif kernel == "mma":
        fn = _decode_mma_kernel.paged_decode_mma
    else:
        fn = _paged_prefill_kernel.paged_prefill_tile
        config["AT_END"] = True
    options = {"num_warps": config.pop("num_warps")}
    for option in ("num_stages", "maxnreg"):
        if option in config:
            options[option] = config.pop(option)
    pointers = dict(paged_prefill.POINTER_ARGS, q_ptr="*bf16")          # the layer's bf16 queries, read in place
    compiled = compile_sm90(fn, pointers, config,
                            paged_prefill.aligned_args(fmt_k, fmt_v, head_dim), **options)   # as a launch aligns
    return report(compiled, options["num_warps"])


def report(compiled, num_warps: int) -> dict:
    """A compiled kernel's registers and stack per thread, shared bytes, programs per SM and its
    longest loop's instructions and global loads per thread (``cuobjdump`` from Triton's wheel)."""
    from kvslim.gpu import cuobjdump, load_leads, loop_ops, resource_usage
    found, sass = resource_usage(compiled), cuobjdump(compiled, "-sass")
    leads = sorted(load_leads(sass))
    threads, shared = 32 * num_warps, compiled.metadata.shared
    by_regs = SM90_REGISTERS // max(1, found.get("REG", 0) * threads)
    instructions, loads = loop_counts(sass)
    return {"regs": found.get("REG"), "stack": found.get("STACK"), "shared": shared,
            "per_sm": min(by_regs, SM90_SHARED // shared if shared else by_regs),
            "loop": instructions, "loads": loads, "ops": Counter(op.split(".")[0] for op in loop_ops(sass)),
            "lead": f"{leads[len(leads) // 2]} ({leads[0]})" if leads else ""}


def gemm_usage(name: str, dot: str, rows: int, grouped: bool) -> dict:
    """``report`` for a prompt's GEMM on ``name`` blocks with ``dot`` products: the grouped
    experts' (``quant_gemm_experts``, tiles of ``rows`` slots, routing weights applied) or the
    dense one (``quant_gemm``, the launcher's tile for ``rows`` rows of x), as a launch aligns."""
    from kvslim import weights
    from kvslim.gpu import _quant_matmul_kernel as kernel
    from kvslim.gpu import compile_sm90
    from kvslim.gpu import quant_matmul
    config = quant_matmul.gemm_config(rows)
    num_warps = config.pop("num_warps")
    dtype, precision = kernel.DOTS[dot]
    constexprs = dict(config, TYPE=int(weights.get(name).ggml_type), DOT_DTYPE=dtype, PRECISION=precision)
    pointers = {"x_ptr": "*" + dot, "w_ptr": "*u8", "grid_ptr": "*i8", "y_ptr": "*" + dot}
    fn, sizes = kernel.quant_gemm, ("N", "K", "row_bytes")
    if grouped:
        pointers.update(pairs_ptr="*i32", tile_expert_ptr="*i32", scale_ptr="*" + dot, y_ptr="*fp32")
        constexprs["SCALED"] = True
        fn, sizes = kernel.quant_gemm_experts, ("N", "K", "row_bytes", "expert_bytes")
    return dict(report(compile_sm90(fn, pointers, constexprs, sizes, num_warps=num_warps), num_warps),
                **config)


def _top_ops(u: dict, n: int) -> str:
    return ", ".join(f"{op} {count}" for op, count in u["ops"].most_common(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--pairs", default="f16/f16,q8_0/q8_0,turbo4/turbo4")
    ap.add_argument("--rows", type=int, default=8, help="query rows per KV head (the GQA group)")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--variants", type=int, default=len(VARIANTS), help="the first N of gpu_decode.VARIANTS (1: the default)")
    ap.add_argument("--warps", action=argparse.BooleanOptionalAction, default=True,
                    help="also decode by warps' launches (gpu_decode.WARP_VARIANTS; 'loop' is then a step of KP keys "
                         "a warp, counting the one-warp launch's rescale, which most steps skip)")
    ap.add_argument("--mma", action=argparse.BooleanOptionalAction, default=True,
                    help="also KERNEL 'mma' (gpu_decode.MMA_VARIANTS: N keys a step; 'loop' is then a step of N keys "
                         "of one warp), for the pairs it reads")
    ap.add_argument("--codecs", default="units", help="how codes are read: units (the default), per-value (session 31's), or both")
    ap.add_argument("--columns", default="adjacent",
                    help="where a group of codes goes in the tile (paged_prefill.COLUMNS): adjacent (the default), "
                         "strided (sessions 32-44), or both")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="also each row's N commonest opcodes in the loop (where a step's instructions go)")
    ap.add_argument("--gemm", default=None, metavar="TYPES",
                    help="instead: a prompt's GEMMs on these weight types (q4_0,q4_k), grouped and dense")
    ap.add_argument("--gemm-rows", default="16,32,64,128", help="with --gemm: rows of x a tile")
    ap.add_argument("--gemm-dot", default="bf16", help="with --gemm: the products' type (bf16, fp16, ieee)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError:
        sys.exit("this triton has no CUDA backend")
    import triton
    if args.gemm:
        print(f"Triton {triton.__version__}, sm_90 cubins; a prompt's GEMMs, {args.gemm_dot} products; "
              f"'loop': a step of BLOCK_K columns\n")
        table = []
        for name in args.gemm.split(","):
            for grouped in (True, False):
                for n_rows in (int(r) for r in args.gemm_rows.split(",")):
                    u = gemm_usage(name, args.gemm_dot, n_rows, grouped)
                    table.append([name, "grouped experts" if grouped else "dense", u["BLOCK_M"], u["BLOCK_N"],
                                  u["BLOCK_K"], u["regs"], u["stack"], u["per_sm"], u["loop"], u["loads"],
                                  u["lead"], _top_ops(u, args.ops)])
        print(markdown_table(["type", "GEMM", "BLOCK_M", "BLOCK_N", "BLOCK_K", "registers", "stack B",
                              "programs / SM", "loop instr.", "loop loads", "load lead (min)", "ops"], table,
                             ["l", "l"] + ["r"] * 9 + ["l"]))
        return 0
    print(f"Triton {triton.__version__}, sm_90 cubins; {args.rows} query rows, head_dim {args.head_dim}\n")
    # (the row's first cells, the launch's tune): decode by warps' launches, then the tile kernel's
    settings = [([pair, "warps", "", warps, "", "fma", f"KP {keys}" + (", rows" if ahead else "")],
                 {"KERNEL": "warps", "num_warps": warps, "KP": keys, "PREFETCH": ahead})
                for warps, keys, ahead in (WARP_VARIANTS if args.warps else ()) for pair in args.pairs.split(",")]
    for variant in MMA_VARIANTS if args.mma else ():
        cell, tune = mma_launch(*variant)              # cell: "N 16, rows, ...": the keys are their own column
        settings += [([pair, "mma", tune["N"], 1, "", "f16", cell.partition(", ")[2]], tune)
                     for pair in args.pairs.split(",")]
    settings += [([pair, codecs + ("" if columns == "adjacent" else ", strided"), block_n, warps, stages or "", dot,
                   {True: "rows", 2: "codes"}.get(prefetch, "")],
                  {"BLOCK_N": block_n, "num_warps": warps, "DOT": dot, "CODECS": codecs, "PREFETCH": prefetch,
                   "COLUMNS": columns, **({"num_stages": stages} if stages else {})})
                 for block_n, warps, stages, dot, prefetch in VARIANTS[:args.variants]
                 for pair in args.pairs.split(",") for codecs in args.codecs.split(",")
                 for columns in args.columns.split(",")]
    rows = []
    for cells, tune in settings:
        try:
            u = usage(*cells[0].split("/"), args.rows, args.head_dim, tune)
        except Exception as exc:                                        # a setting that does not compile or read
            rows.append(cells + [""] * 7 + [f"{type(exc).__name__}: {exc}"[:70]])
            continue
        rows.append(cells + [u["regs"], u["stack"], f"{u['shared'] // 1024} KB", u["per_sm"], u["loop"],
                             u["loads"], u["lead"], _top_ops(u, args.ops)])
    print(markdown_table(["K/V", "codes", "BLOCK_N", "warps", "stages", "dot", "prefetch", "registers", "stack B",
                          "shared", "programs / SM", "loop instr.", "loop loads", "load lead (min)", "error / ops"],
                         rows, ["l", "l"] + ["r"] * 12 + ["l"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
