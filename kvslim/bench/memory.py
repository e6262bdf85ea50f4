"""Peak resident memory around a piece of work (Linux: VmHWM after a reset).

Writing 5 to /proc/self/clear_refs resets the high-water mark to the current
RSS, so the peak seen afterwards belongs to the work in between. Elsewhere the
figures are reported as unknown (-1) rather than guessed.
"""
from __future__ import annotations

import ctypes

import torch

from ..devices import synchronize


def rss_kib(field: str = "VmRSS") -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def reset_peak() -> bool:
    """Release freed heap to the OS, then reset VmHWM; False where unsupported."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """``with peak: work()`` then ``peak.peak_bytes`` (max over all uses) and ``peak.extra_bytes``."""

    def __init__(self):
        self.peak_bytes, self.extra_bytes = -1, -1

    def __enter__(self):
        self._ok = reset_peak()
        self._before = rss_kib("VmRSS")
        return self

    def __exit__(self, *exc):
        if self._ok:
            hwm = rss_kib("VmHWM") * 1024
            self.peak_bytes = max(self.peak_bytes, hwm)
            self.extra_bytes = max(self.extra_bytes, hwm - self._before * 1024)
        return False


class PeakDevice:
    """PeakRSS's interface for a CUDA device: the most bytes torch's allocator held during the work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes, self.extra_bytes = -1, -1

    def __enter__(self):
        synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._before = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.peak_bytes = max(self.peak_bytes, peak)
        self.extra_bytes = max(self.extra_bytes, peak - self._before)
        return False


def peak_meter(device: torch.device):
    """Where a piece of work's peak memory is read: the GPU's allocator, or the process's RSS."""
    return PeakDevice(device) if torch.device(device).type == "cuda" else PeakRSS()
