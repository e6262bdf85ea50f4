"""For a request that does not fit: the single changes that make it fit (smaller K/V types,
fewer slots, a shorter context, smaller weights, more GPUs), or else smaller weights with a
shorter context."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from .. import formats
from . import catalog, quality
from .fit import Request, breakdown, check_tp, fits, kv_bits, kv_bytes, largest_context
from .model import Model
from .targets import Target
from .weight_size import weight_size

MIN_USEFUL_CTX = 4096           # llama.cpp's default context: a suggestion should leave at least this per slot


@dataclass(frozen=True)
class Suggestion:
    """One change that makes a request fit."""

    change: str   # "kv_types", "slots", "context", "weights", "tp" or "weights_and_context"
    flags: str    # the flags to use instead
    total: int    # bytes per GPU with the change

    def as_dict(self) -> dict:
        return {"change": self.change, "flags": self.flags, "total": self.total}


def kv_candidates(role: str = "k", calibrated: bool = False) -> list[str]:
    """KV types a suggestion may pick for K or V: every non-experimental format narrower than f32
    (the unrotated ``-norot`` rows take the same bytes as their rotated names and are left out);
    calibrated V types (klt3) only for a model that has a KV calibration."""
    names = formats.names() if calibrated and role == "v" else formats.standalone_names()
    return [n for n in names if n != "f32" and not formats.get(n).spec.experimental and not n.endswith(formats.NOROT)]


def _try(model: Model, req: Request, target: Target, change: str, flags: str) -> Suggestion | None:
    total = breakdown(model, req).total
    return Suggestion(change, flags, total) if total <= target.memory else None


def _smaller_kv(model: Model, req: Request, target: Target) -> Suggestion | None:
    """A K/V pair that fits, neither side wider than asked, fewer bytes in all: the measured
    pair with the lowest KLD (``plan.quality``) if one fits, else the pair with the most
    bits on its weaker side (then on K)."""
    c = model.config
    bits_k, bits_v = kv_bits(req.type_k, c.head_dim), kv_bits(req.type_v, c.head_dim)
    now = kv_bytes(c, 1, 1, req.type_k, req.type_v, 1)
    allowed = []
    for k, v in itertools.product(kv_candidates("k"), kv_candidates("v", model.kv_calibrated)):
        try:
            bk, bv = kv_bits(k, c.head_dim), kv_bits(v, c.head_dim)
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
    now = weight_size(model, req.weight_quant, req.tp).per_gpu
    for name in catalog.suggested_quants():
        if weight_size(model, name, req.tp).per_gpu < now:
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
    now, useful = weight_size(model, req.weight_quant, req.tp).per_gpu, min(req.ctx, MIN_USEFUL_CTX * req.n_slots)
    for name in catalog.suggested_quants():
        smaller = dataclasses.replace(req, weight_quant=name, depth=None)
        if weight_size(model, name, req.tp).per_gpu < now and largest_context(model, smaller, target) >= useful:
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
