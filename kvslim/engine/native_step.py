"""The decode step in C (``kvslim/native/decode_step.c``): one call per token for the whole model.

A compiled torch step of the bundled model still costs ~3 ms a token, two thirds of it the
Python wrapper around ~260 kernel and custom-op calls; the arithmetic is ~1.2 ms. This module
describes a loaded model and its caches to the C step once (pointers to the weights, the pools,
the states, the formats' tables), so a token is then one ctypes call.

``NativeStep.build(model, cache)`` returns None, with the reason in ``why_not``, for anything
the C step does not implement: it then falls back to the compiled or eager step. Supported:
Llama-style, Qwen3.5-style and Qwen3-Next decoders (RMSNorm, SwiGLU or a sparse mixture of SwiGLU experts
with a shared expert, GQA attention with optional output gate, q/k norms and partial RoPE;
Gated DeltaNet); every weight type of ``block_linear.c``
and f32/f16/bf16 matrices (activations are float32 whatever the weights' dtype, as in
llama.cpp: a bf16 model decodes as ``--dtype f32 --weights bf16`` would); K/V formats
f32/f16/bf16, q8_0/q4_0/q4_1/q5_0/q5_1/iq4_nl (rotated or not), TurboQuant's MSE variants, the nl
grids (nl4, nl3, nl4s, nl3s) and klt3 V rows (each KV head in its calibrated basis), with or without
an f16 window of the newest tokens; any number of sequences, in calls of MAX_BATCH. The torch model is the reference (``tests/test_native_step.py``).
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from ..cache.kv import KVCache
from ..cache.recurrent import RecurrentStateCache
from ..models.base import CausalLM
from ..models.gemma import EmbeddingScaledLayer, GeGLU
from ..models.layers import MLP, Attention, DecoderLayer, Experts, RMSNorm, Rope, SparseMoE
from ..native import block_linear, build
from ..native.kv_encode import Keep, Unsupported, encoder
from ..weights.modules import QuantExperts
from ..native import paged_attention as native_attention

ACTIVATIONS = {MLP: 0, GeGLU: 1}          # decode_step.c's ACT_SILU, ACT_GELU_TANH

SOURCE = "decode_step.c"
FLOAT_CODES = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 17}   # block_linear.c's float rows
MAX_BATCH = block_linear.MAX_ROWS
MAX_DIM = native_attention.MAX_DIM
MAX_EXPERTS, MAX_TOP_K = 512, 64     # decode_step.c's routing buffers
P = ctypes.c_void_p
I32, I64 = ctypes.c_int32, ctypes.c_int64


class Mat(ctypes.Structure):
    _fields_ = [("type", I32), ("rows", I64), ("cols", I64), ("data", P), ("bias", P), ("perm", P), ("q8", I32)]


class Layer(ctypes.Structure):
    _fields_ = [("mixer", I32), ("in_norm", P), ("post_norm", P), ("gate", Mat), ("up", Mat), ("down", Mat),
                ("q", Mat), ("k", Mat), ("v", Mat), ("o", Mat),
                ("n_heads", I32), ("n_kv", I32), ("head_dim", I32), ("gated", I32), ("q_norm", P), ("k_norm", P),
                ("k_pool", P), ("v_pool", P), ("overflow", P),
                ("pool_pages", I64), ("page_size", I64), ("k_row_bytes", I64), ("v_row_bytes", I64),
                ("table_stride", I64), ("table", P), ("ck", P), ("cv", P), ("ek", P), ("ev", P),
                ("f16_window", I32), ("win_k", P), ("win_v", P),
                ("qkv", Mat), ("z", Mat), ("b", Mat), ("a", Mat), ("out", Mat), ("fused_qkvz", I32),
                ("n_k", I32), ("n_v", I32), ("dk", I32), ("dv", I32), ("conv_k", I32),
                ("conv_w", P), ("dt_bias", P), ("a_log", P), ("gnorm", P), ("conv_state", P), ("rec_state", P),
                ("n_experts", I32), ("top_k", I32), ("renormalize", I32), ("router", Mat), ("shared_gate", Mat),
                ("expert_gate_up", Mat), ("expert_down", Mat), ("gate_up_stride", I64), ("down_stride", I64),
                ("act", I32)]


class Model(ctypes.Structure):
    _fields_ = [("n_layers", I32), ("hidden", I32), ("vocab", I32), ("rot_dim", I32), ("zero_centered", I32),
                ("n_threads", I32), ("eps", ctypes.c_float), ("layers", P), ("embed", Mat), ("head", Mat),
                ("final_norm", P), ("inv_freq", P), ("embed_scale", ctypes.c_float)]


def _library():
    lib = build.library(SOURCE)
    if lib is not None and lib.kvslim_decode_step.argtypes is None:
        lib.kvslim_decode_step.restype = ctypes.c_int
        lib.kvslim_decode_step.argtypes = [ctypes.POINTER(Model), I64, P, P, P, P, P]
    return lib


# ----- weights -------------------------------------------------------------------------------
def matrix(module, keep: Keep, bias: torch.Tensor | None = None) -> Mat:
    """A linear layer's (or an embedding table's) weight as the C step reads it."""
    from ..weights.modules import _QuantWeight
    perm, q8 = None, False
    if isinstance(module, _QuantWeight):
        name = module.wtype.name
        if name not in block_linear.TYPE_CODES:
            raise Unsupported(f"{name} weights")
        rows, q8 = module.weight.shape[0], block_linear.q8_activations(name)
        data, code, cols = module.weight, block_linear.TYPE_CODES[name], module.cols
        if module.input_index is not None:                  # a GGUF's column order: gathered in C
            perm = keep(module.input_index.to(torch.int64).contiguous()).data_ptr()
    elif type(module) in (nn.Linear, nn.Embedding) and module.weight.dtype in FLOAT_CODES:
        data, code = module.weight, FLOAT_CODES[module.weight.dtype]        # read as stored, no copy
        rows, cols = data.shape
    else:
        raise Unsupported(f"a {type(module).__name__} matrix")
    if cols % block_linear.QK:
        raise Unsupported(f"{cols} input features (not whole blocks of {block_linear.QK})")
    if bias is None:
        bias = getattr(module, "bias", None)
    return Mat(code, rows, cols, keep(data.detach().contiguous()).data_ptr(), keep.ptr(bias), perm, q8)


def _norm(norm, keep: Keep, want_zero_centered: bool, eps: float) -> int:
    if type(norm) is not RMSNorm or norm.zero_centered != want_zero_centered or norm.eps != eps:
        raise Unsupported("a norm other than the model's RMSNorm")
    return keep.ptr(norm.weight)


# ----- layers ----------------------------------------------------------------------------
def _mlp(layer: Layer, mlp, keep: Keep) -> None:
    if type(mlp) is SparseMoE:
        _moe(layer, mlp, keep)
        return
    if type(mlp) not in ACTIVATIONS:
        raise Unsupported(f"a {type(mlp).__name__} feed-forward")
    layer.act = ACTIVATIONS[type(mlp)]
    layer.gate, layer.up, layer.down = (matrix(m, keep) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def _moe(layer: Layer, moe, keep: Keep) -> None:
    """Router, shared expert and its gate, and the experts' stacked matrices (expert 0's address
    and the stride to the next: only the routed experts are read)."""
    experts = moe.experts
    if type(experts) not in (Experts, QuantExperts) or experts.gate_up_proj.shape[0] > MAX_EXPERTS \
            or moe.gate.top_k > MAX_TOP_K:
        raise Unsupported(f"a mixture of {type(experts).__name__} past the native limits")
    _mlp(layer, moe.shared_expert, keep)
    layer.n_experts, layer.top_k, layer.renormalize = experts.gate_up_proj.shape[0], moe.gate.top_k, moe.gate.renormalize
    weight = moe.gate.weight
    layer.router = Mat(FLOAT_CODES[weight.dtype], *weight.shape, keep(weight.detach().contiguous()).data_ptr(), None)
    layer.shared_gate = matrix(moe.shared_expert_gate, keep)
    kinds = (getattr(experts, "gate_up_type", None), getattr(experts, "down_type", None))
    (layer.expert_gate_up, layer.gate_up_stride), (layer.expert_down, layer.down_stride) = (
        _stacked(param, kind, keep) for param, kind in zip((experts.gate_up_proj, experts.down_proj), kinds))


def _stacked(param: torch.Tensor, kind, keep: Keep) -> tuple[Mat, int]:
    """(E, rows, ...) expert matrices: dense (E, rows, cols) or blocks (E, rows, row_bytes)."""
    data = keep(param.detach().contiguous())
    if kind is None:
        if data.dtype not in FLOAT_CODES:
            raise Unsupported(f"{data.dtype} expert weights")
        code, cols = FLOAT_CODES[data.dtype], data.shape[2]
    else:
        wtype, cols = kind
        if wtype.name not in block_linear.TYPE_CODES:
            raise Unsupported(f"{wtype.name} expert weights")
        code = block_linear.TYPE_CODES[wtype.name]
    if cols % block_linear.QK:
        raise Unsupported(f"experts with {cols} input features (not whole blocks of {block_linear.QK})")
    q8 = kind is not None and block_linear.q8_activations(kind[0].name)
    return Mat(code, data.shape[1], cols, data.data_ptr(), None, None, q8), data[0].numel() * data.element_size()


def _attention(layer: Layer, attn, kv: KVCache, keep: Keep, zc: bool, eps: float) -> None:
    if type(attn) is not Attention or not isinstance(kv, KVCache):
        raise Unsupported(f"a {type(attn).__name__} mixer")
    layer.mixer = 0
    layer.q, layer.k, layer.v, layer.o = (matrix(m, keep) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    layer.n_heads, layer.n_kv, layer.head_dim, layer.gated = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.gated
    if attn.q_norm is not None:
        layer.q_norm, layer.k_norm = _norm(attn.q_norm, keep, zc, eps), _norm(attn.k_norm, keep, zc, eps)
    layer.k_pool, layer.v_pool, layer.overflow = kv.k_pool.data_ptr(), kv.v_pool.data_ptr(), kv.overflow.data_ptr()
    layer.pool_pages, layer.page_size = kv.k_pool.shape[1], kv.page_size
    layer.k_row_bytes, layer.v_row_bytes = kv.k_pool.shape[3], kv.v_pool.shape[3]
    layer.table_stride, layer.table = kv.block_table.shape[1], kv.block_table.data_ptr()
    codecs = [native_attention._codec(f, kv.head_dim) for f in (kv.fmt_k, kv.fmt_v)]
    if None in codecs:
        raise Unsupported(f"K/V formats {kv.fmt_k.name}/{kv.fmt_v.name} (no attention codec)")
    layer.ck, layer.cv = (ctypes.addressof(c) for c in codecs)
    ek, ev = keep(encoder(kv.fmt_k, kv.head_dim, keep)), keep(encoder(kv.fmt_v, kv.head_dim, keep))
    layer.ek, layer.ev = ctypes.addressof(ek), ctypes.addressof(ev)
    if kv.f16_window:
        layer.f16_window, layer.win_k, layer.win_v = kv.f16_window, kv.win_k.data_ptr(), kv.win_v.data_ptr()


def _delta_net(layer: Layer, net, state: RecurrentStateCache, keep: Keep, eps: float) -> None:
    from ..models.qwen3_5 import GatedDeltaNet
    from ..models.qwen3_next import FusedGatedDeltaNet
    if type(net) not in (GatedDeltaNet, FusedGatedDeltaNet) or not isinstance(state, RecurrentStateCache):
        raise Unsupported(f"a {type(net).__name__} mixer")
    if net.norm.eps != eps or max(net.dk, net.dv) > MAX_DIM:
        raise Unsupported("a DeltaNet with another norm epsilon or heads past the native limits")
    layer.mixer = 1
    if type(net) is FusedGatedDeltaNet:                    # Qwen3-Next: grouped per key head
        layer.fused_qkvz, layer.qkv, layer.b = 1, matrix(net.in_proj_qkvz, keep), matrix(net.in_proj_ba, keep)
    else:
        layer.qkv, layer.z, layer.b, layer.a = (
            matrix(m, keep) for m in (net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a))
    layer.out = matrix(net.out_proj, keep)
    layer.n_k, layer.n_v, layer.dk, layer.dv = net.n_k, net.n_v, net.dk, net.dv
    layer.conv_k = net.conv1d.weight.shape[-1]
    layer.conv_w = keep.ptr(net.conv1d.weight[:, 0])
    layer.dt_bias, layer.a_log, layer.gnorm = keep.ptr(net.dt_bias), keep.ptr(net.A_log), keep.ptr(net.norm.weight)
    layer.conv_state, layer.rec_state = state.conv.data_ptr(), state.recurrent.data_ptr()


def _layer(block, cache_layer, keep: Keep, zc: bool, eps: float, first: bool) -> Layer:
    if type(block) is not DecoderLayer and not (first and type(block) is EmbeddingScaledLayer):
        raise Unsupported(f"a {type(block).__name__} block")
    layer = Layer()
    layer.in_norm = _norm(block.input_layernorm, keep, zc, eps)
    layer.post_norm = _norm(block.post_attention_layernorm, keep, zc, eps)
    mixer = getattr(block, block.mixer_name)
    if block.mixer_name == "self_attn":
        _attention(layer, mixer, cache_layer, keep, zc, eps)
    else:
        _delta_net(layer, mixer, cache_layer, keep, eps)
    _mlp(layer, block.mlp, keep)
    return layer


def describe(model, cache, keep: Keep) -> Model:
    """The C step's description of ``model`` over ``cache``; raises Unsupported."""
    if type(model).run is not CausalLM.run or type(model).logits is not CausalLM.logits:
        raise Unsupported(f"{type(model).__name__} (its forward differs from the shared decoder's)")
    if not isinstance(model.rope, Rope):
        raise Unsupported("a rotary embedding other than Rope")
    final = model.model.norm
    if type(final) is not RMSNorm:
        raise Unsupported("a final norm other than RMSNorm")
    zc, eps = final.zero_centered, final.eps
    embed = model.model.embed_tokens
    if embed.weight.device.type != "cpu":
        raise Unsupported(f"a model on {embed.weight.device} (the native step runs on the CPU)")
    blocks = model.model.layers
    layers = [_layer(b, c, keep, zc, eps, i == 0) for i, (b, c) in enumerate(zip(blocks, cache))]
    array = keep((Layer * len(layers))(*layers))
    m = Model(len(layers), model.config.hidden_size, model.config.vocab_size, model.rope.rot_dim, int(zc),
              torch.get_num_threads(), eps, ctypes.addressof(array), matrix(embed, keep, bias=None),
              matrix(model.lm_head if model.lm_head is not None else embed, keep),
              keep.ptr(final.weight), keep.ptr(model.rope.inv_freq.float()), _embed_scale(blocks[0], embed))
    return m


def _embed_scale(first, embed) -> float:
    """Gemma's sqrt(hidden) as its first layer multiplies by it (rounded to the activations' dtype),
    else 1."""
    if type(first) is not EmbeddingScaledLayer:
        return 1.0
    dtype = embed.dtype if hasattr(embed, "dtype") else embed.weight.dtype
    return float(torch.tensor(first.input_layernorm.weight.shape[0] ** 0.5, dtype=dtype))


class NativeStep:
    """``step(slots, tokens, positions)`` -> float32 logits (B, vocab), caches advanced by one,
    through ``decode_step.c``. The caller does the caches' host work (prepare/commit)."""

    def __init__(self, description: Model, keep: Keep, lib, window=None):
        self.description, self.keep, self.lib = description, keep, lib
        self.vocab = description.vocab
        self.window = window            # a KVCache with an f16 window: its lengths go to the step (all agree)

    @classmethod
    def build(cls, model, cache) -> tuple["NativeStep | None", str]:
        """(the step, "") or (None, why not)."""
        lib = _library()
        if lib is None:
            return None, build.why_not(SOURCE)
        keep = Keep()
        try:
            window = next((kv for kv in cache.kv_layers if kv.f16_window), None)
            return cls(keep(describe(model, cache, keep)), keep, lib, window), ""
        except Unsupported as why:
            return None, str(why)

    def __call__(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Logits (B, vocab) for one token of each slot. Batches past MAX_BATCH (the C GEMV's
        activation rows) run as calls of MAX_BATCH: each sequence gets the same bits either way
        (the kernels' sums do not depend on the batch), and on the bundled model 16 sequences
        decoded 1.37x faster so than through the eager torch step (3,303 vs 2,410 t/s, q8_0 at
        depth 1024, 2 threads; 32 sequences 1.10x)."""
        if len(slots) > MAX_BATCH:
            return torch.cat([self(slots[i:i + MAX_BATCH], tokens[i:i + MAX_BATCH], positions[i:i + MAX_BATCH])
                              for i in range(0, len(slots), MAX_BATCH)])
        windows = [self.window.window_len(s) for s in slots] if self.window is not None else [0] * len(slots)
        args = torch.tensor([tokens, positions, slots, windows], dtype=torch.int64)
        logits = torch.empty(len(slots), self.vocab, dtype=torch.float32)
        self.description.n_threads = torch.get_num_threads()
        status = self.lib.kvslim_decode_step(ctypes.byref(self.description), len(slots), args[0].data_ptr(),
                                             args[1].data_ptr(), args[2].data_ptr(), args[3].data_ptr(),
                                             logits.data_ptr())
        if status:
            raise ValueError(f"the native step refused a batch of {len(slots)}")
        return logits
