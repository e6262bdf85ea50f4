"""Memory planner: will a model, context, slot count and K/V cache types fit on a machine?

    >>> from kvslim import plan
    >>> model = plan.load_model("qwen3.6-35b-a3b")
    >>> req = plan.Request(ctx=262_144, type_k="q8_0", type_v="turbo3")
    >>> plan.plan(model, req, plan.gpu_target("rtx4090")).fits

KV and state bytes are sums of the model's own per-layer cache specs
(``kvslim.cache.spec``), so the planner and the cache allocator cannot disagree.
"""
from .catalog import HARDWARE, MODELS, WEIGHT_QUANTS
from .planner import (Breakdown, Model, Plan, Request, Suggestion, Target, breakdown, compute_bytes, decode_ceiling,
                      gpu_target, kv_bytes, largest_context, launch_commands, load_model, memory_target,
                      parameter_counts, parse_memory, plan, report, state_bytes, suggestions, weights)

__all__ = ["HARDWARE", "MODELS", "WEIGHT_QUANTS", "Breakdown", "Model", "Plan", "Request", "Suggestion", "Target",
           "breakdown", "compute_bytes", "decode_ceiling", "gpu_target", "kv_bytes", "largest_context",
           "launch_commands", "load_model", "memory_target", "parameter_counts", "parse_memory", "plan", "report",
           "state_bytes", "suggestions", "weights"]
