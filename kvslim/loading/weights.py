"""Put a normalised state dict into a freshly built model, with clear errors."""
from __future__ import annotations

import torch

from ..models import build
from ..models.base import CausalLM


def instantiate(config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu") -> CausalLM:
    """Build the model for ``config`` without allocating, then adopt the checkpoint's tensors."""
    with torch.device("meta"):
        model = build(config)
    want = {name: p.shape for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    missing = sorted(set(want) - set(state_dict))
    extra = sorted(set(state_dict) - set(want))
    if missing or extra:
        raise ValueError(_mismatch("weights missing from the checkpoint", missing)
                         + _mismatch("unexpected weights in the checkpoint", extra))
    for name, shape in want.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise ValueError(f"weight {name} has shape {tuple(state_dict[name].shape)}, "
                             f"the config implies {tuple(shape)}")
    dtype = dtype or _common_dtype(state_dict)
    tensors = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
               for k, v in state_dict.items()}
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _common_dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    """The checkpoint's dominant float dtype (by element count)."""
    counts: dict[torch.dtype, int] = {}
    for t in sd.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _mismatch(what: str, names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"{what}: {shown}. "
