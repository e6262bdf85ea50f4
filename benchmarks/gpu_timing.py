"""How the GPU benchmarks time a step: eagerly (launched from Python) and replayed from a CUDA graph.

A decode step's kernels are small: one GEMV of a 35B-A3B layer reads a few MB, a few
microseconds of HBM time, while launching it from Python (argument checks, Triton's launcher)
takes tens of microseconds. Timed eagerly, such a kernel measures its host's launch, not
itself: session 41's GEMV and DeltaNet-step figures were of that kind (0.07-0.13 ms whatever the
batch or shape). The engine runs decode steps from CUDA graphs, so ``graph_ms`` (the GPU's own
time, no host in between) is the figure that compares with bandwidth; ``median_ms`` (eager)
stays beside it, for prompts (which the engine runs eagerly) and to show the host's cost.
On the CPU (a dry run under Triton's interpreter) both are the wall clock.
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import time

import torch

import kvslim.gpu
from kvslim.tools.eval import parse_pairs


def check_pairs(text: str) -> None:
    """Raise ValueError naming the problem unless ``text`` is comma-separated K/V pairs of known
    cache types (``f16/f16,q8_0/turbo4``): the GPU scripts check it before they time anything.
    The names as ``kvslim eval --pairs`` checks them; each pair written out, as the scripts split it."""
    bare = [pair for pair in text.split(",") if pair.count("/") != 1]
    if bare:
        raise ValueError(f"{bare[0]!r} is not a K/V pair (K type/V type, as q8_0/turbo4)")
    parse_pairs(text)


def check_lists(parser, numbers: dict[str, str], pairs: tuple[str, str]) -> None:
    """A GPU script's comma lists checked before it times anything: ``numbers`` (flag -> text) of
    whole numbers, and ``pairs`` (flag, text) of K/V pairs (``check_pairs``); parser.error names
    the flag and the problem."""
    for flag, text in numbers.items():
        if not re.fullmatch(r"\d+(,\d+)*", text):
            parser.error(f"{flag} {text}: comma-separated whole numbers")
    try:
        check_pairs(pairs[1])
    except ValueError as exc:
        parser.error(f"{pairs[0]} {pairs[1]}: {exc}")


def check_device(device: str) -> None:
    """Exit with a clear message unless the kernels can run on ``device`` here (the GPU
    benchmarks' shared check): triton installed, a CUDA device for cuda, the interpreter for cpu."""
    if not kvslim.gpu.available():
        sys.exit("needs triton")
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run it on a GPU, or dry-run with --device cpu and TRITON_INTERPRET=1")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu is a dry run under Triton's interpreter: set TRITON_INTERPRET=1")


def median_ms(fn, runs: int, device: str) -> float:
    """Median milliseconds of ``fn`` launched from Python, after one warm-up call: CUDA events on a
    GPU, the wall clock on the CPU (the interpreter's dry run)."""
    fn()                                                             # compile, warm the caches
    times = []
    for _ in range(runs):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn, runs: int, replays: int = 10) -> float:
    """Median milliseconds of one ``fn`` replayed from a CUDA graph, ``replays`` per timed sample:
    the GPU's own time, no host launches in between (how the engine's decode step runs)."""
    fn()                                                             # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                    # warm-up on a side stream, as capture wants
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    del graph
    return statistics.median(times)


def device_ms(fn, runs: int, device: str) -> float:
    """A decode launch's time as the engine runs it: a CUDA graph's replay on a GPU
    (``graph_ms``), the wall clock on the CPU's dry run."""
    return graph_ms(fn, runs) if device.startswith("cuda") else median_ms(fn, runs, device)


def step_ms(fn, runs: int, device: str) -> tuple[float, float]:
    """(eager ms, graph ms): the second is the first on the CPU's dry run."""
    eager = median_ms(fn, runs, device)
    return eager, graph_ms(fn, runs) if device.startswith("cuda") else eager


def copy_gbps(device: str, mib: int = 1024, runs: int = 10) -> float:
    """Device-to-device copy speed, GB/s counting bytes read and written (FACTS.md's convention)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_ms(lambda: dst.copy_(src), runs, device) / 1e6


def progress(row: list) -> list:
    """Each row to stderr as it is measured: a run cut short by a time limit (a lease's) still
    leaves the rows it timed; the table follows on stdout at the end."""
    print(" | ".join(map(str, row)), file=sys.stderr, flush=True)
    return row
