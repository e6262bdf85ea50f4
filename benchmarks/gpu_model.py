"""A catalog model's real shape with random quantized weights, end to end on a GPU (issue 18).

    python benchmarks/gpu_model.py [--model qwen3.6-35b-a3b] [--weights q4_0] [-d 0,32768,131072]
        [-np 1,4] [--pairs f16/f16,q8_0/turbo4,turbo3/turbo3] [-p 4096] [-n 32] [--device cuda]
        [--no-cuda-graphs] [--attn-backend torch|bf16]
    python benchmarks/gpu_model.py --device cpu --shrink 8 --layers 4 -d 0,256 -p 256 -n 4 --eager   # a dry run

The config is the planner's catalog entry (config.json values: dims, layer pattern, experts),
built by kvslim's own model code; the weights are made on the device, never read from disk:
each matrix's rows are drawn from a pool of blocks that the weight type's own encoder made
from N(0, 0.02) values, so every block is a valid block of that type (output matrix q6_k,
every other matrix ``--weights``, vectors and routers bf16, as llama-quantize lays out a
q4_0 file and as the planner counts it). Then, per K/V pair and -np:

- memory: bytes the device holds for the weights, for the cache (pools and DeltaNet states,
  preallocated for the whole context) and the peak during the runs, beside ``kvslim plan``'s
  prediction for the same settings (weights, KV + state, compute);
- pp: prefill tok/s of a ``-p`` token prompt at depth 0 (ubatches of 512);
- tg @ dN: decode tok/s of ``-n`` steps for every slot at once after each slot holds N tokens,
  beside (one slot) the planner's ceiling for it: the bytes a step reads (active weights, the
  KV at that depth, the DeltaNet state) over the device-to-device copy speed measured first.
  The depth is written straight into the cache (random K/V rows through the cache's own
  append, DeltaNet lengths advanced): decode reads the same bytes whatever their values, and
  prefilling 128K tokens per slot would take most of a GPU lease.

Figures, not a test; the parity tests are tests/test_triton_*.py and tests/test_models.py.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import check_lists, copy_gbps  # noqa: E402  (same folder)
import kvslim.gpu  # noqa: E402
from kvslim import formats  # noqa: E402
from kvslim import weights as W  # noqa: E402
from kvslim.cache import CacheConfig, KVCache, RecurrentStateCache  # noqa: E402
from kvslim.cache.backends import backend_names  # noqa: E402
from kvslim.devices import synchronize  # noqa: E402
from kvslim.gpu import delta_step as gpu_delta_step  # noqa: E402
from kvslim.gpu import moe as gpu_moe  # noqa: E402
from kvslim.gpu import paged_decode as gpu_paged_decode  # noqa: E402
from kvslim.gpu import tuned as gpu_tuned  # noqa: E402
from kvslim.gpu import quant_matmul as gpu_weights  # noqa: E402
from kvslim.engine.decode_step import DecodeStep  # noqa: E402
from kvslim.loading.instantiate import instantiate, quantizable  # noqa: E402
from kvslim.models import Batch, build_on_meta, config_from_dict  # noqa: E402
from kvslim.plan import catalog  # noqa: E402
from kvslim.plan.fit import Request, breakdown, decode_ceiling  # noqa: E402
from kvslim.plan.targets import Target  # noqa: E402
from kvslim.plan.model import Model  # noqa: E402
from kvslim.plan.weight_size import fit_type  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402
from kvslim.weights.modules import weight_bytes  # noqa: E402

POOL_BLOCKS = 4096          # distinct encoded blocks each matrix's rows are drawn from
OUTPUT_TYPE = "q6_k"        # llama-quantize's type for the output matrix of a q4_0 / q4_k_m file


def shrunk_config(name: str, shrink: int, layers: int | None) -> dict:
    """The catalog's config.json dict; ``shrink`` divides the widths (hidden, experts, vocab,
    feed-forward) and ``layers`` keeps the first N layers, for a dry run on a small machine.
    Head counts and head dims stay: they decide the kernels and the formats' layouts."""
    config = dict(catalog.model(name).config)
    if shrink > 1:
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "vocab_size"):
            if key in config:
                config[key] = max(64, config[key] // shrink // 64 * 64)
        if "num_experts" in config:
            config["num_experts"] = max(2 * config["num_experts_per_tok"], config["num_experts"] // shrink)
    if layers:
        config["num_hidden_layers"] = layers
        config.pop("layer_types", None)
    return config


def block_pool(wtype: W.WeightType, device, gen: torch.Generator) -> torch.Tensor:
    """POOL_BLOCKS valid blocks: the type's encoder on N(0, 0.02) values, or for the K-quants
    (kvslim decodes them, it does not encode them) random codes and sub-scales under small f16
    super-scales, which any bytes but a non-finite f16 make a valid block."""
    if wtype.can_encode:
        return wtype.encode(torch.randn(POOL_BLOCKS, wtype.block_size, device=device, generator=gen) * 0.02)
    blocks = torch.randint(256, (POOL_BLOCKS, wtype.block_bytes), device=device, generator=gen, dtype=torch.uint8)
    for name, view in wtype.split(blocks).items():
        if name in ("d", "dmin"):
            view.copy_(torch.full((POOL_BLOCKS, 1), 2e-4, dtype=torch.float16, device=device).view(torch.uint8))
    return blocks


def random_blocks(wtype: W.WeightType, shape: tuple[int, ...], device, gen: torch.Generator) -> W.QuantTensor:
    """A QuantTensor of ``shape`` (..., rows, cols) whose blocks are valid ``wtype`` blocks."""
    pool = block_pool(wtype, device, gen)
    n_blocks = torch.Size(shape).numel() // wtype.block_size
    pick = torch.randint(POOL_BLOCKS, (n_blocks,), device=device, generator=gen)
    data = pool.index_select(0, pick).reshape(*shape[:-1], -1)
    return W.QuantTensor(data, wtype, shape[-1])


def random_model(config, weights: str, device, seed: int = 0, values: bool = True):
    """kvslim's model for ``config`` with random weights made on ``device``. ``values`` False:
    zero bytes and vectors of the same types and shapes, made without a random generator (which
    a fake device has not: benchmarks/decode_launches.py)."""
    gen = torch.Generator(device=device).manual_seed(seed) if values else None
    meta = build_on_meta(config)
    matrices = quantizable(meta)
    state = {}
    for name, p in meta.named_parameters():
        kind = fit_type(OUTPUT_TYPE if name == "lm_head.weight" else weights, p.shape[-1])   # the planner's fallback
        if name in matrices and kind != "f16":
            wtype, shape = W.get(kind), tuple(p.shape)
            state[name] = (random_blocks(wtype, shape, device, gen) if values else
                           W.QuantTensor(torch.zeros(*shape[:-1], shape[-1] // wtype.block_size * wtype.block_bytes,
                                                     dtype=torch.uint8, device=device), wtype, shape[-1]))
        elif values:                                          # norms, routers, conv kernels, decay rates
            state[name] = torch.randn(p.shape, device=device, generator=gen, dtype=torch.float32) * 0.02
        else:
            state[name] = torch.zeros(p.shape, device=device, dtype=torch.float32)
    return instantiate(config, state, dtype=torch.bfloat16, device=device)


def fill_to(cache, depth: int, device, gen: torch.Generator) -> None:
    """Every slot holds ``depth`` tokens: random K/V rows through each attention layer's checked
    append, and the DeltaNet layers' lengths advanced to match (their states stay as they are)."""
    for layer in cache:
        for slot in range(cache.n_slots):
            if isinstance(layer, KVCache):
                for start in range(0, depth, 4096):
                    t = min(4096, depth - start)
                    shape = (t, layer.n_kv_heads, layer.head_dim)
                    k, v = (torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16) for _ in "kv")
                    layer.append(slot, k, v)
            elif isinstance(layer, RecurrentStateCache):
                layer.advance(slot, depth)


def time_prefill(model, cache, n_prompt: int, vocab: int, device) -> float:
    """Tokens/s of an ``n_prompt`` prompt into slot 0 from depth 0, in ubatches of 512, after one
    untimed ubatch (the first pair's kernels compile on first use: session 30's lease read f16's
    pp4096 at 55.7 t/s, q8_0/turbo4's, timed second, at 459.5)."""
    tokens = torch.randint(vocab, (n_prompt,)).tolist()
    model(Batch.build([(0, tokens[:512], 0)], device=device), cache)
    synchronize(device)
    cache.clear(0)
    t0 = time.perf_counter()
    for start in range(0, n_prompt, 512):
        model(Batch.build([(0, tokens[start:start + 512], start)], device=device), cache)
    synchronize(device)
    return n_prompt / (time.perf_counter() - t0)


def time_decode(step: DecodeStep, n_slots: int, depth: int, n_gen: int, vocab: int, device) -> float:
    """Tokens/s summed over the slots: ``n_gen`` steps, each one token for every slot."""
    slots = list(range(n_slots))
    step(slots, [1] * n_slots, [depth] * n_slots)                      # warm-up (first launches)
    synchronize(device)
    t0 = time.perf_counter()
    for i in range(1, n_gen + 1):
        step(slots, torch.randint(vocab, (n_slots,)).tolist(), [depth + i] * n_slots)
    synchronize(device)
    return n_slots * n_gen / (time.perf_counter() - t0)


def _profiler(device):
    """torch's profiler over the host and, on a GPU, the device."""
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda(device) else []))


def _top_ops(prof, device, rows: int) -> str:
    key = "self_cuda_time_total" if on_cuda(device) else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def profile_prefill(model, cache, vocab: int, args, pair: str) -> None:
    """One prompt chunk (an ubatch: 512 tokens, or -p if fewer) into slot 0 under torch's
    profiler, after one unprofiled (the kernels' compiles); the slot is cleared after each."""
    tokens = torch.randint(vocab, (min(512, args.n_prompt),)).tolist()
    chunk = Batch.build([(0, tokens, 0)], device=args.device)
    model(chunk, cache)
    synchronize(args.device)
    cache.clear(0)
    with _profiler(args.device) as prof:
        model(chunk, cache)
        synchronize(args.device)
    cache.clear(0)
    print(f"{pair}: one {len(tokens)}-token prompt chunk profiled")
    print(_top_ops(prof, args.device, args.profile_rows), flush=True)


def profile_decode(step: DecodeStep, depth: int, vocab: int, args, pair: str, cache, mark) -> None:
    """A few one-slot decode steps under torch's profiler: the ops and kernels that take the
    step's time, by device time on a GPU (with CUDA graphs the replayed kernels are what it
    sees), by CPU time on the CPU's dry run. Slot 0 goes back to ``depth`` (its checkpoint ``mark``)
    after each run."""
    time_decode(step, 1, depth, 2, vocab, args.device)                 # graphs captured, kernels compiled
    cache.rewind(0, depth, mark)
    with _profiler(args.device) as prof:
        tps = time_decode(step, 1, depth, args.profile, vocab, args.device)
    cache.rewind(0, depth, mark)
    print(f"{pair}, one slot at depth {depth}: {args.profile + 1} decode steps profiled (step: {step.path})")
    print(_top_ops(prof, args.device, args.profile_rows), flush=True)
    if on_cuda(args.device):
        print(device_busy(prof.key_averages(), args.profile + 1, 1e3 / tps), flush=True)


def device_busy(events, steps: int, wall_ms: float) -> str:
    """What the profile says of a step's time: the GPU's kernels' summed time a step against the
    step's wall time (under the profiler: its ``time_decode``), and kernels a step. Where the
    kernels' time is much less than the wall's, the GPU waits between them (launch gaps, the
    host); where it is close, the kernels themselves take the time."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    launches = sum(e.count for e in kernels) / steps
    return (f"kernels: {busy_ms:.3f} ms a step of {wall_ms:.3f} ms wall ({busy_ms / wall_ms:.0%} busy), "
            f"{launches:.0f} kernels a step, {1e3 * busy_ms / max(launches, 1):.1f} us each on average")


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def allocated(device) -> int:
    """Bytes torch's allocator holds on a GPU (0 elsewhere: the CPU dry run counts tensors instead)."""
    return torch.cuda.memory_allocated(device) if on_cuda(device) else 0


class Stages:
    """Seconds each stage of one pair's run took, synchronized: a lease's end-to-end call has spent
    ~65 s a pair where its timed steps take well under one, and a decode step's compiles ~10 s on
    one core (decode_launches.py --compile), so this line says where the rest goes."""

    def __init__(self, device):
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def line(self, label: str, n_slots: int, timed: float) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.seconds.items())
        return (f"{label} -np {n_slots}: {sum(self.seconds.values()):.1f} s ({parts}; of decode, "
                f"{timed:.1f} s timed steps, the rest warm-ups, compiles and graph captures)")


def run_pair(model, config, plan_model, pair: str, n_slots: int, args, gen, bandwidth: float, speed: list,
             label: str | None = None) -> list:
    """One K/V pair at one -np: the speed rows, appended to ``speed`` as they are measured (a
    failure later keeps them), and the memory row, returned; rows named ``label`` (default: the pair)."""
    type_k, type_v = pair.split("/")
    pair = label or pair
    depths = [int(d) for d in args.depths.split(",")]
    ctx = max(max(depths) + args.n_gen + 2, args.n_prompt)            # tokens per slot
    before = allocated(args.device)
    if on_cuda(args.device):
        torch.cuda.reset_peak_memory_stats(args.device)
    stage, timed = Stages(args.device), 0.0
    with stage("cache"):
        cache = model.make_cache(CacheConfig(ctx, n_slots, type_k, type_v, device=args.device,
                                             backend=args.attn_backend))
    held = allocated(args.device) - before if on_cuda(args.device) else cache.reserved_kv_bytes + cache.state_bytes
    if n_slots == 1:
        with stage("prefill"):
            if args.profile:
                profile_prefill(model, cache, config.vocab_size, args, pair)
            pp = time_prefill(model, cache, args.n_prompt, config.vocab_size, args.device)
        speed.append([pair, n_slots, f"pp{args.n_prompt}", f"{pp:.1f}", "", "eager"])
        cache.clear(0)
    step = DecodeStep(model, cache, compile=False, native=not args.eager, cuda_graphs=args.cuda_graphs)
    filled = 0
    for depth in depths:
        with stage("fill"):
            fill_to(cache, depth - filled, args.device, gen)
        filled = depth
        marks = [cache.checkpoint(slot) for slot in range(n_slots)]
        if args.profile and n_slots == 1 and depth == depths[0]:
            with stage("profile"):
                profile_decode(step, depth, config.vocab_size, args, pair, cache, marks[0])
        with stage("decode"):
            tps = time_decode(step, n_slots, depth, args.n_gen, config.vocab_size, args.device)
        timed += n_slots * args.n_gen / tps
        request = Request(ctx, 1, type_k, type_v, weight_quant=args.weights, depth=depth)
        ceiling = "" if n_slots > 1 else f"{decode_ceiling(plan_model, request, Target('measured', 1 << 50, bandwidth)):.0f}"
        speed.append([pair, n_slots, f"tg{args.n_gen} @ d{depth}", f"{tps:.1f}", ceiling, step.path])
        for slot in range(n_slots):                                  # back to the filled depth
            cache.rewind(slot, depth, marks[slot])
    peak = (torch.cuda.max_memory_allocated(args.device) - before - held) if on_cuda(args.device) else 0
    plan = breakdown(plan_model, Request(ctx * n_slots, n_slots, type_k, type_v, weight_quant=args.weights))
    memory = [pair, n_slots, ctx, mib(held), mib(plan.kv + plan.state), pct(held, plan.kv + plan.state),
              mib(peak), mib(plan.compute)]
    del step, cache
    if on_cuda(args.device):
        torch.cuda.empty_cache()
    print(stage.line(pair, n_slots, timed), flush=True)
    return memory


def failed(pair: str, n_slots: int, exc: Exception, device) -> list:
    """A pair that failed at one -np (a kernel that does not compile for it, a check that refuses
    it): its traceback to stderr, a row that says so, the memory it held given back; the other
    pairs still run (a CUDA error that poisons the context fails them too, and says so)."""
    traceback.print_exc()
    if on_cuda(device):
        gc.collect()
        torch.cuda.empty_cache()
    return [pair, n_slots, "failed", "", "", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"]


def decode_launch(config, pair: str, args) -> str:
    """What the decode steps' attention launches for a pair with the kernels on: a tuned file's
    entry (``gpu.tuned``: KVSLIM_DECODE_TUNED, or the device's packaged file), the backend's
    default, or decode by warps (the switch)."""
    if not kvslim.gpu.TRITON:
        return "the torch block loop (the kernels are off: KVSLIM_TRITON=1 turns them on)"
    fmt_k, fmt_v = (formats.get(name, role=role) for name, role in zip(pair.split("/"), "kv"))
    rows = config.num_attention_heads // config.num_key_value_heads
    backend = "bf16" if args.attn_backend == "bf16" else "f32"
    tune, split = gpu_paged_decode.step_launch(fmt_k, fmt_v, config.head_dim, rows, backend, torch.device(args.device))
    default = (tune, split) == (gpu_tuned.BACKENDS[backend], gpu_paged_decode.SPLIT_KEYS)
    source = ("decode by warps (the switch)" if gpu_paged_decode.DECODE_BY_WARPS and tune == {"KERNEL": "warps"}
              else f"the {backend} backend's default" if default else "tuned")
    return f"{source}: {tune}, {split} keys a split"


def run_variant(model, config, plan_model, pair: str, label: str, args, gen, bandwidth: float, speed: list,
                memory: list) -> None:
    """Every -np of one pair, its rows named ``label``, under the switches set now: speed rows
    printed as they come and added to ``speed``, memory rows to ``memory``; a failure becomes a
    row, and the next -np still runs (a lease's call is not lost to one)."""
    for n_slots in (int(n) for n in args.parallel.split(",")):
        rows = []
        try:
            memory.append(run_pair(model, config, plan_model, pair, n_slots, args, gen, bandwidth, rows, label))
        except Exception as exc:                    # noqa: BLE001
            rows.append(failed(label, n_slots, exc, args.device))
        speed += rows
        print("\n".join(" | ".join(map(str, r)) for r in rows), flush=True)


def ab_table(speed: list, pairs: str, names: list[str]) -> list[list]:
    """--ab's rows side by side: per pair, -np and test, each variant's median t/s over the rounds
    (the rounds' count beside it where more than one), then each later variant's median over the
    first variant's."""
    by = {}
    for label, n_slots, test, tps, *_ in speed:
        if test != "failed":
            by.setdefault((label, n_slots, test), []).append(float(tps))
    rows = []
    for pair in pairs.split(","):
        keys = dict.fromkeys((n, t) for (label, n, t) in by if label.startswith(pair + " "))
        for n_slots, test in keys:
            got = [by.get((f"{pair} {name}", n_slots, test), []) for name in names]
            medians = [statistics.median(g) if g else None for g in got]
            cells = [f"{m:.1f}" + (f" ({len(g)})" if len(g) > 1 else "") if m else "" for m, g in zip(medians, got)]
            ratios = [f"{m / medians[0]:.3f}" if m and medians[0] else "" for m in medians[1:]]
            rows.append([pair, n_slots, test, *cells, *ratios])
    return rows


@contextlib.contextmanager
def switched(names: list[str]):
    """The named launch switches (``SWITCHES``) on for the block, then as they were."""
    held = [(SWITCHES[n], getattr(*SWITCHES[n])) for n in names]
    for (module, attr), _ in held:
        setattr(module, attr, True)
    try:
        yield
    finally:
        for (module, attr), value in held:
            setattr(module, attr, value)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def pct(measured: int, predicted: int) -> str:
    return f"{100 * (measured - predicted) / predicted:+.1f}%" if predicted else ""


# Launch switches an --ab run sets in turn, each a module global read when a launch is made: name ->
# (module, attribute). Each variant's decode steps are new CUDA graphs of its own launches.
SWITCHES = {"pdl": (kvslim.gpu, "PDL"), "l2-prefetch": (kvslim.gpu, "L2_PREFETCH"),
            "q8-activations": (gpu_weights, "Q8_ACTIVATIONS"), "decode-warps": (gpu_paged_decode, "DECODE_BY_WARPS")}


def variants(text: str) -> list[tuple[str, list[str]]]:
    """--ab's variants: "plain,pdl,pdl+l2-prefetch" -> [(name, its switches)]; ValueError naming an unknown one."""
    out = []
    for name in text.split(","):
        switches = [] if name == "plain" else name.split("+")
        unknown = [s for s in switches if s not in SWITCHES]
        if unknown or not name:
            raise ValueError(f"{name!r}: plain, or switches joined by + from {', '.join(SWITCHES)}")
        out.append((name, switches))
    return out


def parse(argv=None) -> argparse.Namespace:
    """The command line, checked before a model is made (a lease's flag typo exits here, and
    tests/test_gpu_session.py parses every command a lease runs this way)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="a `kvslim plan` catalog name")
    ap.add_argument("--weights", default="q4_0", help="type of every matrix but the output (q6_k)")
    ap.add_argument("-d", "--depths", default="0,32768,131072")
    ap.add_argument("-np", "--parallel", default="1,4")
    ap.add_argument("--pairs", default="f16/f16,q8_0/turbo4,turbo3/turbo3")
    ap.add_argument("-p", "--n-prompt", type=int, default=4096)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shrink", type=int, default=1, help="divide the widths (a dry run)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (a dry run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="decode steps replayed from CUDA graphs (on a CUDA device; --no-cuda-graphs: eager launches)")
    ap.add_argument("--eager", action="store_true",
                    help="decode through the torch step even on the CPU (the path a GPU takes; dry runs)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile one prompt chunk (512 tokens) and N one-slot decode steps at the first depth of "
                         "each pair, and print the top ops")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--attn-backend", default="torch", choices=backend_names(),
                    help="the attention backend (bf16: the GPU kernels' products in f16, as kvslim serve runs)")
    ap.add_argument("--swiglu-in-gemv", action=argparse.BooleanOptionalAction, default=True,
                    help="SwiGLU inside the quantized GEMVs' launches (quant_matmul.SWIGLU_IN_GEMV; --no-...: "
                         "the GEMV, then silu_mul), to time both")
    ap.add_argument("--sums-in-gemv", action=argparse.BooleanOptionalAction, default=True,
                    help="the last-program folds: a split GEMV's partials and a mixture's combine summed by the "
                         "GEMV's last programs (quant_matmul.SUMS_IN_GEMV), the DeltaNet norm by the step's "
                         "(delta_step.NORM_IN_STEP) with the conv in the step (CONV_IN_STEP), the router's top-k "
                         "by the router GEMV's (moe.ROUTER_GEMV), the mixers' residual add-norms by their output "
                         "GEMVs' (quant_matmul.ADD_NORM_IN_GEMV), "
                         "and with them the shared expert among the routed pairs; "
                         "--no-...: launches of their own, to time both")
    ap.add_argument("--shared-as-pair", action=argparse.BooleanOptionalAction, default=True,
                    help="a mixture's shared expert as one more pair a token in the routed experts' two GEMVs "
                         "(quant_matmul.SHARED_AS_PAIR; --no-...: its own two GEMVs), to time both")
    ap.add_argument("--q8-activations", action="store_true",
                    help="decode's 1-row Q4_0, Q4_K and Q6_K GEMVs on x rounded to 8 bits, products by dp4a "
                         "(quant_matmul.Q8_ACTIVATIONS; off by default), to time both")
    ap.add_argument("--decode-warps", action="store_true",
                    help="decode attention by warps where it reads the pair (paged_decode.DECODE_BY_WARPS; off by "
                         "default), to time both")
    ap.add_argument("--pdl", action="store_true",
                    help="programmatic dependent launch for the Triton kernels on compute capability 9+ "
                         "(kvslim.gpu.PDL; off by default): each waits for the one before, which let it launch "
                         "early, to time both")
    ap.add_argument("--l2-prefetch", action="store_true",
                    help="the decode GEMVs' weights asked of L2 when a program starts (kvslim.gpu.L2_PREFETCH; off "
                         "by default; with --pdl, before the wait), to time both")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --ab: the variants timed in turn this many times (profiles in the first), then "
                         "each variant's median")
    ap.add_argument("--ab", default=None, metavar="VARIANTS",
                    help="time each pair once per variant in this run, the model made once: comma-separated, each "
                         "plain or switches joined by + (" + ", ".join(SWITCHES) + "), set on top of the flags given")
    args = ap.parse_args(argv)
    if args.rounds < 1 or (args.rounds > 1 and not args.ab):
        ap.error(f"--rounds {args.rounds}: a positive count, and more than 1 only with --ab")
    try:
        args.variants = variants(args.ab) if args.ab else [(None, [])]     # (None: no --ab, the rows named by pair)
    except ValueError as exc:
        ap.error(f"--ab {args.ab}: {exc}")
    if args.weights not in catalog.WEIGHT_QUANTS or catalog.WEIGHT_QUANTS[args.weights].base != args.weights:
        ap.error(f"--weights {args.weights}: expected a plain block type the planner knows (q4_0, q8_0, ...)")
    check_lists(ap, {"-d": args.depths, "-np": args.parallel}, ("--pairs", args.pairs))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    for name, (module, attr) in SWITCHES.items():                # --pdl & co., or their environment variables
        setattr(module, attr, getattr(module, attr) or getattr(args, name.replace("-", "_")))
    gpu_weights.SWIGLU_IN_GEMV = args.swiglu_in_gemv
    gpu_weights.SUMS_IN_GEMV = args.sums_in_gemv
    gpu_weights.SHARED_AS_PAIR = args.shared_as_pair              # (needs the sums in the GEMVs)
    gpu_delta_step.NORM_IN_STEP = args.sums_in_gemv          # the DeltaNet step's last-program norm too,
    gpu_delta_step.CONV_IN_STEP = args.sums_in_gemv          # its conv (the q/k state shifted by the last)
    gpu_moe.ROUTER_GEMV = args.sums_in_gemv                   # and the router's top-k by its last programs,
    gpu_weights.ADD_NORM_IN_GEMV = args.sums_in_gemv          # the mixers' add-norms by their GEMVs' last tiles
    if on_cuda(args.device) and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run it on a GPU, or dry-run with --device cpu --shrink 8 --layers 4")
    config_dict = shrunk_config(args.model, args.shrink, args.layers)
    config = config_from_dict(config_dict)
    plan_model = Model(args.model, config, "catalog")
    start = allocated(args.device)
    t0 = time.perf_counter()
    model = random_model(config, args.weights, args.device, args.seed)
    weights_held = allocated(args.device) - start if on_cuda(args.device) else weight_bytes(model)
    plan_weights = breakdown(plan_model, Request(4096, 1, weight_quant=args.weights)).weights
    name = torch.cuda.get_device_name(args.device) if on_cuda(args.device) else "cpu"
    print(f"{args.model} ({config_dict['num_hidden_layers']} layers, hidden {config_dict['hidden_size']}), "
          f"{args.weights} weights made in {time.perf_counter() - t0:.0f} s on {name}; weights held "
          f"{mib(weights_held)} MiB, plan {mib(plan_weights)} MiB ({pct(weights_held, plan_weights)}); "
          f"attention backend {args.attn_backend}, SwiGLU in the GEMVs {args.swiglu_in_gemv}, "
          f"split sums in the GEMVs {args.sums_in_gemv}, shared expert as a pair "
          f"{gpu_weights.SHARED_AS_PAIR and args.sums_in_gemv}, 8-bit activations {gpu_weights.Q8_ACTIVATIONS}, "
          f"decode by warps {gpu_paged_decode.DECODE_BY_WARPS}, programmatic dependent launch {kvslim.gpu.PDL}, "
          f"GEMV weights prefetched to L2 {kvslim.gpu.L2_PREFETCH}" + (f"; variants {args.ab}" if args.ab else "") + "\n",
          flush=True)
    bandwidth = copy_gbps(args.device, mib=1024 if on_cuda(args.device) else 64) * 1e9
    print(f"device-to-device copy {bandwidth / 1e9:.0f} GB/s (read + written): the ceilings' bandwidth\n", flush=True)
    gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    speed, memory = [], []
    quiet = argparse.Namespace(**{**vars(args), "profile": 0})
    with torch.inference_mode():
        for pair in args.pairs.split(","):
            print(f"{pair}: decode attention's launch {decode_launch(config, pair, args)}", flush=True)
            # the variants in turn, round after round (profiles in the first round)
            for round_, (name, switches) in itertools.product(range(args.rounds), args.variants):
                with switched(switches):
                    run_variant(model, config, plan_model, pair, f"{pair} {name}" if name else pair,
                                args if round_ == 0 else quiet, gen, bandwidth, speed, memory)
    print()
    print(markdown_table(["K/V", "np", "test", "t/s", "plan ceiling t/s", "step"], speed, ["l", "r", "l", "r", "r", "l"]))
    print()
    if args.ab:
        names = [name for name, _ in args.variants]
        print(markdown_table(["K/V", "np", "test", *(f"{n} t/s" for n in names), *(f"{n} / {names[0]}" for n in names[1:])],
                             ab_table(speed, args.pairs, names), ["l", "r", "l"] + ["r"] * (2 * len(names) - 1)))
        print()
    print(markdown_table(["K/V", "np", "ctx/slot", "cache MiB", "plan KV+state MiB", "vs plan", "peak extra MiB",
                          "plan compute MiB"], memory, ["l", "r", "r", "r", "r", "r", "r", "r"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
