"""A weight matrix kept as ggml blocks: the bytes a GGUF stores, plus what they mean.

``QuantTensor.data`` is (..., rows, row_bytes) uint8 with rows = output features, each
row a whole number of blocks along the input features, exactly as in the file (often a
memory map of it). The loaders' layout conventions are row operations (split, concat,
reorder rows), which move whole rows of blocks and never touch a value. A reorder of
columns moves whole blocks when it keeps runs of ``block_size`` columns together;
otherwise the matrix keeps the file's column order and the layer gathers its input
features into that order (``input_index``), which is exact and costs one gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from .types import WeightType

ENCODE_ROWS_BYTES = 16 << 20     # float32 bytes quantized per step when encoding


@dataclass
class QuantTensor:
    data: torch.Tensor                         # (..., rows, row_bytes) uint8
    wtype: WeightType
    cols: int                                  # input features (values per row)
    input_index: torch.Tensor | None = None    # (cols,) long: x's features in the file's column order

    # ----- what it looks like -----------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.cols))

    def dim(self) -> int:
        return self.data.dim()

    def is_floating_point(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def __repr__(self) -> str:
        return f"QuantTensor({self.wtype.name}, shape={tuple(self.shape)}, {self.nbytes} bytes)"

    # ----- making one ---------------------------------------------------------------
    @classmethod
    def quantize(cls, values: torch.Tensor, wtype: WeightType) -> QuantTensor:
        """Encode a dense (..., rows, cols) tensor with ggml's reference quantizer."""
        cols = values.shape[-1]
        row_bytes = wtype.row_bytes(cols)
        flat = values.reshape(-1, cols)
        step = max(1, ENCODE_ROWS_BYTES // (4 * cols))
        parts = [wtype.encode(part.float().reshape(-1, wtype.block_size)).reshape(-1, row_bytes)
                 for part in flat.split(step)]
        return cls(torch.cat(parts).reshape(*values.shape[:-1], row_bytes), wtype, cols)

    # ----- values -----------------------------------------------------------------------
    def decode(self, data: torch.Tensor | None = None) -> torch.Tensor:
        """(..., r, row_bytes) blocks (default: all) -> (..., r, cols) float32 in the file's column order."""
        data = self.data if data is None else data
        blocks = data.reshape(-1, self.wtype.block_bytes)
        return self.wtype.decode(blocks).reshape(*data.shape[:-1], self.cols)

    def dequantize(self) -> torch.Tensor:
        """The whole tensor as float32, columns in the model's order (torch decoders)."""
        return self._model_columns(self.decode())

    def reference_dequantize(self) -> torch.Tensor:
        """The same values through ``gguf.quants`` (the oracle the decoders are tested against)."""
        raw = np.ascontiguousarray(self.data.cpu().numpy())
        values = gguf.quants.dequantize(raw, self.wtype.ggml_type)
        return self._model_columns(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))

    def _model_columns(self, w: torch.Tensor) -> torch.Tensor:
        if self.input_index is None:
            return w
        return w.index_select(-1, torch.argsort(self.input_index))

    # ----- layout operations (whole rows or whole blocks only) ----------------------------
    def _like(self, data: torch.Tensor) -> QuantTensor:
        return QuantTensor(data, self.wtype, self.cols, self.input_index)

    def __getitem__(self, i: int) -> QuantTensor:
        """One slice of the leading dim (an expert of (E, rows, cols)): a view, nothing read."""
        return self._like(self.data[i])

    def split(self, sizes: list[int], dim: int = 0) -> list[QuantTensor]:
        self._check_row_dim(dim, "split")
        return [self._like(d) for d in self.data.split(sizes, dim)]

    def reshape(self, *shape: int) -> QuantTensor:
        """Regroup rows; the last dim must stay the input features."""
        if shape[-1] != self.cols:
            raise ValueError(f"a {self.wtype.name} tensor can only regroup whole rows of {self.cols}")
        return self._like(self.data.reshape(*shape[:-1], self.data.shape[-1]))

    def index_select(self, dim: int, index: torch.Tensor) -> QuantTensor:
        dim = dim % self.dim()
        if dim < self.dim() - 1:
            return self._like(self.data.index_select(dim, index))
        return self._select_columns(index.long())

    def _select_columns(self, index: torch.Tensor) -> QuantTensor:
        """Columns reordered: move whole blocks when runs of block_size stay together, else gather inputs."""
        if self.input_index is not None:
            raise ValueError("a quantized tensor's columns can only be reordered once")
        bs = self.wtype.block_size
        runs = index.view(-1, bs)                                   # (blocks per row, bs)
        starts = runs[:, 0]
        if bool((starts % bs == 0).all()) and torch.equal(runs, starts[:, None] + torch.arange(bs)):
            lead = self.data.shape[:-1]
            blocks = self.data.reshape(*lead, -1, self.wtype.block_bytes)
            return QuantTensor(blocks.index_select(-2, starts // bs).reshape(*lead, -1), self.wtype, self.cols)
        return QuantTensor(self.data, self.wtype, self.cols, torch.argsort(index))

    def _check_row_dim(self, dim: int, what: str) -> None:
        if dim % self.dim() == self.dim() - 1:
            raise ValueError(f"cannot {what} a {self.wtype.name} tensor inside its blocks (along its rows' values)")

    @staticmethod
    def cat(parts: list[QuantTensor], dim: int) -> QuantTensor:
        """Concatenate along a row dim (e.g. experts' gate and up rows): same type, same columns."""
        first = parts[0]
        if any(p.wtype != first.wtype or p.cols != first.cols or p.input_index is not None for p in parts):
            kinds = ", ".join(f"{p.wtype.name}{tuple(p.shape)}" for p in parts)
            raise ValueError(f"cannot join quantized tensors of different types or widths: {kinds}")
        first._check_row_dim(dim, "concatenate")
        return first._like(torch.cat([p.data for p in parts], dim))


def cat(parts: list, dim: int):
    """``torch.cat`` for dense tensors, ``QuantTensor.cat`` when the parts are quantized."""
    if any(isinstance(p, QuantTensor) for p in parts):
        if not all(isinstance(p, QuantTensor) for p in parts):
            raise ValueError("cannot join quantized and dense tensors")
        return QuantTensor.cat(parts, dim)
    return torch.cat(parts, dim)
