"""Gated DeltaNet on CUDA through fla-core (flash-linear-attention's Triton kernels).

The same contract as kvslim/models/delta_rule.py's torch forms, which stay the reference and
the fallback: ``chunk(q, k, v, g, beta, state)`` for a prefill segment, what the layers take on
a GPU, and ``decode(...)`` for one decode token per sequence from the layer's raw inputs (state
updated in place). The layers' decode step is gpu/delta_step.py's since session 37 (fla-core's
takes the batch's states as one tensor, so the layer gathered and scattered them around it);
``decode`` stays for benchmarks/gpu_delta_step.py's side-by-side, as ``gated_norm`` does (the
layers' output norm is gpu/gated_norm.py's since session 38). fla-core is what transformers
and vLLM run for these layers; kvslim imports it only when a CUDA tensor asks
(never for the CPU) and the GPU kernels are switched on (``kvslim.gpu.TRITON``,
KVSLIM_TRITON=1). The tests run its decode kernel under Triton's interpreter in a child process
(tests/test_gpu_delta_rule.py; its chunked kernel asks for a GPU driver there). fla-core
0.6.0's forward kernels work with Triton 3.6 (its Hopper check for Triton < 3.7.1 guards a
backward kernel only, which inference never calls).
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from .. import gpu


# what ``decode`` asks of fla-core's fused recurrent kernel (0.6.0 has them all)
FUSED_OPTIONS = {"use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel"}


@lru_cache(maxsize=None)
def _fla():
    """fla's two gated-delta-rule entry points, or None when fla-core does not import or its
    fused recurrent kernel cannot take a layer's raw inputs (FUSED_OPTIONS)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:            # not installed, or its import fails on this torch/triton: keep the torch forms
        return None
    if not FUSED_OPTIONS <= set(inspect.signature(fused_recurrent_gated_delta_rule).parameters):
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


@lru_cache(maxsize=None)
def _fla_norm():
    """fla-core's gated RMSNorm forward (its fused_norm_gate kernel), or None when it does not
    import or lacks the arguments ``gated_norm`` gives it."""
    try:
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
    except Exception:
        return None
    if not {"activation", "eps", "out_dtype", "is_rms_norm"} <= set(inspect.signature(layer_norm_gated_fwd).parameters):
        return None
    return layer_norm_gated_fwd


def gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNormGated``: rms_norm(x) * weight * silu(z) in one launch (the torch form launches
    about 6), in float32 inside and rounded once to z's dtype, where the torch form rounds after
    the norm and after the weight too: bf16 results within an ulp or two of it. The layers take
    gpu/gated_norm.py's kernel since session 38 (this one takes contiguous rows: a strided z,
    at -np > 1 or in a prompt, was copied first); it stays for benchmarks/gpu_delta_step.py's
    side-by-side."""
    shape = z.shape
    y, *_ = _fla_norm()(x.reshape(-1, shape[-1]), z.reshape(-1, shape[-1]), weight, None, activation="swish",
                        eps=eps, is_rms_norm=True, out_dtype=z.dtype)
    return y.reshape(shape)


# Model dtypes fla-core's chunked prompt kernel serves. On sm_80 and later its products are tf32
# (10-bit mantissas: fla sets no float32 precision for most of its tl.dot, and asks tf32 for its
# triangular solve), below a bf16 or f16 model's own rounding, but not a float32 model's: with
# the kernels on, the tiny f32 models' logits moved up to 0.01 on 8-12% of values against the
# CPU on an H200 (session 41), about what the torch chunked form does with its products'
# operands rounded to tf32 on the CPU (0.006-0.010, 3-8%; benchmarks/tf32_delta_rule.py has the
# bundled model's, which is less than its H200 figure). A float32 model keeps the torch form's
# float32 products.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fla-core's kernels run the DeltaNet prompts of a model of ``dtype`` on this device."""
    return device.type == "cuda" and dtype in HALF_DTYPES and gpu.TRITON and _fla() is not None


def chunk(q, k, v, g, beta, state):
    """One segment's prefill: q, k (1, T, H, dk) normalised, repeated to the value heads; v (1, T, H, dv);
    g, beta (1, T, H); state (1, H, dk, dv). Returns o (1, T, H, dv) and the final state, float32."""
    fla_chunk, _ = _fla()
    o, final = fla_chunk(q.float(), k.float(), v.float(), g.float(), beta.float(), scale=q.shape[-1] ** -0.5,
                         initial_state=state.float(), output_final_state=True)
    return o.float(), final.float()


def decode(q, k, v, a, b, A_log, dt_bias, state):
    """``gated_delta_decode``'s contract (kvslim/models/delta_rule.py) in one launch: q, k (B, Hk, dk)
    as convolved; v (B, Hv, dv); a, b (B, Hv) the gates' pre-activations; state (B, Hv, dk, dv)
    float32, updated in place. fla-core's fused recurrent kernel L2-normalises q and k, reads key
    head h // (Hv / Hk) for value head h (no repeated copies) and takes g and beta from a, b,
    A_log and dt_bias itself: the torch form's ~20 small launches a layer (norms, repeats, the
    gates' exp, softplus and sigmoid, float copies) become one. Returns o (B, Hv, dv) in v's
    dtype: float32 sums rounded once, as the layer rounds the torch form's float32 o."""
    _, fla_step = _fla()
    o, final = fla_step(q[:, None], k[:, None], v[:, None], g=a[:, None], beta=b[:, None],
                        scale=q.shape[-1] ** -0.5, initial_state=state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                        use_beta_sigmoid_in_kernel=True)
    state.copy_(final)
    return o[:, 0]
