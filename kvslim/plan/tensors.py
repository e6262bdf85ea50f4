"""The weights a model has, as a GGUF file names and shapes them, read off the model itself
(built on the meta device, no memory) and mapped through ``gguf.names``; parameter counts."""
from __future__ import annotations

from dataclasses import dataclass

from .. import models
from ..gguf import names


@dataclass(frozen=True)
class WeightTensor:
    """One weight as a GGUF file would store it."""

    name: str                 # llama.cpp's name without ".weight", e.g. "blk.3.ffn_down_exps"
    layer: int                # -1 outside the blocks
    rows: int                 # output features
    cols: int                 # input features: the row quantized in blocks
    experts: int = 1          # routed experts stacked in one tensor
    quantizable: bool = True  # vectors, routers and conv kernels stay f32
    sharded: bool = True      # split across tensor-parallel GPUs (else replicated)

    @property
    def params(self) -> int:
        return self.experts * self.rows * self.cols

    @property
    def role(self) -> str:
        """llama.cpp's category for type choice: attn_v, ffn_down, attn_output, output, token_embd."""
        base = self.name.split(".")[-1]
        if base in ("attn_v", "attn_qkv"):
            return "attn_v"
        return "ffn_down" if base.startswith("ffn_down") else base


def _weight_tensor(name: str, shape: tuple[int, ...]) -> WeightTensor:
    """A GGUF tensor from its name and (experts, rows, cols) shape; 1-D tensors are one row."""
    *experts, rows, cols = (1, *shape) if len(shape) == 1 else shape
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    return WeightTensor(name.removesuffix(".weight"), layer, rows, cols, experts[0] if experts else 1,
                        quantizable=not names.stays_f32(name, len(shape)),
                        sharded=len(shape) > 1 and not name.endswith(names.ROUTERS))


def weight_tensors(c) -> list[WeightTensor]:
    """Every weight of the text decoder as a GGUF file names and shapes it, in the model's
    layer order: the model's own parameters (built on the meta device) mapped through
    ``gguf.names``. Vision towers and MTP heads are not counted: llama-server loads neither
    with the decoder, and kvslim's models have none."""
    arch = names.gguf_arch(c.model_type)
    return [_weight_tensor(name, shape) for hf_name, hf_shape in models.parameter_shapes(c).items()
            for name, shape in names.tensor_shapes(arch, hf_name, hf_shape)]


def parameter_counts(c) -> tuple[int, int]:
    """(total, active per token) parameters; active counts top-k of the routed experts and,
    by the usual convention, the embeddings."""
    tensors = weight_tensors(c)
    active = sum(t.params if t.role == "token_embd" else read_share(c, t, t.params) for t in tensors)
    return sum(t.params for t in tensors), active


def read_share(c, t: WeightTensor, size: int) -> int:
    """Of ``size`` bytes of ``t``, what one decoded token reads: the top-k routed experts,
    one embedding row, everything else."""
    if t.role == "token_embd":
        return size // t.rows
    return size * c.num_experts_per_tok // t.experts if t.experts > 1 else size
