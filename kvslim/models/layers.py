"""Blocks shared by the model files: norms, RoPE, MLPs, mixture of experts and
the attention block that reads and writes the compressed KV cache.

Parameter names mirror Hugging Face's (``q_proj``, ``gate_up_proj``, ...) so a
checkpoint's state dict loads without a renaming table.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import gpu
from ..gpu import add_norm as gpu_add_norm
from ..gpu import gated_norm as gpu_gated_norm
from ..gpu import quant_matmul as gpu_weights
from ..gpu import moe as gpu_moe
from ..gpu import rope as gpu_rope
from ..gpu import swiglu as gpu_swiglu
from .batch import Batch


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. ``zero_centered``: the weight is stored as ``w - 1``
    (Qwen3.5 / Qwen3-Next: multiply by ``1 + w``), else plain ``w`` (Llama, Qwen3)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self._shifted: tuple = ((), None, None)    # (the weight's identity, 1 + w, its storage): fused_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.fused_norm(x)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (y * (1.0 + self.weight.float())).type_as(x)
        return self.weight * y.type_as(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + delta, x + delta): a residual add and the norm after it, in one
        launch where the GPU kernels run (``gpu.add_norm``; rows of x and delta contiguous).
        ``delta`` None: nothing to add (the first layer's input); ``Normed``: added and normed
        already (by the block that made it: ``AddNorm``)."""
        if delta is None:
            return self(x), x
        if isinstance(delta, Normed):
            return delta.normed, x
        if gpu.TRITON and x.dim() == 2 and x.stride(-1) == 1 and delta.stride(-1) == 1 and gpu_add_norm.runs_on(x):
            weight = self.shifted_weight() if self.zero_centered else self.weight   # any float type: read as float32
            return gpu_add_norm.add_rms_norm(x, delta, weight, self.eps)
        x = x + delta
        return self(x), x

    def fused_norm(self, x: torch.Tensor) -> torch.Tensor:
        """``fused_rms_norm`` with this norm's weight (1 + w when zero-centred)."""
        return fused_rms_norm(x, self.shifted_weight() if self.zero_centered else self.weight, self.eps)

    def shifted_weight(self) -> torch.Tensor:
        """1 + w, computed again only when the weight is another tensor or was written in place
        (its storage, offset, dtype, device or version counter moved; the cache holds the old
        storage, so no new one can take its address): a launch saved at every call, a hundred a
        decode step on a GPU. Under torch.compile, and for an inference tensor (which keeps no
        version counter), it is computed at each call. A CUDA graph captured after a warm-up
        replays the cached tensor, so a weight written in place after capture is not seen by
        the graph (as a captured step sees no new weight tensor either)."""
        w = self.weight
        if torch.compiler.is_compiling() or w.is_inference():
            return w + 1.0
        storage = w.untyped_storage()
        identity = (storage._cdata, w.storage_offset(), w.dtype, w.device, w._version)
        if self._shifted[0] != identity:
            with torch.no_grad():
                self._shifted = identity, w + 1.0, storage
        return self._shifted[1]


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's own RMSNorm over the last dim: on CUDA one kernel (``aten::_fused_rms_norm``,
    float32 inside) where the forms here launch ~8, a hundred times a decode step. The weight
    in x's dtype: in bf16 the result can differ from those forms by one rounding (they round
    the normalised x, then its product with the weight; this rounds once)."""
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


class RMSNormGated(nn.Module):
    """DeltaNet output norm: plain weight, then gated by ``silu(z)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if gpu.TRITON and x.dim() == 3 and gpu_gated_norm.runs_on(x):   # one launch, z read where it lies
            return gpu_gated_norm.gated_rms_norm(x, z, self.weight, self.eps)
        if x.is_cuda:
            y = fused_rms_norm(x, self.weight, self.eps)
        else:
            xf = x.float()
            y = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return (y * F.silu(z.float())).type_as(x)


# ----- rotary position embedding ------------------------------------------------
class Rope:
    """Rotary tables for the first ``rot_dim`` dims of each head (partial RoPE),
    half-split convention (``rotate_half``), as in Hugging Face's Llama and Qwen."""

    def __init__(self, head_dim: int, theta: float, partial_factor: float = 1.0, scaling: dict | None = None):
        self.rot_dim = int(head_dim * partial_factor)
        if self.rot_dim % 2:
            raise ValueError(f"rotary dimension {self.rot_dim} must be even")
        steps = torch.arange(0, self.rot_dim, 2, dtype=torch.float, device="cpu")   # not meta, even inside a meta build
        inv_freq = 1.0 / (theta ** (steps / self.rot_dim))
        self.inv_freq = _scaled_inv_freq(inv_freq, scaling or {})
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}      # copied to a device once, not per call

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (N, rot_dim) for absolute ``positions`` (N,)."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on.setdefault(positions.device, self.inv_freq.to(positions.device))
        if gpu.TRITON and gpu_rope.runs_on(positions):        # one launch, where the torch form's are seven
            return gpu_rope.tables(positions, inv_freq, dtype)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, ramp, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D); cos/sin (N, rot_dim) applied to the first rot_dim dims."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


# ----- projections that read the same input ------------------------------------
class Fused:
    """Several linears on one input as few matmuls: those of one kind (``fusion_key``: plain
    dense ones of one dtype, or quantized ones of one block type and width, each all with or
    all without bias) as one matmul a kind. Decode runs one token per step, so per-call
    overhead, not FLOPs, dominates small layers: fewer, wider calls win (a 35B-A3B decode step
    on a GPU: 311 quantized GEMVs unfused, 161 fused). A GGUF's mix of types (a Q6_K v_proj
    beside Q4_K q and k) fuses what shares a type. The members' weights become views of their
    kind's tensor, so no memory is added and state dicts are unchanged."""

    def __init__(self, linears: list[nn.Module]):
        self.sizes = [m.out_features for m in linears]
        kinds: dict = {}
        for i, m in enumerate(linears):
            kinds.setdefault(fusion_key(m), []).append(i)
        self.groups = [(members, _one_matmul([linears[i] for i in members])) for members in kinds.values()]

    @staticmethod
    def possible(linears: list) -> bool:
        """Every linear has a kind and two or more share one."""
        keys = [fusion_key(m) for m in linears]
        return None not in keys and len(set(keys)) < len(keys)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = [None] * len(self.sizes)
        for members, matmul in self.groups:
            for i, y in zip(members, matmul(x)):
                out[i] = y
        return tuple(out)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(first) * second of a fused [gate, up] pair in one launch where its one matmul
        can (``QuantLinear.fuse_rows``'s on the GPU kernels: in the GEMV or its split sums), in
        x's type; None where it cannot (call the pair, then ``swiglu``)."""
        if len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]:
            return None
        act = getattr(self.single(), "swiglu", None)
        return act(x) if act is not None else None

    def single(self):
        """The one matmul of all the members, rows in their order, where they are one kind; else None."""
        return self.groups[0][1] if len(self.groups) == 1 else None


def fusion_key(m: nn.Module):
    """What linears must share to be one matmul; None for a module that cannot join one. A plain
    nn.Linear: its dtype, device and whether it has a bias; another module answers for itself
    (``kvslim.weights.QuantLinear.fusion_key``)."""
    if type(m) is nn.Linear:
        return dense_key(m.weight, m.bias)
    key = getattr(m, "fusion_key", None)
    return key() if callable(key) else None


def dense_key(weight: torch.Tensor, bias: torch.Tensor | None):
    """``fusion_key`` of a dense matrix: its dtype, its device and whether it has a bias."""
    return "dense", weight.dtype, weight.device, bias is None


def _one_matmul(linears: list[nn.Module]):
    """x -> the linears' outputs, in one matmul: a lone linear is called as it is; dense ones are
    concatenated (``concatenated``); others concatenate themselves (``fuse_rows``)."""
    if len(linears) == 1:
        return lambda x: (linears[0](x),)
    if type(linears[0]) is not nn.Linear:
        return type(linears[0]).fuse_rows(linears)
    weight, bias = concatenated(linears)
    sizes = [m.out_features for m in linears]
    return lambda x: torch.split(F.linear(x, weight, bias), sizes, dim=-1)


def concatenated(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights (their rows, whatever their dtype: float, or uint8 blocks) and biases
    concatenated; each linear's weight and bias then become views of them."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    start = 0
    for m in linears:
        rows = slice(start, start + m.weight.shape[0])
        m.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[rows], requires_grad=False)
        start = rows.stop
    return weight, bias


def fuse(module: nn.Module, names: list[str]) -> Fused | None:
    linears = [getattr(module, n) for n in names]
    return Fused(linears) if Fused.possible(linears) else None


class AddNorm(NamedTuple):
    """What a decoder layer does with a block's output: the residual x plus it, then ``norm`` of
    the sum (the mixer's: the post-attention norm; the MLP's: the next layer's input norm). The
    block returns (normed, summed) for it, from its last GEMV's launch where it can (``project``)."""
    x: torch.Tensor
    norm: RMSNorm

    def apply(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm.add_forward(self.x, delta)

    def kernel_args(self, delta_shape: tuple, dtype: torch.dtype) -> tuple | None:
        """(residual, weight, eps) for a GEMV's ``add_norm`` with an output of ``delta_shape`` and
        ``dtype``; None where the kernels cannot take it here (the caller applies it)."""
        x = self.x
        if (not gpu_weights.ADD_NORM_IN_GEMV or x.dim() != 2 or tuple(x.shape) != tuple(delta_shape)
                or x.dtype != dtype or x.stride(-1) != 1):
            return None
        norm = self.norm
        return x, norm.shifted_weight() if norm.zero_centered else norm.weight, norm.eps


class Normed(NamedTuple):
    """A block's output already added to the residual and normed by the next norm (``AddNorm``):
    ``RMSNorm.add_forward`` hands it back as it is."""
    normed: torch.Tensor


def project(linear: nn.Module, h: torch.Tensor, then: AddNorm | None = None):
    """linear(h); with ``then``, (normed, summed) = then.apply(linear(h)): in the projection's
    own launch where it can (a quantized linear's GEMV with the kernels on, ``QuantLinear.add_norm``:
    80 launches fewer a 35B-A3B decode step with the mixture's), not where hooks watch the linear
    (they would miss its call)."""
    if then is None:
        return linear(h)
    fold = getattr(linear, "add_norm", None)
    hooked = bool(linear._forward_hooks or linear._forward_pre_hooks)
    out = fold(h, then) if fold is not None and not hooked else None
    return out if out is not None else then.apply(linear(h))


# ----- feed-forward -------------------------------------------------------------
class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.fused = None

    def fuse_projections(self) -> None:
        self.fused = fuse(self, ["gate_proj", "up_proj"])

    def forward(self, x: torch.Tensor, then: AddNorm | None = None):
        """down(silu(gate(x)) * up(x)); with ``then``, (normed, summed) of it (``project``)."""
        h = self.fused.swiglu(x) if self.fused else None              # the activation in the GEMV's launch
        if h is None:
            gate, up = self.fused(x) if self.fused else (self.gate_proj(x), self.up_proj(x))
            h = swiglu(gate, up, x.dtype)
        return project(self.down_proj, h, then)


def swiglu(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up in ``dtype``: one launch where the GPU kernels run (``gpu.swiglu``: float32
    inside, rounded once), else the torch form, the reference."""
    if gpu.TRITON and gate.dim() == 2 and gpu_swiglu.runs_on(gate):
        return gpu_swiglu.silu_mul(gate, up, dtype)
    return (F.silu(gate) * up).to(dtype)


class Router(nn.Module):
    """Softmax router over experts, top-k (optionally renormalised)."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(F.linear(x, self.weight), x.dtype)

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> the weights (N, top_k) of ``dtype`` and the experts' ids."""
        if gpu.TRITON and gpu_moe.routes(logits):                    # one launch for what follows
            return gpu_moe.topk_softmax(logits, self.top_k, self.renormalize, dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(dtype), experts


class Experts(nn.Module):
    """All experts' weights fused: gate_up_proj (E, 2I, H), down_proj (E, H, I).
    Only the experts a token routes to are multiplied (``expert`` in the loop, ``pair_products``
    grouped; the quantized version, kvslim.weights.QuantExperts, overrides those and ``groups``)."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(n_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (N, H); weights and experts (N, top_k): the routing. Where ``groups`` says so (a few
        tokens on a GPU; any number with the quantized kernels) ``grouped``, which never asks the
        host which experts were chosen; else ``loop``."""
        if self.groups(x, experts):
            return self.grouped(x, weights, experts)
        return self.loop(x, weights, experts)

    def groups(self, x: torch.Tensor, experts: torch.Tensor) -> bool:
        """Whether ``grouped`` serves this call: on a GPU up to quant_matmul.MAX_GEMV_PAIRS pairs
        (batched products of the gathered matrices), beyond them where the kernels run (the
        grouped GEMM)."""
        if experts.numel() <= gpu_weights.MAX_GEMV_PAIRS:
            return x.device.type == "cuda"
        return gpu.TRITON and gpu_weights.runs_on(x)

    def loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once, on the tokens routed to it (the reference; the host learns
        the chosen ids: one sync per call on a GPU)."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            rows, which = torch.where(experts == e)
            y = self.expert(e, x[rows])
            out.index_add_(0, rows, (y * weights[rows, which, None]).to(out.dtype))
        return out

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every (token, chosen expert) pair at once (``weighted_pairs``), summed in float32."""
        n, top_k = experts.shape
        return self.weighted_pairs(x, weights, experts).view(n, top_k, -1).sum(1).to(x.dtype)

    def combined(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: torch.Tensor,
                 gate: torch.Tensor, then: AddNorm | None = None):
        """The mixture's output with the kernels on: the pairs' weighted outputs
        (``weighted_pairs``) summed per token plus sigmoid(gate) * shared, in x's type, by one
        launch (``gpu.moe.combine``); with ``then``, (normed, summed) of it."""
        out = gpu_moe.combine(self.weighted_pairs(x, weights, experts), experts.shape[1], shared, gate, x.dtype)
        return out if then is None else then.apply(out)

    def with_shared(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: nn.Module,
                    gate: torch.Tensor, then: AddNorm | None = None):
        """The mixture's output with the shared expert MLP ``shared`` computed among the routed
        pairs, where a subclass can (``QuantExperts``); None: not here."""
        return None

    def weighted_pairs(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, chosen expert) pair's output times its routing weight, (N top_k, H)
        float32, token-major, through ``pair_products``, which reads the chosen ids on the
        device; the weights are applied where the down projection is computed (in the kernels:
        no launch of their own)."""
        route = gpu_weights.route(experts.reshape(-1), self.gate_up_proj.shape[0])   # once for both matrices
        return self.pair_products("down", self.pair_activations(x, route), route, weights.reshape(-1))

    def pair_activations(self, x: torch.Tensor, route: gpu_weights.Route) -> torch.Tensor:
        """Each pair's silu(gate) * up in x's type, (P, I), a token's row for its top_k pairs
        (the quantized experts take it in their GEMV's launch)."""
        gate, up = self.pair_products("gate_up", x, route).chunk(2, dim=-1)
        return swiglu(gate, up, x.dtype)

    def pair_products(self, matrix: str, rows: torch.Tensor, route: gpu_weights.Route,
                      scales: torch.Tensor | None = None) -> torch.Tensor:
        """Each pair's row of ``rows`` (one per pair, or per token for its top_k consecutive pairs:
        ``quant_matmul.pairs_per_row``) times its expert's ``matrix`` ("gate_up" or "down") ->
        (P, out) float32, row p times scales[p] if given: for a few pairs the chosen experts'
        matrices gathered by id (top_k per token: a decode step's few megabytes), then batched
        matrix-vector products; for a prompt's, the grouped GEMM over ``route``'s tiles."""
        weight = getattr(self, f"{matrix}_proj")
        if route.tile_expert is None:
            per_row = gpu_weights.pairs_per_row(rows, route.ids)
            rows = rows.repeat_interleave(per_row, dim=0) if per_row > 1 else rows
            y = torch.bmm(weight.index_select(0, route.ids), rows.to(weight.dtype)[:, :, None])[..., 0].float()
            return y if scales is None else y * scales.float()[:, None]
        return gpu_weights.gemm_experts(rows.to(weight.dtype), weight, route, scales=scales)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU on the tokens routed to it: (n, H) -> (n, H)."""
        gate, up = self.project(e, "gate_up", x).chunk(2, dim=-1)
        return self.project(e, "down", F.silu(gate) * up)

    def project(self, e: int, matrix: str, x: torch.Tensor) -> torch.Tensor:
        """x times expert ``e``'s ``matrix`` ("gate_up" or "down")."""
        return F.linear(x, getattr(self, f"{matrix}_proj")[e])


class SparseMoE(nn.Module):
    """Routed experts plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 renormalize: bool = True):
        super().__init__()
        self.gate = Router(hidden, n_experts, top_k, renormalize)
        self.experts = Experts(n_experts, hidden, intermediate)
        self.shared_expert = MLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.fused = self.fused_matrix = None

    def fuse_projections(self) -> None:
        """The shared expert's gate and the router as one matrix (both dense, of one dtype): one
        matmul for the two small products each token starts with (with the kernels on, a decode
        batch's matmul and routing in one launch, ``gpu.moe.router_gemv``)."""
        self.fused = self.fused_matrix = None
        if fusion_key(self.shared_expert_gate) == dense_key(self.gate.weight, None):
            weight, _ = concatenated([self.shared_expert_gate, self.gate])
            self.fused_matrix = weight
            self.fused = lambda x: F.linear(x, weight).split([1, weight.shape[0] - 1], dim=-1)

    def forward(self, x: torch.Tensor, then: AddNorm | None = None):
        """The mixture's output; with ``then``, (normed, summed) of it, from the down projection's
        launch where the kernels can."""
        if self.fused and gpu.TRITON and gpu_moe.routes_in_gemv(x, self.fused_matrix, 1):
            # the matmul, the gate's column and the routing: one launch (a decode batch's)
            gate, weights, experts = gpu_moe.router_gemv(x, self.fused_matrix, 1, self.gate.top_k,
                                                         self.gate.renormalize)
        elif self.fused:
            gate, logits = self.fused(x)
            weights, experts = self.gate.route(logits, x.dtype)
        else:                                                       # each module called (and hooked) as it is
            gate, (weights, experts) = self.shared_expert_gate(x), self.gate(x)
        if gpu.TRITON and x.dim() == 2 and gpu_moe.runs_on(x) and self.experts.groups(x, experts):
            out = self.experts.with_shared(x, weights, experts, self.shared_expert, gate, then)
            if out is not None:                                     # the shared expert among the pairs
                return out
            # the pairs' sum, its cast, the shared expert's gate and the add: one launch, or none
            return self.experts.combined(x, weights, experts, self.shared_expert(x), gate, then)
        shared = self.shared_expert(x)
        out = self.experts(x, weights, experts) + torch.sigmoid(gate) * shared
        return out if then is None else then.apply(out)


# ----- attention over the KV cache ----------------------------------------------
class Attention(nn.Module):
    """GQA attention whose K/V go through the layer's KV cache (any K/V formats).

    ``gated``: Qwen3.5/Qwen3-Next output gate: q_proj emits query and gate
    interleaved per head, output multiplied by sigmoid(gate) before o_proj.
    ``qk_norm``: per-head RMSNorm on q and k before RoPE (None, "plain", "zero_centered").
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, *,
                 qkv_bias: bool = False, o_bias: bool = False, gated: bool = False, qk_norm: str | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.gated = n_heads, n_kv_heads, head_dim, gated
        self.q_proj = nn.Linear(hidden, n_heads * head_dim * (2 if gated else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, zero_centered=qk_norm == "zero_centered")
            self.k_norm = RMSNorm(head_dim, eps, zero_centered=qk_norm == "zero_centered")
        else:
            self.q_norm = self.k_norm = None
        self.fused = None

    def fuse_projections(self) -> None:
        self.fused = fuse(self, ["q_proj", "k_proj", "v_proj"])

    def forward(self, x: torch.Tensor, batch: Batch, cache, rope: tuple[torch.Tensor, torch.Tensor],
                then: AddNorm | None = None):
        """The attention's output projection (N, hidden); with ``then``, (normed, summed) of it
        (``project``)."""
        n = x.shape[0]
        q, k, v = self.fused(x) if self.fused else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(n, self.n_heads, -1)                                 # (N, H, D) or (N, H, 2D) if gated
        gate = None
        if self.gated:
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        k = k.view(n, self.n_kv_heads, self.head_dim)
        v = v.view(n, self.n_kv_heads, self.head_dim)
        if gpu.TRITON and gpu_rope.runs_on(q) and gpu_rope.pairs(q, k, self.q_norm, self.k_norm):
            q, k = gpu_rope.norm_rope_qk(q, k, self.q_norm, self.k_norm, *rope)    # norms and rotations: one launch
        elif gpu.TRITON and gpu_rope.runs_on(q):
            q, k = gpu_rope.norm_rope(q, self.q_norm, *rope), gpu_rope.norm_rope(k, self.k_norm, *rope)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # One call for the whole batch: the cache's backend quantizes K/V into the pool and
        # attends on the packed codes for every sequence at once.
        # the gate in the attention's own launch where a kernel stores the output (a decode step)
        out = cache.forward(batch, q, k, v, gate)                       # gated: x's type; else float32 (N, H, D)
        return project(self.o_proj, out.to(x.dtype).reshape(n, -1), then)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or DeltaNet), then MLP or MoE.
    ``mixer_name`` keeps Hugging Face's attribute name (self_attn / linear_attn)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float,
                 zero_centered: bool):
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered)

    def forward(self, x: torch.Tensor, batch: Batch, cache, rope, delta=None,
                next_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | Normed]:
        """The residual stream x plus ``delta`` (the previous layer's MLP output, not yet added)
        through this layer -> (the stream after the mixer, this layer's MLP output): each add
        is left to the norm that reads its sum (``RMSNorm.add_forward``: one launch where the
        GPU kernels run), the last one to the model's final norm. The same sums as adding at
        once, in the same order. ``next_norm`` (the next layer's input norm, or the model's
        final one): the MLP adds and norms its own output for it (``AddNorm``), in its down
        projection's launch where the kernels can, and the layer returns ``Normed``."""
        mixer = getattr(self, self.mixer_name)
        normed, x = self.input_layernorm.add_forward(x, delta)
        then = AddNorm(x, self.post_attention_layernorm)           # the mixer's output added and normed
        if self.mixer_name == "self_attn":
            normed, x = mixer(normed, batch, cache, rope, then=then)
        else:
            normed, x = mixer(normed, batch, cache, then=then)
        if next_norm is None:
            return x, self.mlp(normed)
        normed, x = self.mlp(normed, then=AddNorm(x, next_norm))
        return x, Normed(normed)
