"""Host values onto the device without stalling it, and waiting for a device on purpose.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and CUDA makes such a
copy synchronous: the host waits until every kernel queued before it has run. Done per layer,
that empties the GPU's queue dozens of times a token (and it cannot be recorded into a CUDA
graph). ``to_device`` stages the values in pinned memory and copies asynchronously, in stream
order, so the host runs ahead; torch's pinned-memory cache keeps the staging block until the copy
has completed. On the CPU it is ``torch.tensor``.
"""
from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list of numbers, or a CPU tensor) as a tensor on ``device``, copied without a sync."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def synchronize(device: torch.device | str) -> None:
    """Wait until ``device`` has run its queued work (a no-op on the CPU): before a clock is read,
    a GPU runs behind the host, and the time would be the launches', not the work's."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
