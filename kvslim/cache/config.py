"""The cache's typed configuration: parsed once at the edge (CLI, ``kvslim.load``, the
server), then handed down unchanged to the model's ``make_cache``."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .. import formats
from ..formats import KVFormat
from .kv import DEFAULT_PAGE_SIZE


@dataclass(frozen=True)
class CacheConfig:
    """How every layer's cache is built.

    Attributes:
        ctx: tokens per slot (sequence).
        n_slots: sequences held at once (llama.cpp's -np).
        type_k, type_v: K and V formats, chosen independently (already parsed).
        page_size: tokens per page of the KV pool.
        f16_window: newest tokens per slot kept in f16 before they are packed.
        backend: attention backend name (``kvslim.cache.backends``).
        device: where every cache tensor lives.
    """

    ctx: int
    n_slots: int = 1
    type_k: KVFormat = field(default_factory=lambda: formats.get("f16"))
    type_v: KVFormat = field(default_factory=lambda: formats.get("f16"))
    page_size: int = DEFAULT_PAGE_SIZE
    f16_window: int = 0
    backend: str = "torch"
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        for name, role in (("type_k", "k"), ("type_v", "v")):
            value = getattr(self, name)
            if isinstance(value, str):                                  # V may rotate in other blocks than K
                object.__setattr__(self, name, formats.get(value, role=role))
        object.__setattr__(self, "device", torch.device(self.device))
        if self.ctx < 1 or self.n_slots < 1 or self.page_size < 1 or self.f16_window < 0:
            raise ValueError(f"cache needs ctx >= 1, n_slots >= 1, page_size >= 1 and f16_window >= 0; got "
                             f"ctx={self.ctx}, n_slots={self.n_slots}, page_size={self.page_size}, "
                             f"f16_window={self.f16_window}")
        from .backends import get_backend
        get_backend(self.backend)                                      # unknown names fail here, listed

    def with_types(self, type_k: str | KVFormat, type_v: str | KVFormat) -> "CacheConfig":
        return replace(self, type_k=type_k, type_v=type_v)


def available_memory(device: torch.device | str) -> int | None:
    """Bytes that can still be allocated on ``device``: a CUDA device's free memory, the RAM
    Linux reports available (MemAvailable) for the CPU; None where it is not known (MPS, other
    systems), and then nothing is checked before allocating."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_room(config: "CacheConfig", need: int) -> None:
    """ValueError naming the settings when the caches ``config`` describes (``need`` bytes,
    preallocated for every slot's whole context) cannot fit in what ``device`` has left: a
    clear refusal instead of the allocator's failure deep inside torch."""
    free = available_memory(config.device)
    if free is not None and need > free:
        gib = 2 ** 30
        raise ValueError(f"the caches for {config.ctx} tokens x {config.n_slots} slot(s) with K/V "
                         f"{config.type_k.name}/{config.type_v.name} need {need / gib:.2f} GiB, more than the "
                         f"{free / gib:.2f} GiB {config.device} has free; lower -c or -np, or take a smaller "
                         f"cache type (`kvslim plan` shows what fits)")

