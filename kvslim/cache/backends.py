"""Attention backends: who stores a layer's new K/V and attends, for a whole flat batch.

The model makes one call per attention layer per step (``KVCache.forward``);
the backend chosen at load does the work. ``torch`` is the portable one (any
device torch runs on); ``reference`` stores row by row and attends with the
plain reference, one sequence at a time: the oracle that parity tests and
``--attn-backend reference`` compare against. Faster backends (Triton on GPUs,
a CPU-optimised one) register here under their own names.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..gpu.swiglu import gated
from .attention import attend_batch, attend_reference

DEFAULT_BACKEND = "torch"


class AttentionBackend(Protocol):
    name: str
    torch_decode: bool         # its decode steps are the torch backend's: the C decode step may replace them

    def forward(self, cache, batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """Store k/v (N, Hkv, D) of every row, then attend: q (N, H, D) -> float32 (N, H, D); with
        ``gate`` (N, H, D), gated attention's, the output times sigmoid(gate) in the gate's type
        (``attention.gated``'s numbers; a kernel may fold it into its store)."""


class TorchBackend:
    """One encode and one scatter for the batch's K/V, block-wise attention over the pool."""

    name = "torch"
    torch_decode = True

    def forward(self, cache, batch, q, k, v, gate=None):
        cache.store_batch(batch, k, v)
        return attend_batch(cache, batch, q, gate=gate)


class BF16Backend(TorchBackend):
    """The torch backend, with half-precision dot products where a kernel has them (scores,
    softmax and sums stay float32). On the CPU, prompt chunks' attention in the C kernel that
    rounds the operands to bf16 (AVX512_BF16): about 2.5x the float32 GEMMs at depth; decode
    steps and machines without AVX512_BF16 run as ``torch``. On a GPU with the Triton kernels,
    prefill and decode take their products on tensor cores with f16 operands
    (``attention.KERNEL_DOTS``), as llama.cpp and vLLM do. Not the default: rounding keys to
    8 significant bits is an error of the size of q8_0's, which the quality tools should not
    add to the format they measure (``kvslim serve`` takes it)."""

    name = "bf16"

    def forward(self, cache, batch, q, k, v, gate=None):
        cache.store_batch(batch, k, v)
        return attend_batch(cache, batch, q, dot="bf16", gate=gate)


class ReferenceBackend:
    """Segment by segment: store, then decode the whole history and attend (slow, obviously right)."""

    name = "reference"
    torch_decode = False

    def forward(self, cache, batch, q, k, v, gate=None):
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for seg in batch.segments:
            rows = slice(seg.begin, seg.end)
            cache.store(seg.slot, k[rows], v[rows])
            out[rows] = attend_reference(cache, seg.slot, q[rows])
        return out if gate is None else gated(out, gate)


_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    """Make ``backend`` selectable by its name (``--attn-backend NAME``)."""
    _BACKENDS[backend.name] = backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str | AttentionBackend | None = None) -> AttentionBackend:
    """The backend called ``name`` (default: torch); raises ValueError listing the valid names."""
    if name is None:
        return _BACKENDS[DEFAULT_BACKEND]
    if not isinstance(name, str):
        return name
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(backend_names())}")
    return _BACKENDS[name]


register_backend(TorchBackend())
register_backend(BF16Backend())
register_backend(ReferenceBackend())
