"""The whole answer of ``kvslim plan``: the model's sizes, one row per request, the largest
context per K/V pair, suggestions for rows that do not fit and launch lines for the
recommended row. JSON-ready."""
from __future__ import annotations

import dataclasses

from ..cache import KVLayerSpec
from .fit import Plan, Request, context_cap, kv_bytes, largest_context, plan, state_bytes
from .launch import launch_commands, within_context_limit
from .model import Model, max_context_per_slot
from .suggest import suggestions
from .targets import Target
from .tensors import parameter_counts


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
            "capped": ctx // req.n_slots >= context_cap(model.config, req.page_size)}


def _recommended(plans: list[Plan]) -> Plan | None:
    """The fitting row within the model's context limit with the longest context, then the least
    compressed K/V, then the widest weights (rows past the limit only when no other row fits)."""
    ok = [p for p in plans if p.fits and not p.past_limit] or [p for p in plans if p.fits]
    return max(ok, key=lambda p: (p.request.ctx, p.memory.kv, p.memory.weights), default=None)


def report(model: Model, target: Target, requests: list[Request]) -> dict:
    """Everything ``kvslim plan`` prints: rows, largest contexts per K/V pair, suggestions for rows
    that do not fit, and launch lines for the recommended row. JSON-ready."""
    plans = [plan(model, r, target) for r in requests]
    rows = [{**p.as_dict(), "suggestions": [s.as_dict() for s in suggestions(model, p.request, target)]}
            for p in plans]
    pairs = {(r.type_k, r.type_v, r.weight_quant, r.n_slots, r.tp): r for r in requests}
    best = _recommended(plans)
    launch_req, cut_notes = within_context_limit(model, best.request if best else requests[0])
    launch = launch_commands(model, launch_req, target)
    return {"model": model_summary(model), "target": target.as_dict(), "rows": rows,
            "largest_context": [_largest_row(model, r, target) for r in pairs.values()],
            "recommended": best and best.as_dict(),
            "launch": {**launch, "notes": cut_notes + launch["notes"]}}
