"""The kernels one decode step launches on a GPU, counted without one.

    python benchmarks/decode_launches.py [--model qwen3.6-35b-a3b] [--shrink 1] [--layers 8] [-np 1] [--top 25]
                                         [--where _to_copy] [--weights q4_0 [--compile]] [-d 0] [-ctk f16] [-ctv f16]

Session 31's profile of a 35B-A3B decode step on an H200 found ~3,000 small torch kernels (1-6 us
each, about a quarter of the step) beside the GEMVs. This counts them where no GPU is lent: the
catalog model's layers at their real widths (``--shrink N`` divides them: the quantized GEMVs'
splits of K, each one more launch to sum, depend on the widths, so a shrunk model undercounts;
session 37's figures, taken at 8, counted 40 split sums where the real widths take 120),
bf16, built on *fake* CUDA tensors (torch's FakeTensorMode: shapes and devices, no memory, no
device), with the torch attention backend and float weights, and one DecodeBatch step recorded
by a dispatch mode. Every aten op that is not a view is counted as one launch (composite ops
by what they run; ``rms_norm`` as the one ``_fused_rms_norm`` it is on CUDA; kvslim's own ops,
such as the ``kvslim::paged_decode`` a decode step's attention is, by what their bodies run). ``--weights q4_0``
counts the path gpu_model.py times instead: block-type matrices (zero bytes: no values are
needed) and the GPU kernels on, each Triton or fla-core launch counted as ``triton::<kernel>``
without running (their outputs, allocated by the launching code, already have their shapes;
fla-core's path on its ``PYTHONPATH``, e.g. ``.venv/fla``), with the programs each launch's grid
makes and its warps a program: a launch of one or two programs runs on one or two of the
GPU's SMs (132 on an H100/H200), where its loads wait on memory one after another. Needs a CUDA build of torch (a CPU-only wheel cannot
make CUDA tensors, even fake ones): on this repository's machines the device image's, from
``bash benchmarks/gpu_session.sh image``:

    PYTHONPATH=$PWD /tmp/kvslim-image-venv/bin/python benchmarks/decode_launches.py
    PYTHONPATH=$PWD:$PWD/.venv/fla /tmp/kvslim-image-venv/bin/python benchmarks/decode_launches.py --weights q4_0

``--compile`` (with ``--weights``) also compiles each distinct launch of the step for sm_90, as
Triton's JIT would specialize it (``specialization``), one after another into an empty cache,
and times each: what a lease's first step of a pair waits before its first launch.

A figure, not a test.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch._library.custom_ops import OPDEFS
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

if __name__ == "__main__" and not torch.backends.cuda.is_built():     # before kvslim's imports: a fast refusal
    sys.exit("this torch has no CUDA support built in (a CPU-only wheel): run it with a CUDA build, "
             "such as `bash benchmarks/gpu_session.sh image`'s venv")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_model import random_model, shrunk_config  # noqa: E402
from kvslim.cache import CacheConfig, KVCache, RecurrentStateCache  # noqa: E402
from kvslim.models import DecodeBatch, build, config_from_dict  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

# ops that make no kernel: views, allocations, metadata
VIEWS = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "permute", "transpose", "t",
         "expand", "split", "split_with_sizes", "alias", "detach", "unbind", "reshape", "empty", "empty_strided",
         "chunk", "narrow", "lift_fresh", "device", "empty_like"}


class Launches(TorchDispatchMode):
    """Counts the aten ops that launch a kernel, composite ops by the ops they run."""

    def __init__(self, where: str | None = None):
        super().__init__()
        self.ops, self.where, self.sites = Counter(), where, Counter()
        self.shapes = {}            # triton::<kernel> -> Counter of (programs, warps) a launch
        self.compiles = {}          # specialization(...)'s key -> (kernel, constexprs): a device's compiles

    def clear(self) -> None:
        self.ops.clear(), self.sites.clear(), self.shapes.clear(), self.compiles.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "rms_norm":                      # CUDA: one _fused_rms_norm (its composite, under a mode, is not)
            self.ops["_fused_rms_norm"] += 1
            return func(*args, **kwargs)
        opdef = OPDEFS.get(func.name().split(".")[0]) if func.namespace == "kvslim" else None
        if opdef is not None:                       # kvslim's own ops (paged_decode): what their body runs
            with self:
                return opdef._init_fn(*args, **kwargs)
        if func.namespace == "aten" and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if name not in VIEWS:
            self.ops[f"{func.namespace}::{name}"] += 1
            if name == self.where:
                self.sites[_caller()] += 1
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost kvslim line on the stack: where a counted op comes from."""
    frames = [f for f in traceback.extract_stack() if "/kvslim/" in f.filename]
    return f"{frames[-1].filename.split('/kvslim/')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"


def count_kernels(launches: Launches) -> None:
    """Count each Triton (and fla-core) kernel launch as ``triton::<kernel>`` instead of running
    it: a fake tensor has no memory for a kernel to read, and its outputs, allocated by the
    launching code, already have their shapes. Autotuned kernels count once, untimed."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def launch(fn, *args, grid=None, **kwargs):
        name = f"triton::{fn.fn.__name__ if isinstance(fn, Autotuner) else fn.__name__}"
        launches.ops[name] += 1
        if not isinstance(fn, Autotuner):       # an autotuner's grid and warps wait on its timed choice
            launches.shapes.setdefault(name, Counter())[programs(grid, kwargs), kwargs.get("num_warps", 4)] += 1
            key, constexprs = specialization(fn, args, kwargs)
            launches.compiles.setdefault(key, (fn, constexprs))
    JITFunction.run = Autotuner.run = launch
    torch.cuda._exchange_device = torch.cuda._maybe_exchange_device = lambda index: 0   # fla's device guard


POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.uint8: "*u8",
                 torch.int8: "*i8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}


def specialization(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What Triton's JIT compiles a launch of ``fn`` for, as far as a fake tensor shows it: each
    constexpr's value, each tensor's pointer type and whether it starts 16 bytes in (from its
    storage offset: a fake tensor has no address), each int as 1 (a constant to the JIT), a
    multiple of 16, or neither (i64 past 32 bits), and the launch options (warps, stages, fusion).
    -> (a hashable key, one a compile a device would make; the constexprs' values)."""
    bound = dict(zip(fn.arg_names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in fn.arg_names)
    spec, constexprs = [], {}
    for param in fn.params:
        value = bound.get(param.name, param.default if param.has_default else None)
        if param.is_constexpr or value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                   and value == 1):
            constexprs[param.name] = value
            spec.append((param.name, "constexpr", repr(value)))
        elif isinstance(value, torch.Tensor):
            spec.append((param.name, POINTER_TYPES[value.dtype], value.storage_offset() * value.element_size() % 16 == 0))
        elif isinstance(value, bool):
            spec.append((param.name, "i1", value))
        elif isinstance(value, int):
            spec.append((param.name, "i64" if not -2**31 <= value < 2**31 else "d16" if value % 16 == 0 else "i32", None))
        else:
            spec.append((param.name, "fp32", None))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in fn.arg_names))
    return (fn.__name__, tuple(spec), options), constexprs


def compile_all(compiles: dict) -> list[tuple[str, float]]:
    """Compile each distinct launch for sm_90 (``kvslim.gpu.compile_sm90``: Triton's compiler and
    its ptxas, one after another, as a process's first launches are) into an empty cache:
    [(kernel, seconds)]. What a lease's first run of a step spends before its first launch."""
    import tempfile
    import time
    from kvslim.gpu import compile_sm90
    out, before = [], os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            for (name, spec, options), (fn, constexprs) in compiles.items():
                types = {n: kind for n, kind, _ in spec if kind not in ("constexpr", "d16", "i32")}
                divisible = tuple(n for n, kind, _ in spec if kind == "d16")
                start = time.perf_counter()
                compile_sm90(fn, types, constexprs, divisible, **dict(options))
                out.append((name, time.perf_counter() - start))
        finally:                                # the process's own cache again (a test's worker goes on)
            if before is None:
                del os.environ["TRITON_CACHE_DIR"]
            else:
                os.environ["TRITON_CACHE_DIR"] = before
    return out


def print_compiles(timed: list[tuple[str, float]]) -> None:
    """Each kernel's distinct compiles and their seconds, one after another on one core."""
    by = {}
    for name, seconds in timed:
        by.setdefault(name, []).append(seconds)
    total = sum(s for _, s in timed)
    print(f"\n{len(timed)} distinct compiles for sm_90, {total:.1f} s one after another on one core "
          f"(a first step's wait before its launches; a Triton cache on disk keeps them for later processes)\n")
    print(markdown_table(["kernel", "compiles", "seconds", "seconds each"],
                         [[name, len(t), f"{sum(t):.1f}", f"{min(t):.2f}-{max(t):.2f}"]
                          for name, t in sorted(by.items(), key=lambda kv: -sum(kv[1]))], ["l", "r", "r", "r"]))


def programs(grid, meta: dict) -> int:
    """The programs a launch's grid makes: a tuple of up to three sizes, or a function of the
    launch's constexprs that returns one."""
    grid = grid(meta) if callable(grid) else grid
    n = 1
    for size in grid:
        n *= int(size)
    return n


def spread(shapes: Counter | None) -> tuple[str, str]:
    """(programs a launch, warps a program) of a kernel's launches, as ranges where they vary."""
    if not shapes:
        return "", ""

    def span(values):
        return f"{min(values):,}" if min(values) == max(values) else f"{min(values):,}-{max(values):,}"
    return span([p for p, _ in shapes]), span([w for _, w in shapes])


def fill(cache, depth: int) -> None:
    """Every slot holds ``depth`` tokens before the step: K/V rows (fake: shapes only) through each
    attention layer's unchecked store (a checked append would read its flags on the host, which
    a fake tensor cannot), the DeltaNet layers' lengths advanced to match."""
    for layer in cache:
        for slot in range(cache.n_slots):
            if isinstance(layer, KVCache):
                shape = (depth, layer.n_kv_heads, layer.head_dim)
                layer.store(slot, torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
            elif isinstance(layer, RecurrentStateCache):
                layer.advance(slot, depth)


def declare_formats(kv: str, head_dim: int) -> None:
    """Build the K/V formats' kernel declarations (codebooks, row layouts) before the fake mode: a
    real run builds them once on the host at its first step and caches them, but built inside
    the fake mode their tables would be fake tensors, which ``.tolist()`` cannot read."""
    from kvslim import formats
    from kvslim.gpu import kv_append, paged_prefill
    for name, role in zip(kv.split("/"), ("k", "v")):
        fmt = formats.get(name, role=role)
        if paged_prefill._fields(fmt, head_dim) is not None:
            paged_prefill._codec_args(fmt, head_dim, role.upper())
        kv_append._declared(name, role, head_dim)


def count(config, n_slots: int, where: str | None = None, weights: str | None = None,
          kv: str = "f16/f16", depth: int = 0) -> Launches:
    """The launches of the second of two decode steps (the first moves constants to the device).
    ``weights``: a block type for the matrices (gpu_model.py's layout) and the GPU kernels on
    (``kvslim.gpu.TRITON``), as gpu_model.py's end-to-end runs; None: float weights, torch paths.
    ``depth``: tokens each sequence holds before the steps (past 512, decode attention's key
    splits are merged)."""
    import kvslim.cache.config as cache_config
    from kvslim import gpu
    from kvslim.models import base
    cache_config.available_memory = lambda device: 1 << 50      # nothing to ask a fake device
    base.check_room = lambda *args: None
    gpu.TRITON = weights is not None
    launches = Launches(where)
    if weights:
        count_kernels(launches)
    declare_formats(kv, config.head_dim)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"):
        # built outside inference mode, as a loaded model is (its weights keep version counters)
        if weights:
            model = random_model(config, weights, "cuda", values=False)
        else:
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = build(config)
            finally:
                torch.set_default_dtype(torch.float32)
        cache = model.make_cache(CacheConfig(depth + 64, n_slots, *kv.split("/"), device="cuda"))
        if depth:
            fill(cache, depth)
        slots = list(range(n_slots))
        for step in range(2):
            cache.prepare_decode(slots, [depth + step] * n_slots)
            inputs = [torch.full((n_slots,), v, dtype=torch.long) for v in (5, depth + step)] + [torch.arange(n_slots)]
            launches.clear()
            with launches, torch.inference_mode():               # the step, as an engine runs it
                model.run(DecodeBatch(*inputs, cache.decode_pages([depth + step] * n_slots)), cache)
            cache.commit_decode(slots)
    return launches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="a `kvslim plan` catalog name")
    ap.add_argument("--shrink", type=int, default=1,
                    help="divide the widths (the GEMVs' split sums depend on them: 1 counts the real model's)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("-np", "--parallel", type=int, default=1, help="sequences in the step")
    ap.add_argument("--top", type=int, default=25, help="ops listed")
    ap.add_argument("--where", default=None, metavar="OP", help="list the kvslim lines that launch OP (e.g. _to_copy)")
    ap.add_argument("--weights", default=None, metavar="TYPE",
                    help="block-type matrices and the GPU kernels on, as gpu_model.py's runs (e.g. q4_0); "
                         "default: float weights, the torch paths")
    ap.add_argument("-d", "--depth", type=int, default=0, help="tokens each sequence holds before the step")
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("--compile", action="store_true",
                    help="with --weights: compile each distinct kernel launch of the step for sm_90 and time it")
    args = ap.parse_args(argv)
    if args.compile and not args.weights:
        ap.error("--compile times the kernels' compiles: give --weights (the kernels on)")
    # no device to name for its tuned decode launches (gpu.tuned would ask CUDA): the defaults', or
    # a file's given by path in KVSLIM_DECODE_TUNED
    os.environ.setdefault("KVSLIM_DECODE_TUNED", "0")
    config = config_from_dict(shrunk_config(args.model, args.shrink, args.layers))
    launches = count(config, args.parallel, args.where, args.weights, f"{args.cache_type_k}/{args.cache_type_v}",
                     args.depth)
    ops = launches.ops
    paths = f"{args.weights} weights, kernels on" if args.weights else "float weights, torch paths"
    kinds = Counter(config.layer_types) if getattr(config, "layer_types", None) else {"layers": config.num_hidden_layers}
    print(f"{args.model}: {config.num_hidden_layers} layers ({', '.join(f'{n} {k}' for k, n in kinds.items())}), "
          f"-np {args.parallel}, depth {args.depth}, {paths}, bf16: {sum(ops.values())} launches a decode step\n")
    print(markdown_table(["op", "launches", "programs a launch", "warps a program"],
                         [[k, v, *spread(launches.shapes.get(k))] for k, v in ops.most_common(args.top)],
                         ["l", "r", "r", "r"]))
    if args.compile:
        print_compiles(compile_all(launches.compiles))
    if args.where:
        print(f"\n{args.where}, by kvslim line:\n")
        print(markdown_table(["line", "launches"], [[k, v] for k, v in launches.sites.most_common(args.top)],
                             ["l", "r"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
