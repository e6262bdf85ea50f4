"""kvslim's C kernels for the CPU, built on first use and called through ctypes.

- ``block_linear``: x @ W.T for weights kept as ggml blocks (decode's GEMV).
- ``paged_attention``: one query token per sequence over packed K/V pages.

Each has a pure-torch path beside it that the parity tests hold it to; ``build`` compiles
the C files with the machine's compiler into ``~/.cache/kvslim/native/`` and returns None
without a compiler or with ``KVSLIM_NATIVE=0``, and callers then keep the torch path.
"""
from . import block_linear, paged_attention
from .build import cache_dir

__all__ = ["block_linear", "cache_dir", "paged_attention"]
