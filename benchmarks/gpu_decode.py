"""Decode attention on a GPU: f16 SDPA, the torch block loop and the Triton kernel on packed pages.

    python benchmarks/gpu_decode.py [-d 32768,131072] [-b 1,8] [-p pairs] [-r 20] [--no-loop] [--sweep]
                                    [--codecs units,per-value] [--dot ieee,f16] [--kernels tiles,warps,mma]
                                    [--tuned-out FILE] [--jobs N]

One attention layer shaped like Qwen3.6-35B-A3B's (2 KV heads, 8 query heads each, head_dim
256), pages of 16 keys handed out shuffled, every sequence at the same depth. For each K/V
pair, depth and batch: the median time of one decode step's attention (CUDA events, after a
warm-up that compiles the kernel) for
- ``sdpa f16``: torch's scaled_dot_product_attention on contiguous f16 K/V, flash backend (each
  KV head's 8 query heads go in as 8 query rows, so no GQA expansion is needed): what a plain
  f16 cache costs, the baseline of issue 18;
- ``torch``: the block loop ``attention._scan_decode`` runs without the kernel (its reference);
- ``triton``: ``kvslim.gpu.paged_decode`` plus the normalisation and V's output transform,
  so it returns what SDPA returns; once per ``--codecs`` x ``--dot`` (the bf16 attention
  backend's kernels take ``f16``), labelled where they are not the defaults; with ``--kernels``
  warps, also decode by warps (KERNEL "warps": each warp its own keys, CUDA-core products),
  labelled "warps"; with mma, the packed codes decoded into tensor-core operands (KERNEL "mma",
  ``_decode_mma_kernel``), labelled "mma", and as "mma, early" with every load of a step issued
  before its decoding (PREFETCH 1, EARLY 1; pairs it does not read say so); with served, the
  launch a decode step of the bf16 backend takes on this device (``kvslim serve``'s: its tuned
  file's, else the default), labelled with it.
On a GPU each step is timed twice: launched from Python ("eager ms": the host's launches
included, which at 32K take longer than the kernels) and replayed from a CUDA graph ("ms": the
GPU's time, as the engine's decode step runs in graphs); ratios and bandwidth use the graph's.
``--sweep`` times the kernel's launch settings (``paged_prefill.TUNABLE``: keys per block,
warps, pipelining stages, the dots' precision, how codes are read; decode by warps with
``--kernels`` warps, and KERNEL "mma" with mma) and keys per split against one another, each with its largest difference
from the torch loop's output on the same inputs. ``--tuned-out FILE`` writes each pair's fastest
launch per attention backend into FILE where it beat the backend's default (``kvslim.gpu.tuned``:
committed as ``kvslim/gpu/tuned/<device>.json``, decode steps on that device take it);
``--jobs N`` first compiles the sweep's launches in N processes (Triton's disk cache): each
takes about a second of one core (sm_90 here), and a sweep of four pairs has about two hundred.
The bandwidth columns count the bytes of K/V the step must read (packed for the kernel, f16 for
SDPA) over its time, beside a device-to-device copy measured in the same run (bytes read and
written over time, as FACTS.md quotes it). Figures, not a test: parity is
tests/test_triton_attention.py. ``--device cpu`` with TRITON_INTERPRET=1 dry-runs the script on
tiny shapes (timings meaningless).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvslim.gpu  # noqa: E402
from kvslim import formats  # noqa: E402
from kvslim.cache import attention  # noqa: E402
from kvslim.gpu import paged_decode as gpu  # noqa: E402
from kvslim.gpu import paged_prefill as gpu_prefill  # noqa: E402
from kvslim.gpu import tuned as gpu_tuned  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

from gpu_timing import check_device, check_lists, copy_gbps, device_ms, median_ms, progress, step_ms  # noqa: E402  (same folder)

N_KV, GROUP, HEAD_DIM, PAGE = 2, 8, 256, 16
PAIRS = "f16/f16,q8_0/q8_0,q4_0/q4_0,iq4_nl/iq4_nl,turbo4/turbo4,turbo3/turbo3,turbo2/turbo2,q8_0/turbo4"


def _inputs(name_k: str, name_v: str, depth: int, batch: int, device: str):
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    per_seq = -(-depth // PAGE)
    pages = batch * per_seq + 1

    def pool(fmt):                                                   # encoded on the device, a head at a time
        heads = [fmt.encode(torch.randn(pages * PAGE, HEAD_DIM, device=device)) for _ in range(N_KV)]
        return torch.stack(heads).reshape(N_KV, pages, PAGE, -1)
    table = (torch.randperm(pages - 1, device=device)[:batch * per_seq] + 1).reshape(batch, per_seq).int()
    q = fmt_k.to_code_domain(torch.randn(N_KV, batch, GROUP, HEAD_DIM, device=device) * HEAD_DIM ** -0.5)
    n_keys = torch.full((batch,), depth, device=device)
    return fmt_k, fmt_v, q, pool(fmt_k), pool(fmt_v), table, n_keys


def sdpa_f16(depth: int, batch: int, device: str):
    """The plain f16 cache's step: each KV head's query heads as query rows over its own keys
    (the same sums as GQA), on the first SDPA backend that takes it, flash first.
    -> (step, bytes of K/V it reads, the backend's name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    k = torch.randn(batch, N_KV, depth, HEAD_DIM, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(batch, N_KV, GROUP, HEAD_DIM, device=device, dtype=torch.float16)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] \
        if device.startswith("cuda") else [SDPBackend.MATH]
    for backend in backends:
        def step(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        try:
            step()
        except RuntimeError as err:                                 # this backend refuses the shape
            print(f"sdpa {backend.name}: {str(err).splitlines()[0]}", file=sys.stderr)
            continue
        return step, 2 * k.numel() * k.element_size(), backend.name.split("_")[0].lower()
    raise SystemExit("no SDPA backend takes the f16 baseline's shapes here")


def packed_step(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys, split_keys=gpu.SPLIT_KEYS, tune=None):
    """The kernel's step, finished to what SDPA returns: normalised, in the model domain."""
    def step():
        _, l, acc = gpu.decode_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys, split_keys, tune)
        return fmt_v.from_code_domain(acc / l)
    return step


def loop_step(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys):
    """The torch block loop (the kernel's reference), with the kernels switched off for the call."""
    def step():
        was, kvslim.gpu.TRITON = kvslim.gpu.TRITON, False
        try:
            acc = attention._scan_decode(fmt_k, fmt_v, k_pool, v_pool, table, q, n_keys)
        finally:
            kvslim.gpu.TRITON = was
        return acc
    return step


def served_launch(name_k: str, name_v: str, device: str) -> tuple[dict | None, str, int]:
    """The launch a decode step of this layer takes on the bf16 attention backend (what ``kvslim
    serve`` runs): this device's tuned file's (``KVSLIM_DECODE_TUNED`` names another), else the
    backend's default -> (tune, its label, keys a split)."""
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    tune, split = gpu.step_launch(fmt_k, fmt_v, HEAD_DIM, GROUP, "bf16", torch.device(device))
    chosen = tune != gpu_tuned.BACKENDS["bf16"] or split != gpu.SPLIT_KEYS
    cells = ", ".join(f"{k} {v}" for k, v in (tune or {}).items())
    return tune, f"served, {'tuned' if chosen else 'default'}: {cells}, split {split}", split


def _rows(pairs: list[str], depth: int, batch: int, args, copy: float) -> list[list]:
    """One row per K/V pair and the SDPA baseline's, at one depth and batch."""
    def gbps(read, ms):
        return f"{read / ms / 1e6:.0f}", f"{100 * read / ms / 1e6 / copy:.0f}%"
    step, read, backend = sdpa_f16(depth, batch, args.device)
    eager, base = step_ms(step, args.runs, args.device)
    rows = [progress([f"sdpa f16 ({backend})", depth, batch, "", f"{eager:.3f}", f"{base:.3f}", "1.00",
                      *gbps(read, base)])]
    del step
    for pair in pairs:
        inputs = _inputs(*pair.split("/"), depth, batch, args.device)
        k_pool, v_pool = inputs[3], inputs[4]
        read = batch * depth * N_KV * (k_pool.shape[3] + v_pool.shape[3])   # packed bytes of K and V
        loop = "" if args.no_loop else f"{median_ms(loop_step(*inputs), args.runs, args.device):.3f}"
        kernels = args.kernels.split(",")
        tunes = [({"CODECS": codecs, "DOT": dot}, ", ".join(v for v, default in ((codecs, "units"), (dot, "ieee"))
                                                              if v != default), gpu.SPLIT_KEYS)
                 for codecs in args.codecs.split(",") for dot in (args.dot or "ieee").split(",") if "tiles" in kernels]
        if "warps" in kernels:
            tunes.append(({"KERNEL": "warps"}, "warps", gpu.SPLIT_KEYS))
        if "mma" in kernels:                    # its default, and every load of a step first (session 47)
            tunes += [({"KERNEL": "mma"}, "mma", gpu.SPLIT_KEYS),
                      ({"KERNEL": "mma", "PREFETCH": 1, "EARLY": 1}, "mma, early", gpu.SPLIT_KEYS)]
        if "served" in kernels:                 # first: what a decode step takes, before the alternatives
            tunes.insert(0, served_launch(*pair.split("/"), args.device))
        for tune, label, split in tunes:
            try:
                eager, ms = step_ms(packed_step(*inputs, split_keys=split, tune=tune), args.runs, args.device)
            except ValueError as exc:                                   # a pair the warps or mma kernel does not read
                rows.append(progress([f"{pair} ({label})", depth, batch, loop, str(exc)[:60], "", "", "", ""]))
                continue
            rows.append(progress([f"{pair} ({label})" if label else pair, depth, batch, loop, f"{eager:.3f}",
                                  f"{ms:.3f}", f"{ms / base:.2f}", *gbps(read, ms)]))
            loop = ""
        del inputs, k_pool, v_pool
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


# The sweep's launch settings: (BLOCK_N, num_warps, num_stages, DOT); the first is the default's.
# Session 30's lease timed the default against 32-128 keys a block and "tf32x3" (none faster) and
# keys per split 128 against 512 (within 3%); it ran out of time before the sweep's end. These
# are what it has not timed, chosen from benchmarks/gpu_resources.py's offline report: 4 and 16
# warps, "fma" (no tl.dot, ~no shared memory, no spills at 4-8 keys a block) and "f16" (tensor-
# core products of f16 operands, a third of the shared memory).
# Session 42 added f16 settings that sm_90 SASS (Triton 3.6, codes and scales read in f16) rates
# well: 32 keys and 8 warps (turbo4/turbo4 14.1 instructions a value, 128 registers, 2 programs
# per SM, against 16.9 at 16 keys), 64 keys (12.4, 1 program), and 32 keys / 4 warps pipelined.
# ``--dot`` given with ``--sweep`` keeps the settings of those products only. The fifth field:
# PREFETCH (1: each block's pool rows read from the block table a block ahead; 2, session 43: its
# codes too, loaded into registers a block ahead of their decoding). Session 44 added 2 warps, which
# no lease has timed: at 8 rows and head_dim 256 with f16 products, sm_90 SASS (Triton 3.6) counts
# 200 instructions a key and warp for turbo4/turbo4 (272 at 8 warps), 158 for turbo3 (246), 60 for
# f16 (123), no spills, 4-6 programs an SM; a 2-warp program's barriers hold 2 warps, not 8.
VARIANTS = [(16, 8, None, "ieee", False), (16, 4, None, "ieee", False), (16, 16, None, "ieee", False),
            (4, 8, None, "fma", False), (8, 8, None, "fma", False), (16, 8, None, "f16", False),
            (16, 2, None, "f16", False), (32, 2, None, "f16", False), (16, 2, None, "f16", 2),
            (16, 4, None, "f16", False), (32, 4, None, "f16", False), (32, 8, None, "f16", False),
            (64, 8, None, "f16", False), (32, 4, 2, "f16", False), (16, 8, None, "f16", True),
            (32, 8, None, "f16", True), (16, 8, None, "f16", 2), (32, 8, None, "f16", 2), (64, 8, None, "f16", 2)]
SPLITS = (512,)
# Session 45 put a group of codes' values side by side in the tile (COLUMNS "adjacent", the default):
# sm_90 SASS (Triton 3.6), turbo4/turbo4 with f16 products 543 -> 503 instructions a block at 8 warps,
# 1,597 -> 1,457 at 2 (254 -> 187 registers, 5 programs an SM, not 4), float32 products 1,273 -> 1,075
# (80 -> 99 registers: 2 programs an SM, not 3). These launches also as before ("strided"), to time both.
STRIDED = [(16, 8, None, "f16", False), (16, 2, None, "f16", False), (16, 8, None, "ieee", False)]
# Decode by warps (session 44: KERNEL "warps"), timed first for each pair whatever ``--dot`` says (its
# products are float32 FMAs): (num_warps, KP keys a warp a step, PREFETCH). sm_90 SASS (Triton 3.6),
# turbo4/turbo4 at 8 rows and head_dim 256: one warp 555 instructions a key and warp (~410 when
# its rescale is skipped), 209 registers, 9 programs per SM, with rows a step ahead 581 and 211;
# two warps 571, 199, 5; two keys a warp a step 516 a key (1,032 a step, each key one FMA into the sums), 237
# registers. The one-warp default also
# over splits of 128 keys: at 128K x 1 its 512 programs of one warp fill under half of an H200's
# ~1,200 slots (9 an SM), 2,048 fill them (4x the splits' states to merge).
WARP_VARIANTS = [(1, 1, 1), (1, 1, 0), (2, 1, 1), (4, 1, 1), (1, 2, 1)]
WARP_SPLITS = {(1, 1, 1): (512, 128)}
# Decode with codes decoded into tensor-core operands (session 46: KERNEL "mma", Gluon; issue 18's
# seven formats as K and V, f16 products): N keys a step. sm_90 SASS (Triton 3.6), 8 rows at head_dim
# 256, turbo4/turbo4: 85 instructions a key at N 16 (172 registers, 11 one-warp programs an SM), 81 at
# 32 (248, 8), no shared memory; the tile kernel's launches take 172-251. One warp a program, so
# splits of 128 keys too, as the one-warp warps launch. PREFETCH 1 reads a step's table entries a
# step ahead ("rows"; 210 registers for turbo4, 9 programs an SM; at N 32 it spills, so not there);
# 0 is its default. maxnreg 128: 16 programs an SM instead of 11, for spills (248 bytes) and 22%
# more instructions a key. EARLY 1 (session 47): every load of a step issued before its decoding,
# where the default loads each block where it is decoded (in sm_90 SASS a step's loads then come in
# several bursts, each waited on: K's blocks, then V's after the scores); with PREFETCH 1 a step
# waits on memory once, for 251 registers (8 programs an SM; at maxnreg 168, 12, spilling 232 bytes).
# Session 50: L2_AHEAD 4, each step asking L2 for the rows 4 steps on (turbo4/turbo4 at EARLY and PREFETCH
# 1: 246 registers under Triton 3.6, 8 programs an SM as without; at use 172 -> 239, 11 -> 8).
MMA_VARIANTS = [(16, 1, 1, None, 0), (16, 0, 0, None, 0), (16, 1, 0, None, 0), (32, 0, 0, None, 0),
                (16, 0, 0, 128, 0), (16, 1, 1, 168, 0), (16, 1, 1, None, 4), (16, 0, 0, None, 4)]
# (N, PREFETCH, EARLY, maxnreg, L2_AHEAD)
# Keys a split: at 128K x 1, 512 gives 512 one-warp programs (under half the H200's 132 SMs x 8 at
# EARLY's registers), 256 one wave of 1,024, 128 two waves
MMA_SPLITS = (512, 256, 128)


def mma_launch(n: int, ahead: int, early: int, cap: int | None, l2: int = 0) -> tuple[str, dict]:
    """An MMA_VARIANTS entry as (its prefetch cell, its tune)."""
    cell = (f"N {n}" + (", rows" if ahead else "") + (", early" if early else "") + (f", {cap} regs" if cap else "")
            + (f", L2 +{l2}" if l2 else ""))
    return cell, {"KERNEL": "mma", "N": n, "PREFETCH": ahead, "EARLY": early, **({"maxnreg": cap} if cap else {}),
                  **({"L2_AHEAD": l2} if l2 else {})}


def _prefetch_cell(prefetch, codecs: str) -> str:
    """The sweep's prefetch column: what PREFETCH a tile launch takes, or a warps launch's KP and
    whether its rows come a step ahead."""
    if codecs == "warps":
        return f"KP {prefetch[0]}" + (", rows" if prefetch[1] else "")
    return {True: "rows", 2: "codes"}.get(prefetch, "")


def _settings(args) -> list[tuple[tuple, dict, tuple]]:
    """The sweep's launches, in its order: (table cells: BLOCK_N, warps, stages, dot, prefetch,
    codes; the launch's tune; its keys per split). With ``--kernels`` warps, decode by warps
    first, then with mma KERNEL "mma" (MMA_VARIANTS); with tiles, every VARIANT of ``--dot``'s
    products with codes two bytes a load, then the first of them also as session 31 read codes (a
    load per value), then the STRIDED launches with a group's codes W columns apart (the codes
    column says "strided")."""
    kernels = args.kernels.split(",")
    ours = lambda launches: [v for v in launches if (args.dot is None or v[3] in args.dot.split(","))   # noqa: E731
                             and "tiles" in kernels]
    settings = [(("", w, "", "fma", _prefetch_cell((kp, pf), "warps"), "warps"),
                 {"KERNEL": "warps", "num_warps": w, "KP": kp, "PREFETCH": pf}, WARP_SPLITS.get((w, kp, pf), SPLITS))
                for w, kp, pf in WARP_VARIANTS if "warps" in kernels]
    for variant in (MMA_VARIANTS if "mma" in kernels else ()):
        cell, tune = mma_launch(*variant)
        settings.append((("", 1, "", "f16", cell, "mma"), tune, MMA_SPLITS))
    variants = ours(VARIANTS)
    tiles = ([(v, "units", "adjacent") for v in variants] + [(v, "per-value", "adjacent") for v in variants[:1]]
             + [(v, "units", "strided") for v in ours(STRIDED)])
    for (block_n, warps, stages, dot, prefetch), codecs, order in tiles:
        tune = {"BLOCK_N": block_n, "num_warps": warps, "DOT": dot, "CODECS": codecs, "PREFETCH": prefetch,
                "COLUMNS": order, **({"num_stages": stages} if stages else {})}
        label = codecs if order == "adjacent" else order
        settings.append(((block_n, warps, stages or "", dot, _prefetch_cell(prefetch, label), label), tune, SPLITS))
    return settings


def _sweep_rows(pairs: list[str], depth: int, batch: int, args, copy: float, trials: dict) -> None:
    """Every setting x its splits at one depth and batch, per pair, printed as a table row each:
    graph time, bandwidth and the largest difference from the torch loop's normalised output on
    the same inputs. Each launch that ran goes into ``trials[pair]``: [tune, split, ms by
    "depth x batch", largest difference over the output's largest |value|] (``gpu.tuned.best``'s)."""
    def emit(*cells):
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    step, _, backend = sdpa_f16(depth, batch, args.device)
    base = step_ms(step, args.runs, args.device)[1]                 # the ratios' baseline, this run's
    emit(f"sdpa f16 ({backend})", depth, batch, "", "", "", "", "", "", "", f"{base:.3f}", "1.00", "", "", "")
    del step
    for pair in pairs:
        inputs = _inputs(*pair.split("/"), depth, batch, args.device)
        fmt_v, k_pool, v_pool = inputs[1], inputs[3], inputs[4]
        read = batch * depth * N_KV * (k_pool.shape[3] + v_pool.shape[3])
        want = fmt_v.from_code_domain(loop_step(*inputs)().result())
        largest = want.abs().max().item() or 1.0
        for cells, tune, splits in _settings(args):
            for split in splits:
                step = packed_step(*inputs, split, tune)
                try:
                    err = (step() - want).abs().max().item()
                    ms = device_ms(step, args.runs, args.device)
                except Exception as exc:                             # a setting that does not compile or fit
                    emit(pair, depth, batch, *cells, split, "", "", "", "",
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
                    continue
                emit(pair, depth, batch, *cells, split, f"{ms:.3f}", f"{ms / base:.2f}", f"{read / ms / 1e6:.0f}",
                     f"{100 * read / ms / 1e6 / copy:.0f}%", f"{err:.1e}")
                trial = trials.setdefault(pair, {}).setdefault((repr(sorted(tune.items())), split), [tune, split, {}, 0.0])
                trial[2][f"{depth}x{batch}"] = ms
                trial[3] = max(trial[3], err / largest)
        del inputs, k_pool, v_pool
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if args.tuned_out:
            _save_tuned(args, pair, trials[pair])


def _save_tuned(args, pair: str, trials: dict) -> None:
    """The pair's fastest launch per attention backend, where it beat the backend's default, into
    ``--tuned-out`` (``gpu.tuned``): written after each pair, so a sweep cut short keeps its choices."""
    fmt_k, fmt_v = formats.get(pair.split("/")[0], role="k"), formats.get(pair.split("/")[1], role="v")
    listed, entries = list(trials.values()), []
    for backend, tune in gpu_tuned.BACKENDS.items():
        default = next((i for i, t in enumerate(listed) if gpu_tuned.same_launch(
            fmt_k, fmt_v, HEAD_DIM, GROUP, (t[0], t[1]), (tune, gpu.SPLIT_KEYS))), None)
        choice = None if default is None else gpu_tuned.best(listed, default, backend)
        if choice:
            entries.append(gpu_tuned.Entry(fmt_k.name, fmt_v.name, HEAD_DIM, GROUP, backend, *choice))
        ms = lambda times: ", ".join(f"{p} {t:.3f}" for p, t in times.items())   # noqa: E731
        print(f"tuned {pair} ({backend} backend): " + ("its default launch was not timed" if default is None else
              f"{choice[0]}, {choice[1]} keys a split: {ms(choice[2])} ms against {ms(choice[3])}" if choice else
              "the default launch is the fastest"), file=sys.stderr, flush=True)
    gpu_tuned.save(args.tuned_out, entries, _device_name(args.device), "benchmarks/gpu_decode.py " + " ".join(args.argv))


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu (interpreter)"


def _warm_tasks(args) -> list[tuple[str, int, int, int, int]]:
    """Every launch the sweep will compile, in its order: (pair, depth, batch, setting, split)."""
    return [(pair, int(d), int(b), i, split) for d in args.depths.split(",") for b in args.batches.split(",")
            for pair in args.pairs.split(",") for i, (_, _, splits) in enumerate(_settings(args)) for split in splits]


def _warm(args, shard: str) -> None:
    """One of ``--jobs`` processes: its share of the sweep's launches run once each, which compiles
    them into Triton's on-disk cache; the sweep then loads them from it. The share is contiguous,
    so a process makes a pair's inputs once or twice; failures are the sweep's to report."""
    index, n = (int(x) for x in shard.split("/"))
    tasks = _warm_tasks(args)
    settings, held = _settings(args), (None, None)
    for pair, depth, batch, i, split in tasks[len(tasks) * index // n:len(tasks) * (index + 1) // n]:
        if held[0] != (pair, depth, batch):
            held = (None, None)                                      # the last inputs freed first
            held = ((pair, depth, batch), _inputs(*pair.split("/"), depth, batch, args.device))
        try:
            packed_step(*held[1], split, settings[i][1])()
        except Exception:                   # noqa: BLE001 (the sweep runs it again and reports it)
            pass
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def _warm_in_parallel(args) -> None:
    """Compile the sweep's launches in ``--jobs`` processes at once (one compile takes about a
    second of one CPU core, and a sweep has hundreds; a lease's machine has 16 cores), for at
    most ``--warm-timeout`` seconds; whatever they did not reach, the sweep compiles itself."""
    t0, procs = time.perf_counter(), []
    for i in range(args.jobs):
        procs.append(subprocess.Popen([sys.executable, __file__, *args.argv, "--warm", f"{i}/{args.jobs}"],
                                      stdout=subprocess.DEVNULL))
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, t0 + args.warm_timeout - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    codes = [proc.returncode for proc in procs]
    print(f"warmed {len(_warm_tasks(args))} launches in {args.jobs} processes, {time.perf_counter() - t0:.0f} s "
          f"(exit codes {sorted(set(codes))})", file=sys.stderr, flush=True)


def parse(argv=None) -> argparse.Namespace:
    """The command line, checked before anything is timed (a lease's flag typo exits here, and
    tests/test_gpu_session.py parses every command a lease runs this way)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-d", "--depths", default="32768,131072")
    parser.add_argument("-b", "--batches", default="1,8")
    parser.add_argument("-p", "--pairs", default=PAIRS)
    parser.add_argument("-r", "--runs", type=int, default=20)
    parser.add_argument("--no-loop", action="store_true", help="skip the torch block loop (slow at depth)")
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only with TRITON_INTERPRET=1 (a dry run)")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch settings instead")
    parser.add_argument("--codecs", default="units",
                        help="how the kernel reads codes, comma-separated: units (the default), per-value "
                             "(session 31's reading, for side-by-sides)")
    parser.add_argument("--kernels", default="tiles",
                        help="tiles (the default), warps (decode by warps), mma (codes decoded into tensor-core "
                             "operands), served (the launch a decode step takes on the bf16 backend: this device's "
                             "tuned one, else the default), comma-separated")
    parser.add_argument("--tuned-out", default=None, metavar="FILE",
                        help="with --sweep: each pair's fastest launch per attention backend, where it beat the "
                             "default, into FILE (kvslim.gpu.tuned; KVSLIM_DECODE_TUNED=FILE serves it)")
    parser.add_argument("-j", "--jobs", type=int, default=0,
                        help="with --sweep: compile its launches in N processes first (Triton's disk cache)")
    parser.add_argument("--warm-timeout", type=float, default=120.0, help="with --jobs: seconds they may take")
    parser.add_argument("--warm", default=None, help=argparse.SUPPRESS)   # i/N: one of --jobs' processes
    parser.add_argument("--dot", default=None,
                        help="the kernel's products, comma-separated (paged_prefill.DOTS): ieee (the table's "
                             "default), f16 (the bf16 attention backend's); with --sweep, the settings of these")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    for flag, given, valid in (("--codecs", args.codecs, gpu_prefill.CODECS),
                               ("--dot", args.dot or "ieee", gpu_prefill.DOTS),
                               ("--kernels", args.kernels, gpu_prefill.KERNELS + ("served",))):
        if set(given.split(",")) - set(valid):
            parser.error(f"{flag} {given}: each of {', '.join(valid)}")
    if (args.tuned_out or args.jobs) and not args.sweep:
        parser.error("--tuned-out and --jobs go with --sweep")
    if args.sweep and "served" in args.kernels.split(","):
        parser.error("--kernels served is the table's (the sweep times launch settings, not what a step takes)")
    check_lists(parser, {"-d": args.depths, "-b": args.batches}, ("-p", args.pairs))
    return args


def main(argv=None) -> None:
    args = parse(argv)
    check_device(args.device)
    if args.warm:
        return _warm(args, args.warm)
    copy = copy_gbps(args.device, mib=1024 if args.device.startswith("cuda") else 16)
    name = _device_name(args.device)
    print(f"{name}: device-to-device copy {copy:.0f} GB/s (read + written); median of {args.runs}\n")
    if args.sweep:                      # rows as they come (unaligned): a run cut short keeps its rows
        print("| K/V | depth | batch | BLOCK_N | warps | stages | dot | prefetch | codes | split | ms | x sdpa f16 "
              "| GB/s read | of copy | max diff |")
        print("|---|" + "---:|" * 14, flush=True)
        if args.jobs > 1:
            _warm_in_parallel(args)
        trials = {}
        for d in args.depths.split(","):
            for b in args.batches.split(","):
                _sweep_rows(args.pairs.split(","), int(d), int(b), args, copy, trials)
        if args.tuned_out:
            print(f"\ntuned launches: {args.tuned_out} ({len(gpu_tuned.load(args.tuned_out))} entries)")
        return
    rows = [row for d in args.depths.split(",") for b in args.batches.split(",")
            for row in _rows(args.pairs.split(","), int(d), int(b), args, copy)]
    print(markdown_table(["K/V", "depth", "batch", "torch loop ms", "eager ms", "ms", "x sdpa f16", "GB/s read",
                          "of copy"], rows, ["l", "r", "r", "r", "r", "r", "r", "r", "r"]))


if __name__ == "__main__":
    main()
