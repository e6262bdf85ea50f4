"""Plain float KV types: f32, f16, bf16 (stored as their raw little-endian bytes)."""
from __future__ import annotations

import torch

from .base import FP16_MAX, KernelEncoder, KernelRow, KVFormat

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class FloatFormat(KVFormat):
    """Unquantized storage; encode is a cast, decode a cast back to float32."""

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    def _check_head_dim(self, head_dim: int) -> None:
        pass  # any row length

    def _layout(self, head_dim: int) -> tuple[int, int]:
        return head_dim, 1

    def kernel_row(self, head_dim: int) -> KernelRow:
        return KernelRow(self.name, 8 * self.dtype.itemsize)

    def kernel_encoder(self, head_dim: int) -> KernelEncoder:
        return KernelEncoder("float", float_type=self.name, limit=self._max_abs() or 0.0)

    def _max_abs(self) -> float | None:
        # f16 overflows to inf past 65504: refuse rather than store inf silently.
        return FP16_MAX if self.name == "f16" else None

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.dtype).contiguous()
        return y.view(torch.uint8).reshape(*x.shape[:-1], -1)

    def _decode(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        # copy=True: for f32 a plain view would alias the stored bytes.
        return packed.contiguous().view(self.dtype).to(torch.float32, copy=True)
