"""Modules whose weights stay ggml blocks: drop-in for nn.Linear, nn.Embedding and Experts.

The blocks are registered as uint8 parameters under the Hugging Face names
(``q_proj.weight`` is (out, row_bytes) uint8), so state dicts, ``parameters()``
byte counts and ``.device`` keep working; the block type rides along as plain
attributes. Embeddings stay quantized whatever their size (no dense threshold):
a lookup decodes only the rows of the tokens asked for, and a tied output head
multiplies by the same blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import gpu
from ..gpu import quant_matmul as gpu_weights
from ..models.layers import Experts, concatenated
from .matmul import embedding_rows, linear, quant_linear, quant_linear_add_norm
from .tensor import QuantTensor


def _blocks(w: QuantTensor) -> nn.Parameter:
    return nn.Parameter(w.data, requires_grad=False)


class _QuantWeight(nn.Module):
    """Holds ``weight`` (uint8 blocks) and rebuilds the QuantTensor view of it."""

    def __init__(self, w: QuantTensor):
        super().__init__()
        self.weight = _blocks(w)
        self.wtype, self.cols = w.wtype, w.cols
        self.register_buffer("input_index", w.input_index, persistent=False)

    @property
    def quant(self) -> QuantTensor:
        return QuantTensor(self.weight, self.wtype, self.cols, self.input_index)

    def extra_repr(self) -> str:
        return f"{self.wtype.name}, shape={tuple(self.quant.shape)}"


class QuantLinear(_QuantWeight):
    """nn.Linear over a quantized (out_features, in_features) weight."""

    def __init__(self, w: QuantTensor, bias: torch.Tensor | None = None):
        super().__init__(w)
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.quant, self.bias)

    def add_norm(self, x: torch.Tensor, then) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``then`` (``models.layers.AddNorm``) of self(x), the add and the norm in the GEMV's
        launch (``quant_linear_add_norm``); None where it cannot (a bias, a prompt's rows, the
        CPU): the caller adds and norms (``models.layers.project``)."""
        args = then.kernel_args((x.shape[0], self.out_features), x.dtype) if self.bias is None else None
        return None if args is None else quant_linear_add_norm(x, self.quant, *args)

    def fusion_key(self):
        """``models.layers.Fused``: quantized linears of one block type, width and device, all with
        or all without bias, and in the file's column order, are one matmul."""
        if self.input_index is not None:
            return None
        return "quantized", self.wtype.name, self.cols, self.weight.device, self.bias is None

    @staticmethod
    def fuse_rows(linears: list[QuantLinear]) -> "FusedRows":
        """x -> each linear's output from one quant_linear over their blocks concatenated (blocks
        are whole rows, so the concatenation is a valid matrix of the type)."""
        data, bias = concatenated(linears)
        return FusedRows(QuantTensor(data, linears[0].wtype, linears[0].cols), bias, [m.out_features for m in linears])


class FusedRows:
    """Quantized linears' rows as one matrix (``QuantLinear.fuse_rows``): called, each one's
    output; ``swiglu`` for a [gate, up] pair."""

    def __init__(self, matrix: QuantTensor, bias: torch.Tensor | None, sizes: list[int]):
        self.matrix, self.bias, self.sizes = matrix, bias, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(quant_linear(x, self.matrix, self.bias), self.sizes, dim=-1)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up in x's type from the GPU kernels' one launch (``quant_matmul.matmul``'s
        swiglu), for 2-D x on their device; None elsewhere (a bias, the CPU, kernels off)."""
        kind = self.matrix.wtype.ggml_type
        if (self.bias is not None or x.dim() != 2 or not gpu.TRITON or not gpu_weights.SWIGLU_IN_GEMV
                or not gpu_weights.supports(kind) or not gpu_weights.runs_on(x)):
            return None
        return gpu_weights.matmul(x, self.matrix.data, kind, out_dtype=x.dtype, swiglu=True)


class QuantEmbedding(_QuantWeight):
    """nn.Embedding over a quantized (vocab, hidden) table; ``dtype``: the model's activations."""

    def __init__(self, w: QuantTensor, dtype: torch.dtype = torch.float32):
        super().__init__(w)
        self.num_embeddings, self.embedding_dim = w.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_rows(ids, self.quant, self.dtype)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h @ table.T: the tied output head's logits."""
        return quant_linear(h, self.quant)


class QuantExperts(Experts):
    """Experts with either matrix quantized (E, rows, row_bytes blocks) or dense; per token,
    only the routed experts' blocks are decoded (``QuantTensor[e]`` is a view)."""

    def __init__(self, gate_up: QuantTensor | torch.Tensor, down: QuantTensor | torch.Tensor):
        nn.Module.__init__(self)
        self.gate_up_proj, self.gate_up_type = self._adopt(gate_up)
        self.down_proj, self.down_type = self._adopt(down)

    @staticmethod
    def _adopt(w) -> tuple[nn.Parameter, tuple | None]:
        """(parameter, (block type, columns) or None for a dense matrix)."""
        if isinstance(w, QuantTensor):
            if w.input_index is not None:
                raise ValueError("expert weights with reordered columns are not supported quantized")
            return _blocks(w), (w.wtype, w.cols)
        return nn.Parameter(w, requires_grad=False), None

    @staticmethod
    def _matrix(param: nn.Parameter, kind: tuple | None, e: int):
        return param[e] if kind is None else QuantTensor(param[e], *kind)

    def project(self, e: int, matrix: str, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self._matrix(getattr(self, f"{matrix}_proj"), getattr(self, f"{matrix}_type"), e))

    def groups(self, x: torch.Tensor, experts: torch.Tensor) -> bool:
        """The grouped kernels serve every call when they are on and decode both types: the
        expert GEMV for a few pairs, the grouped GEMM for a prompt's."""
        kinds = (self.gate_up_type, self.down_type)
        return (gpu.TRITON and all(k is not None for k in kinds)
                and all(gpu_weights.supports(k[0].ggml_type) for k in kinds) and gpu_weights.runs_on(x))

    def pair_products(self, matrix: str, rows: torch.Tensor, route: gpu_weights.Route,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
        """One launch (``quant_matmul.experts_matmul``): only the chosen experts' blocks read,
        which they are found on the device; the scales applied in the kernel."""
        kind = getattr(self, f"{matrix}_type")
        return gpu_weights.experts_matmul(rows, getattr(self, f"{matrix}_proj"), route, kind[0].ggml_type, scales)

    def combined(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: torch.Tensor,
                 gate: torch.Tensor, then=None):
        """For a decode batch's few pairs, the combine inside the down projection's expert GEMV
        (``quant_matmul.gemv_experts_combined``: the same bits, one launch fewer), and ``then``'s
        add and norm there too where the kernels can."""
        if experts.numel() > gpu_weights.MAX_GEMV_PAIRS or not gpu_weights.SUMS_IN_GEMV or shared.dtype != x.dtype:
            return super().combined(x, weights, experts, shared, gate, then)    # a prompt's: the grouped GEMM
        route = gpu_weights.route(experts.reshape(-1), self.gate_up_proj.shape[0])
        add_norm = _add_norm_args(then, shared)
        out = gpu_weights.gemv_experts_combined(self.pair_activations(x, route), self.down_proj, route.ids,
                                                self.down_type[0].ggml_type, weights.reshape(-1), shared, gate,
                                                add_norm=add_norm)
        return out if then is None or add_norm is not None else then.apply(out)

    def with_shared(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: nn.Module,
                    gate: torch.Tensor, then=None):
        """A decode batch's mixture output with the shared expert MLP ``shared`` as one more pair a
        token in the routed experts' two GEMVs (``quant_matmul.SHARED_AS_PAIR``): the SwiGLU
        pairs (``gemv_experts(shared=)``), then the down projections, the gate and the sum
        (``gemv_mixture_down``). None where that does not apply: a prompt's many pairs, a switch
        off, or a shared expert whose matrices differ from an expert's in type or shape."""
        matrices = self.shared_matrices(shared)
        if (matrices is None or experts.numel() + x.shape[0] > gpu_weights.MAX_GEMV_PAIRS
                or not (gpu_weights.SHARED_AS_PAIR and gpu_weights.SUMS_IN_GEMV and gpu_weights.SWIGLU_IN_GEMV)):
            return None
        ids, (gate_up_type, down_type) = experts.reshape(-1), (self.gate_up_type[0], self.down_type[0])
        h = gpu_weights.gemv_experts(x, self.gate_up_proj, ids, gate_up_type.ggml_type, swiglu=True,
                                     out_dtype=x.dtype, shared=matrices[0])
        add_norm = _add_norm_args(then, x)
        out = gpu_weights.gemv_mixture_down(h, self.down_proj, ids, down_type.ggml_type, weights.reshape(-1),
                                            matrices[1], gate, x.dtype, add_norm=add_norm)
        return out if then is None or add_norm is not None else then.apply(out)

    def shared_matrices(self, shared: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared expert MLP's fused [gate; up] and down blocks where they are one expert's
        (the same block types, columns and rows and device, no bias, file column order), else None."""
        fused, down = getattr(shared, "fused", None), getattr(shared, "down_proj", None)
        fused = fused.single() if fused is not None else None
        if (not isinstance(fused, FusedRows) or fused.bias is not None or not isinstance(down, QuantLinear)
                or down.bias is not None or down.input_index is not None):
            return None
        gate_up, down = fused.matrix, down.quant
        if ((gate_up.wtype, gate_up.cols) != self.gate_up_type or (down.wtype, down.cols) != self.down_type
                or gate_up.data.shape != self.gate_up_proj.shape[1:] or down.data.shape != self.down_proj.shape[1:]
                or gate_up.data.device != self.gate_up_proj.device or down.data.device != self.down_proj.device):
            return None
        return gate_up.data, down.data

    def pair_activations(self, x: torch.Tensor, route: gpu_weights.Route) -> torch.Tensor:
        """silu(gate) * up in the expert GEMV's own launch (``quant_matmul.experts_swiglu``)."""
        if not gpu_weights.SWIGLU_IN_GEMV:
            return super().pair_activations(x, route)
        return gpu_weights.experts_swiglu(x, self.gate_up_proj, route, self.gate_up_type[0].ggml_type)


def _add_norm_args(then, like: torch.Tensor) -> tuple | None:
    """``then``'s (residual, weight, eps) for a down projection whose output has ``like``'s
    shape and type, or None (none asked, or the kernels cannot take it)."""
    return None if then is None else then.kernel_args(tuple(like.shape), like.dtype)


def _unique(tensors):
    """Each stored tensor once: tied heads and shared views are one (storage, offset)."""
    seen = set()
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            yield t


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, shared storage counted once (tied heads)."""
    return sum(t.numel() * t.element_size() for t in _unique([*model.parameters(), *model.buffers()]))


def _stored(model: nn.Module):
    """(parameter, values it stands for, type name) per stored parameter; quantized
    blocks stand for rows x columns values, not for their byte count."""
    kinds = {}
    for module in model.modules():
        if isinstance(module, _QuantWeight):
            kinds[id(module.weight)] = (module.cols, module.wtype.name)
        elif isinstance(module, QuantExperts):
            for param, kind in ((module.gate_up_proj, module.gate_up_type), (module.down_proj, module.down_type)):
                if kind is not None:
                    kinds[id(param)] = (kind[1], kind[0].name)
    for param in _unique(model.parameters()):
        if id(param) in kinds:
            cols, name = kinds[id(param)]
            yield param, param[..., 0].numel() * cols, name
        else:
            yield param, param.numel(), str(param.dtype).removeprefix("torch.")


def parameter_count(model: nn.Module) -> int:
    """Model parameters as values (a quantized matrix counts rows x columns), tied weights once."""
    return sum(values for _, values, _ in _stored(model))


def weight_type_label(model: nn.Module) -> str:
    """The type that holds most of the weights' bytes (llama-bench's model type, e.g. Q4_K)."""
    by_type: dict[str, int] = {}
    for param, _, name in _stored(model):
        by_type[name] = by_type.get(name, 0) + param.numel() * param.element_size()
    return max(by_type, key=by_type.get).upper()
