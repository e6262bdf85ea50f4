"""Where the model must fit: a GPU from the hardware catalog, a memory size (``--mem``), or
this machine."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from ..cache.config import available_memory
from . import catalog


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
    return available_memory("cpu")
