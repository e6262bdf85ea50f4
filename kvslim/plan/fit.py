"""Will a request fit? Memory on one GPU = weights + KV cache + recurrent state + compute workspace:

- weights: ``weight_size`` (the model's GGUF tensors in a mix's types, or a file's bytes);
- KV cache and recurrent state: the sum of the model's own per-layer cache specs
  (``KVLayerSpec.bytes_for``, ``StateLayerSpec.bytes_per_slot``), the same
  accounting the cache allocator sizes its buffers with;
- compute: an estimate of llama.cpp's compute buffer (see ``compute_bytes``).

``-c`` is the total context, shared by the ``-np`` slots as llama-server shares
it: each slot holds up to ``c // np`` tokens, in whole pages of ``page_size``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import formats
from ..cache import KVLayerSpec, StateLayerSpec
from ..cache.kv import DEFAULT_PAGE_SIZE
from ..cache.spec import layout_bytes
from .model import Model, context_limit, max_context_per_slot
from .targets import Target
from .weight_size import check_weight_quant, weight_size

DEFAULT_UBATCH = 512            # llama.cpp's -ub default: tokens per compute pass
DEFAULT_WEIGHT_QUANT = "q4_k_m"
ACTIVATION_BUFFERS = 4          # f32 activations alive at once in a layer (input, residual, two projections)


def has_state(c) -> bool:
    """Whether some layer keeps a recurrent state (Gated DeltaNet) instead of a KV cache."""
    return any(isinstance(s, StateLayerSpec) for s in c.cache_layout())


def check_tp(c, tp: int) -> None:
    """Raise ValueError unless attention (and DeltaNet) heads split evenly over ``tp`` GPUs,
    as vLLM requires; KV heads fewer than ``tp`` are replicated."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    heads = [("attention heads", c.num_attention_heads)]
    if has_state(c):
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
             page_size: int = DEFAULT_PAGE_SIZE, tp: int = 1, f16_window: int = 0) -> int:
    """KV cache bytes: every attention layer's ``bytes_for`` the slot's context (and f16 window),
    times the slots."""
    return layout_bytes(cache_layout(c, type_k, type_v, tp), ctx_per_slot, n_slots, page_size, f16_window)[0]


def state_bytes(c, n_slots: int, tp: int = 1) -> int:
    """Recurrent state bytes: every DeltaNet layer's ``bytes_per_slot``, times the slots."""
    return layout_bytes(cache_layout(c, "f16", "f16", tp), 1, n_slots)[1]


def kv_bits(type_name: str, head_dim: int) -> float:
    """Bits per value of K/V type ``type_name`` at ``head_dim`` (ValueError if they do not suit)."""
    return formats.get(type_name).bits_per_value(head_dim)


def _widest_activation(c) -> int:
    """The widest projection output of a layer (the hybrids' gated attention doubles q_proj)."""
    widths = [c.hidden_size, c.num_attention_heads * c.head_dim * (2 if has_state(c) else 1), c.intermediate_size]
    if c.is_moe:
        widths += [c.num_experts_per_tok * c.moe_intermediate_size, c.shared_expert_intermediate_size]
    if has_state(c):
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
    f16_window: int = 0               # --f16-window: newest tokens per slot kept in f16

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
        if self.f16_window < 0:
            raise ValueError(f"--f16-window must be 0 or more, got {self.f16_window}")
        if not 0 <= self.decode_depth <= self.ctx_per_slot:
            raise ValueError(f"--depth {self.depth} must be between 0 and the slot context {self.ctx_per_slot}")
        check_weight_quant(model, self.weight_quant)
        check_tp(model.config, self.tp)
        model.config.cache_layout(self.type_k, self.type_v)  # unknown types or head_dim mismatches raise here


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
    """WeightSize, KV cache, recurrent state and compute workspace for ``req``, per GPU."""
    c = model.config
    return Breakdown(weight_size(model, req.weight_quant, req.tp).per_gpu,
                     kv_bytes(c, req.ctx_per_slot, req.n_slots, req.type_k, req.type_v, req.page_size, req.tp,
                              req.f16_window),
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
    read = (weight_size(model, req.weight_quant, req.tp).read_per_token
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


def context_cap(c, page_size: int) -> int:
    """The longest slot the search tries: the trained context in whole pages (one page at least)."""
    return max(1, max_context_per_slot(c) // page_size) * page_size


def largest_context(model: Model, req: Request, target: Target) -> int:
    """The largest -c that fits with ``req``'s other settings: whole pages per slot, at most the
    model's trained context per slot; 0 if not even one page per slot fits."""
    step = req.n_slots * req.page_size
    pages = context_cap(model.config, req.page_size) // req.page_size

    def ok(p: int) -> bool:
        return fits(model, dataclasses.replace(req, ctx=p * step, depth=None), target)

    if not ok(1):
        return 0
    lo, hi = 1, pages                     # ok(lo) holds; find the last p with ok(p)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo * step
