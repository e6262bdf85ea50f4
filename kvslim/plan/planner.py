"""Will this context fit? Memory and decode-speed estimates, computed before anything loads.

Memory on one GPU = weights + KV cache + recurrent state + compute workspace:

- weights: a GGUF-style tensor list derived from the config, each tensor sized in
  the type llama-quantize gives it for the chosen mix (``catalog.WEIGHT_QUANTS``),
  or a GGUF file's real tensor bytes;
- KV cache and recurrent state: the sum of the model's own per-layer cache specs
  (``KVLayerSpec.bytes_for``, ``StateLayerSpec.bytes_per_slot``), the same
  accounting the cache allocator sizes its buffers with;
- compute: an estimate of llama.cpp's compute buffer (see ``compute_bytes``).

``-c`` is the total context, shared by the ``-np`` slots as llama-server shares
it: each slot holds up to ``c // np`` tokens, in whole pages of ``page_size``.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import formats
from ..models import config_from_dict
from ..cache import KVLayerSpec, StateLayerSpec
from ..cache.kv import DEFAULT_PAGE_SIZE
from . import catalog, quality
from .weight_bytes import WeightTensor, check_weight_quant, parameter_counts, weight_tensors, weights

DEFAULT_UBATCH = 512            # llama.cpp's -ub default: tokens per compute pass
DEFAULT_WEIGHT_QUANT = "q4_k_m"
MIN_USEFUL_CTX = 4096           # llama.cpp's default context: a suggestion should leave at least this per slot
ACTIVATION_BUFFERS = 4          # f32 activations alive at once in a layer (input, residual, two projections)


# ----- models ---------------------------------------------------------------------------------

@dataclass(eq=False)  # compared and hashed by identity, so per-model results can be cached
class Model:
    """A model to plan: its config and where it came from."""

    name: str
    config: object
    source: str                  # "catalog", "hf" (a folder with config.json) or "gguf"
    hf_id: str | None = None     # what vLLM would serve
    gguf_path: str | None = None
    gguf_bytes: int | None = None
    stored_quant: str | None = None       # a folder's weights as stored (what `kvslim run` loads)
    trained_context: int | None = None    # when shorter than the config's limit and known (the bundled model)

    @functools.cached_property
    def tensors(self) -> list["WeightTensor"]:
        return weight_tensors(self.config)


def load_model(spec: str) -> Model:
    """A catalog name, a Hugging Face folder (config.json only) or a GGUF file (metadata only)."""
    path = Path(spec).expanduser()
    if path.is_dir() or path.name == "config.json":
        return _from_hf_folder(path if path.is_dir() else path.parent)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"no such GGUF file: {spec}")
        return _from_gguf(path)
    name, entry = catalog.find_model(spec)
    return Model(name, config_from_dict(entry.config), "catalog", hf_id=entry.hf_id)


# config.json's dtype (transformers 5) or torch_dtype (4.x) -> the weight mix of the same bytes
STORED_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _from_hf_folder(folder: Path) -> Model:
    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"{folder} holds no config.json")
    try:
        d = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    from ..data import BUNDLED_TRAINED_CONTEXT
    from ..loading import BUNDLED

    stored = STORED_DTYPES.get(str(d.get("dtype") or d.get("torch_dtype") or "").removeprefix("torch."))
    trained = BUNDLED_TRAINED_CONTEXT if folder.resolve() == BUNDLED.resolve() else None
    return Model(folder.name, config_from_dict(d), "hf", hf_id=str(folder), stored_quant=stored,
                 trained_context=trained)


def _from_gguf(path: Path) -> Model:
    try:
        from ..gguf import reader  # metadata and tensor sizes only; the weights are never read
    except ImportError:
        raise ValueError("GGUF input needs kvslim.gguf.reader, which this installation lacks") from None
    config = config_from_dict(reader.read_config(str(path)))
    return Model(path.stem, config, "gguf", gguf_path=str(path), gguf_bytes=int(reader.tensor_bytes(str(path))))


# ----- caches, compute, totals -------------------------------------------------------------------

def _has_state(c) -> bool:
    """Whether some layer keeps a recurrent state (Gated DeltaNet) instead of a KV cache."""
    return any(isinstance(s, StateLayerSpec) for s in c.cache_layout())


def check_tp(c, tp: int) -> None:
    """Raise ValueError unless attention (and DeltaNet) heads split evenly over ``tp`` GPUs,
    as vLLM requires; KV heads fewer than ``tp`` are replicated."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    heads = [("attention heads", c.num_attention_heads)]
    if _has_state(c):
        heads += [("DeltaNet key heads", c.linear_num_key_heads), ("DeltaNet value heads", c.linear_num_value_heads)]
    for what, n in heads:
        if n % tp:
            raise ValueError(f"--tp {tp} does not divide the {n} {what}")
    kv = c.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"--tp {tp} neither divides nor is a multiple of the {kv} KV heads")


def cache_layout(c, type_k: str, type_v: str, tp: int = 1) -> list[KVLayerSpec | StateLayerSpec]:
    """The model's per-layer cache specs, narrowed to one GPU's heads under tensor parallelism."""
    layout = c.cache_layout(type_k, type_v)
    if tp == 1:
        return layout
    out = []
    for spec in layout:
        if isinstance(spec, KVLayerSpec):
            out.append(dataclasses.replace(spec, n_kv_heads=max(1, spec.n_kv_heads // tp)))
        else:
            out.append(dataclasses.replace(spec, conv_dim=spec.conv_dim // tp, n_v_heads=spec.n_v_heads // tp))
    return out


def kv_bytes(c, ctx_per_slot: int, n_slots: int, type_k: str, type_v: str,
             page_size: int = DEFAULT_PAGE_SIZE, tp: int = 1) -> int:
    """KV cache bytes: every attention layer's ``bytes_for`` the slot's context, times the slots."""
    specs = [s for s in cache_layout(c, type_k, type_v, tp) if isinstance(s, KVLayerSpec)]
    return n_slots * sum(s.bytes_for(ctx_per_slot, page_size) for s in specs)


def state_bytes(c, n_slots: int, tp: int = 1) -> int:
    """Recurrent state bytes: every DeltaNet layer's ``bytes_per_slot``, times the slots."""
    specs = [s for s in cache_layout(c, "f16", "f16", tp) if isinstance(s, StateLayerSpec)]
    return n_slots * sum(s.bytes_per_slot for s in specs)


def _widest_activation(c) -> int:
    widths = [c.hidden_size, c.num_attention_heads * c.head_dim * (2 if _has_state(c) else 1),
              getattr(c, "intermediate_size", 0)]
    if getattr(c, "num_experts", 0):
        widths += [c.num_experts_per_tok * c.moe_intermediate_size,
                   getattr(c, "shared_expert_intermediate_size", 0)]
    if _has_state(c):
        widths.append(2 * c.linear_num_key_heads * c.linear_key_head_dim
                      + 2 * c.linear_num_value_heads * c.linear_value_head_dim)
    return max(widths)


def compute_bytes(c, ctx: int, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """An estimate of llama.cpp's compute buffer, with flash attention: the f16 attention mask
    (ctx x ubatch x 2 B), f32 logits for a whole ubatch (its reserve pass lets every token
    output: ubatch x vocab x 4 B) and ``ACTIVATION_BUFFERS`` f32 activations of the widest
    projection (ubatch x width x 4 B each). Not split under tensor parallelism (conservative)."""
    return n_ubatch * (2 * ctx + 4 * c.vocab_size + 4 * ACTIVATION_BUFFERS * _widest_activation(c))


@dataclass(frozen=True)
class Request:
    """What the user asks for (llama-server's flags)."""

    ctx: int                          # -c: total context, shared by the slots
    n_slots: int = 1                  # -np
    type_k: str = "f16"               # -ctk
    type_v: str = "f16"               # -ctv
    weight_quant: str = DEFAULT_WEIGHT_QUANT
    tp: int = 1
    depth: int | None = None          # tokens in the cache when decoding; None: a full slot
    n_ubatch: int = DEFAULT_UBATCH    # -ub
    page_size: int = DEFAULT_PAGE_SIZE

    @property
    def ctx_per_slot(self) -> int:
        return self.ctx // self.n_slots

    @property
    def decode_depth(self) -> int:
        return self.ctx_per_slot if self.depth is None else self.depth

    def check(self, model: Model) -> None:
        """Raise ValueError on numbers or names that make no sense for ``model``."""
        if self.n_slots < 1:
            raise ValueError(f"-np must be at least 1, got {self.n_slots}")
        if self.ctx < self.n_slots:
            raise ValueError(f"-c {self.ctx} leaves no context for each of the {self.n_slots} slots")
        if self.n_ubatch < 1 or self.page_size < 1:
            raise ValueError("-ub and the page size must be at least 1")
        if not 0 <= self.decode_depth <= self.ctx_per_slot:
            raise ValueError(f"--depth {self.depth} must be between 0 and the slot context {self.ctx_per_slot}")
        check_weight_quant(model, self.weight_quant)
        check_tp(model.config, self.tp)
        model.config.cache_layout(self.type_k, self.type_v)  # unknown types or head_dim mismatches raise here


@dataclass(frozen=True)
class Target:
    """Where the model must fit: usable bytes per GPU and bandwidth (None: unknown)."""

    name: str
    memory: int
    bandwidth: float | None = None  # bytes per second
    vendor: str | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "memory": self.memory, "bandwidth_gbs": self.bandwidth and self.bandwidth / 1e9,
                "vendor": self.vendor}


def gpu_target(name: str) -> Target:
    """A target from the hardware catalog."""
    hw = catalog.hardware(name)
    return Target(hw.label, hw.usable_bytes, hw.bandwidth_gbs * 1e9, hw.vendor)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_memory(text: str) -> int:
    """'24GiB', '24 GB' (10^9), '24G' (binary, as llama.cpp and docker read it), '512MiB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write it like 24GiB, 24GB, 24G or 16384MiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


def memory_target(text: str, bandwidth_gbs: float | None = None) -> Target:
    """A target of ``--mem`` bytes (all of it usable) and optional ``--bw`` GB/s."""
    if bandwidth_gbs is not None and bandwidth_gbs <= 0:
        raise ValueError(f"--bw must be positive GB/s, got {bandwidth_gbs}")
    return Target(f"{text.strip()} of memory", parse_memory(text), bandwidth_gbs and bandwidth_gbs * 1e9)


def local_target() -> Target:
    """This machine: the first CUDA GPU's memory less the runtime reserve, else an Apple Mac's
    GPU share of its memory, else the RAM the OS reports available now (llama.cpp's CPU backend).
    Bandwidth is unknown (give --gpu or --bw for decode ceilings)."""
    import torch

    if torch.cuda.is_available():
        name, total = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
        return Target(f"this machine's {name}", total - catalog.NVIDIA_RESERVE, None, "nvidia")
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if sys.platform == "darwin":
        share = catalog.APPLE_GPU_SHARE_LARGE if physical >= catalog.APPLE_LARGE_FROM else catalog.APPLE_GPU_SHARE_SMALL
        return Target("this Mac's GPU share of memory", int(physical * share), None, "apple")
    return Target("this machine's available RAM (CPU)", _available_ram() or physical, None, "cpu")


def _available_ram() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            fields_ = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields_["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Breakdown:
    """Bytes on one GPU."""

    weights: int
    kv: int
    state: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state + self.compute


def breakdown(model: Model, req: Request) -> Breakdown:
    """Weights, KV cache, recurrent state and compute workspace for ``req``, per GPU."""
    c = model.config
    return Breakdown(weights(model, req.weight_quant, req.tp).per_gpu,
                     kv_bytes(c, req.ctx_per_slot, req.n_slots, req.type_k, req.type_v, req.page_size, req.tp),
                     state_bytes(c, req.n_slots, req.tp), compute_bytes(c, req.ctx, req.n_ubatch))


def fits(model: Model, req: Request, target: Target) -> bool:
    return breakdown(model, req).total <= target.memory


def decode_ceiling(model: Model, req: Request, target: Target) -> float | None:
    """Tokens/s one sequence cannot beat at ``req.decode_depth``: bandwidth over the bytes a step
    reads on one GPU (active weights, the KV of that many tokens, and the DeltaNet state read
    and written back). Ignores compute and, under tensor parallelism, communication."""
    if not target.bandwidth:
        return None
    c = model.config
    read = (weights(model, req.weight_quant, req.tp).read_per_token
            + kv_bytes(c, req.decode_depth, 1, req.type_k, req.type_v, 1, req.tp) + 2 * state_bytes(c, 1, req.tp))
    return target.bandwidth / read


@dataclass(frozen=True)
class Plan:
    """One row of the answer."""

    request: Request
    memory: Breakdown
    target_memory: int
    decode_tps: float | None
    context_limit: int | None = None

    @property
    def past_limit(self) -> bool:
        """More tokens per slot than the model's positions allow: memory may fit, the model does not."""
        return self.context_limit is not None and self.request.ctx_per_slot > self.context_limit

    @property
    def headroom(self) -> int:
        return self.target_memory - self.memory.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def as_dict(self) -> dict:
        r, m = self.request, self.memory
        return {"ctx": r.ctx, "ctx_per_slot": r.ctx_per_slot, "n_slots": r.n_slots, "type_k": r.type_k,
                "type_v": r.type_v, "weight_quant": r.weight_quant, "tp": r.tp, "weights": m.weights, "kv": m.kv,
                "state": m.state, "compute": m.compute, "total": m.total, "memory": self.target_memory,
                "headroom": self.headroom, "fits": self.fits, "past_limit": self.past_limit, "depth": r.decode_depth,
                "decode_tps": None if self.decode_tps is None else round(self.decode_tps, 1)}


def plan(model: Model, req: Request, target: Target) -> Plan:
    """The memory breakdown, fit and decode ceiling of ``req`` on ``target``."""
    req.check(model)
    return Plan(req, breakdown(model, req), target.memory, decode_ceiling(model, req, target),
                context_limit(model.config))


# ----- searches and suggestions ----------------------------------------------------------------

def context_limit(c) -> int | None:
    """The positions the model's config allows (max_position_embeddings); None when it does not say."""
    return int(getattr(c, "max_position_embeddings", 0) or 0) or None


def max_context_per_slot(c) -> int:
    return context_limit(c) or 262_144


def _context_cap(c, page_size: int) -> int:
    """The longest slot the search tries: the trained context in whole pages (one page at least)."""
    return max(1, max_context_per_slot(c) // page_size) * page_size


def largest_context(model: Model, req: Request, target: Target) -> int:
    """The largest -c that fits with ``req``'s other settings: whole pages per slot, at most the
    model's trained context per slot; 0 if not even one page per slot fits."""
    step = req.n_slots * req.page_size
    pages = _context_cap(model.config, req.page_size) // req.page_size

    def ok(p: int) -> bool:
        return fits(model, dataclasses.replace(req, ctx=p * step, depth=None), target)

    if not ok(1):
        return 0
    lo, hi = 1, pages                     # ok(lo) holds; find the last p with ok(p)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo * step


@dataclass(frozen=True)
class Suggestion:
    """One change that makes a request fit."""

    change: str   # "kv_types", "slots", "context", "weights", "tp" or "weights_and_context"
    flags: str    # the flags to use instead
    total: int    # bytes per GPU with the change

    def as_dict(self) -> dict:
        return {"change": self.change, "flags": self.flags, "total": self.total}


def _bits(type_name: str, head_dim: int) -> float:
    return formats.get(type_name).bits_per_value(head_dim)


def kv_candidates() -> list[str]:
    """KV types a suggestion may pick: every non-experimental format narrower than f32
    (the unrotated ``-norot`` rows take the same bytes as their rotated names and are left out)."""
    return [n for n in formats.names() if n != "f32" and not formats.get(n).spec.experimental
            and not n.endswith(formats.NOROT)]


def _try(model: Model, req: Request, target: Target, change: str, flags: str) -> Suggestion | None:
    total = breakdown(model, req).total
    return Suggestion(change, flags, total) if total <= target.memory else None


def _smaller_kv(model: Model, req: Request, target: Target) -> Suggestion | None:
    """A K/V pair that fits, neither side wider than asked, fewer bytes in all: the measured
    pair with the lowest KLD (``plan.quality``) if one fits, else the pair with the most
    bits on its weaker side (then on K)."""
    c = model.config
    bits_k, bits_v = _bits(req.type_k, c.head_dim), _bits(req.type_v, c.head_dim)
    now = kv_bytes(c, 1, 1, req.type_k, req.type_v, 1)
    allowed = []
    for k, v in itertools.product(kv_candidates(), repeat=2):
        try:
            bk, bv = _bits(k, c.head_dim), _bits(v, c.head_dim)
        except ValueError:                           # the head_dim does not suit this format
            continue
        if bk <= bits_k and bv <= bits_v and kv_bytes(c, 1, 1, k, v, 1) < now:
            allowed.append(((min(bk, bv), bk, bv), k, v))
    measured = [(k, v) for k, v in quality.ranked() if any((k, v) == (a, b) for _, a, b in allowed)]
    by_bits = [(k, v) for _, k, v in sorted(allowed, reverse=True)]
    for k, v in measured + by_bits:
        hit = _try(model, dataclasses.replace(req, type_k=k, type_v=v), target, "kv_types", f"-ctk {k} -ctv {v}")
        if hit:
            return hit
    return None


def _fewer_slots(model: Model, req: Request, target: Target) -> Suggestion | None:
    """The most slots, fewer than asked, that fit with each slot's context kept."""
    for n in range(req.n_slots - 1, 0, -1):
        smaller = dataclasses.replace(req, n_slots=n, ctx=req.ctx_per_slot * n)
        hit = _try(model, smaller, target, "slots", f"-np {n} -c {smaller.ctx}")
        if hit:
            return hit
    return None


def _smaller_context(model: Model, req: Request, target: Target) -> Suggestion | None:
    ctx = largest_context(model, req, target)
    return _try(model, dataclasses.replace(req, ctx=ctx, depth=None), target, "context", f"-c {ctx}") if ctx else None


def _smaller_weights(model: Model, req: Request, target: Target) -> Suggestion | None:
    """The widest weight quantization, smaller than the request's, that fits."""
    now = weights(model, req.weight_quant, req.tp).per_gpu
    for name in catalog.WEIGHT_QUANTS:
        if weights(model, name, req.tp).per_gpu < now:
            hit = _try(model, dataclasses.replace(req, weight_quant=name), target, "weights", f"-wq {name}")
            if hit:
                return hit
    return None


def _more_gpus(model: Model, req: Request, target: Target) -> Suggestion | None:
    """The fewest NVIDIA GPUs of the same kind (2, 4 or 8) that fit it with tensor parallelism."""
    if target.vendor != "nvidia":
        return None
    for n in (2, 4, 8):
        try:
            check_tp(model.config, n)
        except ValueError:
            continue
        hit = _try(model, dataclasses.replace(req, tp=n), target, "tp", f"--tp {n}") if n > req.tp else None
        if hit:
            return hit
    return None


def _smaller_weights_and_context(model: Model, req: Request, target: Target) -> Suggestion | None:
    """The widest smaller weight quantization that fits a useful context (llama.cpp's default
    4096 per slot, or the request's if shorter), with the longest such context."""
    now, useful = weights(model, req.weight_quant, req.tp).per_gpu, min(req.ctx, MIN_USEFUL_CTX * req.n_slots)
    for name in catalog.WEIGHT_QUANTS:
        smaller = dataclasses.replace(req, weight_quant=name, depth=None)
        if weights(model, name, req.tp).per_gpu < now and largest_context(model, smaller, target) >= useful:
            ctx = largest_context(model, smaller, target)
            return _try(model, dataclasses.replace(smaller, ctx=ctx), target, "weights_and_context",
                        f"-wq {name} -c {ctx}")
    return None


def suggestions(model: Model, req: Request, target: Target) -> list[Suggestion]:
    """For a request that does not fit: each single change that makes it fit, or else a smaller
    weight quantization together with a shorter context."""
    if fits(model, req, target):
        return []
    tries = (_smaller_kv, _fewer_slots, _smaller_context, _smaller_weights, _more_gpus)
    found = [s for s in (f(model, req, target) for f in tries) if s]
    return found or [s for s in [_smaller_weights_and_context(model, req, target)] if s]


# ----- launch lines for other engines ------------------------------------------------------------

def vllm_kv_dtype(type_k: str, type_v: str, head_dim: int) -> tuple[str, list[str]]:
    """vLLM's --kv-cache-dtype for a K/V pair, and what differs from the plan."""
    notes, picks = [], []
    for t in (type_k, type_v):
        pick = catalog.VLLM_KV_DTYPE.get(t)
        if pick is None:
            pick = "fp8" if _bits(t, head_dim) <= 8.5 else "auto"
            notes.append(f"vLLM has no {t} cache; --kv-cache-dtype {pick} stands in for it")
        elif t == "q8_0":
            notes.append("vLLM's fp8 (8 bits/value, per-tensor scale) is the nearest to q8_0, not the same format")
        picks.append(pick)
    if picks[0] != picks[1]:
        notes.append("vLLM takes one --kv-cache-dtype for K and V; the wider of the two is used")
    return ("auto" if "auto" in picks else "fp8"), notes


def _llama_server_type(t: str) -> tuple[str, str | None]:
    if t in catalog.LLAMA_SERVER_KV:
        return t, None
    if t.endswith(formats.NOROT) and t.removesuffix(formats.NOROT) in catalog.LLAMA_SERVER_KV:
        return t.removesuffix(formats.NOROT), "unrotated ggml cache: run llama-server with LLAMA_ATTN_ROT_DISABLE=1"
    near = catalog.LLAMA_SERVER_NEAREST
    return near, f"upstream llama-server has no {t} cache; {near} stands in for it and takes more memory"


def _gguf_name(model: Model, quant: str) -> str:
    if model.gguf_path:
        return model.gguf_path
    base = (model.hf_id or model.name).rstrip("/").split("/")[-1]
    return f"{base}-{quant.upper()}.gguf"


def launch_commands(model: Model, req: Request, target: Target | None = None) -> dict:
    """Equivalent vLLM and llama-server command lines for ``req``, with notes on what differs."""
    k, note_k = _llama_server_type(req.type_k)
    v, note_v = _llama_server_type(req.type_v)
    notes = [n for n in (note_k, note_v) if n]
    server = (f"llama-server -m {_gguf_name(model, req.weight_quant)} -c {req.ctx} -np {req.n_slots} "
              f"-ctk {k} -ctv {v} -fa on -ngl 99")
    if req.tp > 1:
        server += f" -sm layer -ts {','.join(['1'] * req.tp)}"
        notes.append("llama.cpp splits by layers across GPUs (-sm layer), not by heads; its per-GPU figures "
                     "differ from the tensor-parallel split above")
    dtype, vllm_notes = vllm_kv_dtype(req.type_k, req.type_v, model.config.head_dim)
    source = model.hf_id or model.gguf_path or model.name
    vllm = (f"vllm serve {source} --tensor-parallel-size {req.tp} --max-model-len {req.ctx_per_slot} "
            f"--max-num-seqs {req.n_slots} --kv-cache-dtype {dtype}")
    bf16 = weights(model, "bf16", req.tp).per_gpu
    notes += vllm_notes + [f"vLLM loads the checkpoint's own weights (bf16: {bf16 / catalog.GIB:.1f} GiB per GPU), "
                           f"not the {req.weight_quant} mix, and fills the rest of --gpu-memory-utilization "
                           f"with KV blocks"]
    if model.source == "gguf":
        notes.append("vLLM reads GGUF experimentally and needs --tokenizer set to the original repository")
    if target is not None and target.vendor == "apple":
        notes.append("vLLM does not run on Apple GPUs; use llama-server (Metal)")
    return {"vllm": vllm, "llama_server": server, "notes": notes}


# ----- the whole answer --------------------------------------------------------------------------

def model_summary(model: Model) -> dict:
    """Sizes that describe the model, all derived from its config."""
    c = model.config
    total, active = parameter_counts(c)
    layout = c.cache_layout("f16", "f16")
    n_kv = sum(isinstance(s, KVLayerSpec) for s in layout)
    return {"name": model.name, "source": model.source, "model_type": c.model_type, "hf_id": model.hf_id,
            "gguf": model.gguf_path, "params": total, "active_params": active, "layers": len(layout),
            "attention_layers": n_kv, "state_layers": len(layout) - n_kv,
            "kv_bytes_per_token_f16": kv_bytes(c, 1, 1, "f16", "f16", 1), "state_bytes_per_slot": state_bytes(c, 1),
            "max_context": max_context_per_slot(c), "trained_context": model.trained_context,
            "stored_quant": model.stored_quant}


def _largest_row(model: Model, req: Request, target: Target) -> dict:
    ctx = largest_context(model, req, target)
    at = dataclasses.replace(req, ctx=max(ctx, req.n_slots), depth=None)
    kv = kv_bytes(model.config, at.ctx_per_slot, at.n_slots, req.type_k, req.type_v, req.page_size, req.tp)
    return {"type_k": req.type_k, "type_v": req.type_v, "weight_quant": req.weight_quant, "n_slots": req.n_slots,
            "kv_bytes_per_token": kv_bytes(model.config, 1, 1, req.type_k, req.type_v, 1, req.tp),
            "ctx": ctx, "ctx_per_slot": ctx // req.n_slots, "kv": kv if ctx else 0,
            "capped": ctx // req.n_slots >= _context_cap(model.config, req.page_size)}


def _recommended(plans: list[Plan]) -> Plan | None:
    """The fitting row within the model's context limit with the longest context, then the least
    compressed K/V, then the widest weights (rows past the limit only when no other row fits)."""
    ok = [p for p in plans if p.fits and not p.past_limit] or [p for p in plans if p.fits]
    return max(ok, key=lambda p: (p.request.ctx, p.memory.kv, p.memory.weights), default=None)


def _within_limit(model: Model, req: Request) -> tuple[Request, list[str]]:
    """``req`` with each slot cut to the model's context limit for the launch lines, and a note saying so."""
    limit = context_limit(model.config)
    if limit is None or req.ctx_per_slot <= limit:
        return req, []
    cut = dataclasses.replace(req, ctx=limit * req.n_slots, depth=None)
    return cut, [f"-c {req.ctx} gives each slot {req.ctx_per_slot} tokens, past the model's limit of {limit} "
                 f"(max_position_embeddings): vLLM refuses it and llama-server warns; the lines use -c {cut.ctx}"]


def report(model: Model, target: Target, requests: list[Request]) -> dict:
    """Everything ``kvslim plan`` prints: rows, largest contexts per K/V pair, suggestions for rows
    that do not fit, and launch lines for the recommended row. JSON-ready."""
    plans = [plan(model, r, target) for r in requests]
    rows = [{**p.as_dict(), "suggestions": [s.as_dict() for s in suggestions(model, p.request, target)]}
            for p in plans]
    pairs = {(r.type_k, r.type_v, r.weight_quant, r.n_slots, r.tp): r for r in requests}
    best = _recommended(plans)
    launch_req, cut_notes = _within_limit(model, best.request if best else requests[0])
    launch = launch_commands(model, launch_req, target)
    return {"model": model_summary(model), "target": target.as_dict(), "rows": rows,
            "largest_context": [_largest_row(model, r, target) for r in pairs.values()],
            "recommended": best and best.as_dict(),
            "launch": {**launch, "notes": cut_notes + launch["notes"]}}
