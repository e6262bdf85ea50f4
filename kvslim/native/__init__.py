"""kvslim's C kernels for the CPU, built on first use and called through ctypes.

- ``block_linear``: x @ W.T for weights kept as ggml blocks (decode's GEMV).
- ``paged_attention``: one query token per sequence over packed K/V pages.
- ``prefill_attention``: a prompt chunk's attention with bf16 dot products (``--attn-backend bf16``).
- ``kv_encode``: K/V rows into a format's bytes (the decode step's and prompts' encoders), and
  the rotated formats' Walsh-Hadamard butterfly.
- ``delta_rule``: a prompt through a Gated DeltaNet layer's recurrence.
- ``decode_step.c`` (driven by ``kvslim/engine/native_step.py``): a whole decode step.

Each has a pure-torch path beside it that the parity tests hold it to; ``build`` compiles
the C files with the machine's compiler into ``~/.cache/kvslim/native/`` and returns None
without a compiler or with ``KVSLIM_NATIVE=0``, and callers then keep the torch path.
"""
from . import block_linear, paged_attention
from .build import cache_dir

__all__ = ["block_linear", "cache_dir", "paged_attention"]
