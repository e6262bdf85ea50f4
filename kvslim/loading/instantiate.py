"""Put a normalised state dict into a freshly built model, with clear errors.

Entries that are ``kvslim.weights.QuantTensor`` (from a GGUF, or quantized here with
``weights="q8_0"`` etc.) swap their module for its quantized twin (QuantLinear,
QuantEmbedding, QuantExperts) instead of being expanded.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import weights as W
from ..models import build_on_meta
from ..models.base import CausalLM
from ..models.layers import Experts

# Kept in float when quantizing at load, as llama.cpp's converter does (names.F32_BY_NAME):
# the shared-expert gate is one row that scales a whole MLP.
KEEP_DENSE = ("shared_expert_gate.weight",)


def instantiate(config, state_dict: dict, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu", weights: str | None = None) -> CausalLM:
    """Build the model for ``config`` without allocating, then adopt the checkpoint's tensors.

    Args:
        state_dict: HF names -> tensors or QuantTensors (kept quantized).
        dtype: float parameters' and activations' dtype (default: the checkpoint's dominant one).
        weights: a block type name (``kvslim.weights.encodable_names()``) to quantize the
            dense matrices to now; None keeps them as they come.
    """
    model = build_on_meta(config)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    _check_names_and_shapes(model, state_dict)
    if weights is not None:
        state_dict = quantize_matrices(model, state_dict, W.get(weights))
    dtype = dtype or _common_dtype(state_dict)
    quantized = {k: v for k, v in state_dict.items() if isinstance(v, W.QuantTensor)}
    dense = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
             for k, v in state_dict.items() if k not in quantized}
    swapped = adopt_quantized(model, quantized, dense, dtype, device)
    result = model.load_state_dict(dense, strict=False, assign=True)
    left = sorted(set(result.missing_keys) - swapped)
    if left or result.unexpected_keys:
        raise ValueError(_mismatch("weights not loaded", left) + _mismatch("weights not used", result.unexpected_keys))
    model = model.eval().requires_grad_(False)
    model.fuse_projections()
    return model


def check_state_dict(config, state_dict: dict) -> None:
    """A ValueError unless ``state_dict`` holds exactly the weights ``config``'s model has, in
    its shapes and float where the model's are (a tied lm_head.weight may be there too)."""
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    _check_names_and_shapes(build_on_meta(config), {k: v for k, v in state_dict.items() if k not in tied})


def _check_names_and_shapes(model: nn.Module, state_dict: dict) -> None:
    want = {name: p.shape for name, p in model.named_parameters()}
    missing = sorted(set(want) - set(state_dict))
    extra = sorted(set(state_dict) - set(want))
    if missing or extra:
        raise ValueError(_mismatch("weights missing from the checkpoint", missing)
                         + _mismatch("unexpected weights in the checkpoint", extra))
    for name, shape in want.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise ValueError(f"weight {name} has shape {tuple(state_dict[name].shape)}, "
                             f"the config implies {tuple(shape)}")
        if not (isinstance(state_dict[name], W.QuantTensor) or state_dict[name].is_floating_point()):
            raise ValueError(f"weight {name} is {state_dict[name].dtype}, not a float type")


# ----- quantized weights ---------------------------------------------------------
def quantizable(model: nn.Module) -> set[str]:
    """Parameter names whose module has a quantized twin: linear layers, embeddings, experts."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            names.add(f"{prefix}.weight")
        elif isinstance(module, Experts):
            names |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    return {n for n in names if not n.endswith(KEEP_DENSE)}


def quantize_matrices(model: nn.Module, state_dict: dict, wtype: W.WeightType) -> dict:
    """Dense matrices of ``quantizable`` modules -> QuantTensors of ``wtype`` (ggml's reference
    encoder); rows that are not whole blocks stay dense, as llama.cpp's converter leaves them."""
    out = dict(state_dict)
    for name in quantizable(model) & set(state_dict):
        t = state_dict[name]
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape[-1] % wtype.block_size == 0:
            out[name] = W.QuantTensor.quantize(t, wtype)
    return out


def adopt_quantized(model: nn.Module, quantized: dict, dense: dict, dtype: torch.dtype, device) -> set[str]:
    """Swap each module owning a QuantTensor for its quantized twin; returns the names adopted.
    A QuantTensor for a module without a twin is expanded to float (small tensors only
    reach here: ``quantizable`` and the GGUF reader keep norms, convs and routers dense)."""
    quantized = {k: W.QuantTensor(v.data.to(device), v.wtype, v.cols, v.input_index) for k, v in quantized.items()}
    adopted = set()
    for prefix, module in list(model.named_modules()):
        twin = _quantized_twin(module, prefix, quantized, dense, dtype)
        if twin is not None:
            _replace(model, prefix, twin)
            adopted |= {f"{prefix}.{n}" for n, _ in twin.named_parameters()}
    for name in set(quantized) - adopted:
        dense[name] = quantized[name].dequantize().to(dtype)
    return adopted


def _quantized_twin(module: nn.Module, prefix: str, quantized: dict, dense: dict, dtype) -> nn.Module | None:
    weight = quantized.get(f"{prefix}.weight")
    if isinstance(module, nn.Linear) and weight is not None:
        return W.QuantLinear(weight, dense.pop(f"{prefix}.bias", None))
    if isinstance(module, nn.Embedding) and weight is not None:
        return W.QuantEmbedding(weight, dtype)
    names = (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
    if isinstance(module, Experts) and any(n in quantized for n in names):
        gate_up, down = (quantized[n] if n in quantized else dense.pop(n) for n in names)
        return W.QuantExperts(gate_up, down)
    return None


def _replace(model: nn.Module, prefix: str, module: nn.Module) -> None:
    parent, _, attr = prefix.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _common_dtype(sd: dict) -> torch.dtype:
    """The checkpoint's dominant float dtype (by element count); quantized tensors count as
    float32, what their blocks decode to (so a Q8_0 GGUF computes as its dequantized twin)."""
    counts: dict[torch.dtype, int] = {}
    for t in sd.values():
        if isinstance(t, W.QuantTensor) or t.is_floating_point():
            dtype = torch.float32 if isinstance(t, W.QuantTensor) else t.dtype
            counts[dtype] = counts.get(dtype, 0) + t.shape.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _mismatch(what: str, names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{what}: {shown}. "
