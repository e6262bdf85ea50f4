"""Memory planner: will a model, context, slot count and K/V cache types fit on a machine?

    >>> from kvslim import plan
    >>> model = plan.resolve_model("qwen3.6-35b-a3b")
    >>> req = plan.Request(ctx=262_144, type_k="q8_0", type_v="turbo3")
    >>> plan.plan(model, req, plan.gpu_target("rtx4090")).fits

One module per concern, each importing only those above it in this list:
``tensors`` (the model's GGUF tensors, read off the model built on the meta device),
``model`` (what is planned: a catalog name, a folder or a GGUF file), ``weight_size``
(bytes per weight mix), ``targets`` (GPUs, ``--mem``, this machine), ``fit`` (memory
breakdown, fit, decode ceiling, largest context), ``suggest`` (changes that make a
request fit), ``launch`` (llama-server and vLLM lines), ``report`` (the whole answer).
KV and state bytes are sums of the model's own per-layer cache specs
(``kvslim.cache.spec``), so the planner and the cache allocator cannot disagree.
"""
from .catalog import HARDWARE, MODELS, WEIGHT_QUANTS
from .fit import (
                  DEFAULT_UBATCH,
                  DEFAULT_WEIGHT_QUANT,
                  Breakdown,
                  Plan,
                  Request,
                  breakdown,
                  check_tp,
                  compute_bytes,
                  decode_ceiling,
                  fits,
                  kv_bytes,
                  largest_context,
                  plan,
                  state_bytes,
)
from .launch import launch_commands, vllm_kv_dtype
from .model import Model, context_limit, max_context_per_slot, resolve_model
from .report import model_summary, report
from .suggest import Suggestion, suggestions
from .targets import Target, gpu_target, local_target, memory_target, parse_memory
from .tensors import WeightTensor, parameter_counts, weight_tensors
from .weight_size import WeightSize, check_weight_quant, tensor_types, weight_size

__all__ = ["HARDWARE", "MODELS", "WEIGHT_QUANTS", "DEFAULT_UBATCH", "DEFAULT_WEIGHT_QUANT", "Breakdown", "Model",
           "Plan", "Request", "Suggestion", "Target", "WeightSize", "WeightTensor", "breakdown", "check_tp",
           "check_weight_quant", "compute_bytes", "context_limit", "decode_ceiling", "fits", "gpu_target", "kv_bytes",
           "largest_context", "launch_commands", "local_target", "max_context_per_slot", "memory_target",
           "model_summary", "parameter_counts", "parse_memory", "plan", "report", "resolve_model", "state_bytes",
           "suggestions", "tensor_types", "vllm_kv_dtype", "weight_size", "weight_tensors"]
