"""The engine's typed configuration, built once (from argparse, ``kvslim.load`` or the
server's options) and handed down unchanged."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..cache import CacheConfig


def default_device() -> torch.device:
    """``cuda`` when torch sees a GPU, else ``mps`` on Apple silicon, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """A ``--device`` value (cpu, cuda, cuda:N, mps; None: the default) checked against this
    machine, or a ValueError that says what is missing."""
    if name is None or name == "auto":
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {name!r} ({err}); use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                             f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        if device.index is not None:
            # Triton and fla-core launch on the current CUDA device, not on their tensors' device
            torch.cuda.set_device(device)
    elif device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"--device {name}: the MPS backend is not available on this machine")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {name}: kvslim runs on cpu, cuda or mps, not {device.type}")
    return device


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`Engine` is built from.

    Attributes:
        cache: context per slot, slots, K/V formats, pages, window, backend, device.
        n_ubatch: tokens per forward pass while reading prompts (llama.cpp's -ub).
        prefix_cache: keep released slots' contents for prompts that share a prefix.
        max_checkpoints, checkpoint_bytes, checkpoint_interval: DeltaNet checkpoints for prefix reuse.
        compile: decode steps through ``torch.compile`` (see ``decode_step.py``); prefill stays eager.
        native: decode steps in C where the model, weights and K/V formats allow (``native_step.py``);
            else the compiled or eager step.
        cuda_graphs: decode steps replayed from CUDA graphs (``cuda_graphs.py``); None (the
            default): where the device is CUDA.
        draft_max: speculative decoding from prompt-lookup drafts of up to this many tokens
            (``speculative.py``; llama.cpp's --draft-max); 0: off.
    """

    cache: CacheConfig
    n_ubatch: int = 512
    prefix_cache: bool = False
    max_checkpoints: int = 8
    checkpoint_bytes: int = 256 << 20
    checkpoint_interval: int = 4096
    compile: bool = False
    native: bool = True
    cuda_graphs: bool | None = None
    draft_max: int = 0

    def __post_init__(self):
        if self.n_ubatch < 1:
            raise ValueError(f"n_ubatch (-ub) must be at least 1, got {self.n_ubatch}")
        if self.draft_max < 0:
            raise ValueError(f"draft_max (--draft-max) must be 0 (off) or positive, got {self.draft_max}")

    @classmethod
    def build(cls, ctx: int = 4096, n_parallel: int = 1, type_k="f16", type_v="f16", *, page_size: int | None = None,
              f16_window: int = 0, backend: str = "torch", device=None, **engine) -> "EngineConfig":
        """Keyword construction: cache fields and engine fields in one call."""
        cache = dict(ctx=ctx, n_slots=n_parallel, type_k=type_k, type_v=type_v, f16_window=f16_window,
                     backend=backend, device=resolve_device(device))
        if page_size is not None:
            cache["page_size"] = page_size
        return cls(CacheConfig(**cache), **engine)

    # shorthands the tools print
    @property
    def ctx(self) -> int:
        return self.cache.ctx

    @property
    def n_parallel(self) -> int:
        return self.cache.n_slots

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def with_cache_types(self, type_k, type_v) -> "EngineConfig":
        return replace(self, cache=self.cache.with_types(type_k, type_v))
