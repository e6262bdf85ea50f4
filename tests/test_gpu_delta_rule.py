"""fla-core's gated-delta-rule kernels (kvslim/gpu/delta_rule.py) against kvslim's torch forms.

On the CPU the torch forms must be chosen (fla-core is never imported there). On a CUDA device
with fla-core installed, its chunked prefill and recurrent step are held to the token-by-token
reference, with an initial state, lengths that are and are not multiples of its 64-token chunk,
and dk/dv as the Qwen3.5/3.6 layers use (128).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import delta_rule as fla
from kvslim.models.delta_rule import (chunk_gated_delta_rule, chunk_rule, gated_delta_decode, gated_delta_step, l2norm,
                                     recurrent_gated_delta_rule)

from .triton_harness import FLA_PATH, run_interpreted


def test_the_cpu_never_takes_fla():
    """fla-core never serves the CPU: prompts take the C recurrence (or, without a compiler, the
    torch chunked form; tests/test_native_delta_rule.py)."""
    assert not fla.serves(torch.device("cpu"), torch.bfloat16)
    chunk = chunk_rule(torch.device("cpu"), torch.bfloat16)
    assert chunk is not fla.chunk and (chunk is chunk_gated_delta_rule or chunk.__name__ == "_native_chunk")


def test_fla_serves_half_models_only(monkeypatch):
    """On a GPU with the kernels on, fla-core's chunked prompt kernel (tf32 products) serves bf16
    and f16 models; a float32 model's prompts keep the torch form's float32 products (on an H200
    fla moved the tiny f32 models' logits by up to 0.01 against the CPU)."""
    monkeypatch.setattr(fla.gpu, "TRITON", True)
    monkeypatch.setattr(fla, "_fla", lambda: (None, None))          # as if fla-core imported
    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        assert fla.serves(cuda, dtype) and chunk_rule(cuda, dtype) is fla.chunk
    assert not fla.serves(cuda, torch.float32) and chunk_rule(cuda, torch.float32) is chunk_gated_delta_rule
    monkeypatch.setattr(fla.gpu, "TRITON", False)
    assert chunk_rule(cuda, torch.bfloat16) is chunk_gated_delta_rule


def _inputs(b, t, h, dk, dv, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 0.7                   # log decay <= 0
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.1
    return [x.to(device) for x in (q, k, v, g, beta, state)]


cuda_fla = pytest.mark.skipif(not (torch.cuda.is_available() and fla._fla() is not None),
                              reason="needs a CUDA device with fla-core installed")


@cuda_fla
@pytest.mark.parametrize("t", [1, 63, 64, 200])
def test_fla_chunk_matches_the_recurrent_reference(t):
    args = _inputs(1, t, 4, 128, 128, "cuda")
    o, s = fla.chunk(*args)
    o_ref, s_ref = recurrent_gated_delta_rule(*[x.cpu() for x in args])
    assert torch.allclose(o.cpu(), o_ref, atol=2e-3, rtol=2e-3), (o.cpu() - o_ref).abs().max()
    assert torch.allclose(s.cpu(), s_ref, atol=2e-3, rtol=2e-3), (s.cpu() - s_ref).abs().max()


def _raw_decode_inputs(b, hk, hv, dk, dv, device, dtype, seed=0):
    """A decode step's raw inputs as a layer hands them over: q, k not normalised, at the key heads;
    the gates' pre-activations; the layer's A_log and dt_bias; a float32 state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, hk, dk, generator=gen) * 3 for _ in "qk")
    v = torch.randn(b, hv, dv, generator=gen)
    a, rate = torch.randn(b, hv, generator=gen) * 2, torch.randn(b, hv, generator=gen) * 2
    A_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.1
    inputs = [x.to(dtype) for x in (q, k, v, a, rate)] + [A_log, dt_bias, state]
    return [x.to(device) for x in inputs]


def test_the_torch_decode_normalises_repeats_and_gates_then_steps():
    """``gated_delta_decode`` (what fla-core's fused launch is held to) is the layer's own
    sequence: q and k normalised and repeated to the value heads, g and beta from the gates,
    then ``gated_delta_step``."""
    q, k, v, a, rate, A_log, dt_bias, state = _raw_decode_inputs(3, 2, 4, 16, 8, "cpu", torch.float32)
    want_state = state.clone()
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    want = gated_delta_step(l2norm(q).repeat_interleave(2, dim=1), l2norm(k).repeat_interleave(2, dim=1), v, g,
                            torch.sigmoid(rate), want_state)
    got = gated_delta_decode(q, k, v, a, rate, A_log, dt_bias, state)
    assert torch.equal(got, want) and torch.equal(state, want_state)
    assert not torch.equal(state, _raw_decode_inputs(3, 2, 4, 16, 8, "cpu", torch.float32)[-1])   # updated in place


def fla_in_child_process(shapes, path: Path) -> None:
    """In an interpreted child with fla-core on its path: ``fla.decode`` on CPU tensors, per
    (batch, key heads, value heads, dk, dv, dtype name), with the inputs it was given, and
    ``fla.gated_norm`` for NORM_CASES. The gated norm's kernel is autotuned, and the interpreter
    has no device to time configs on: every config times the same, so the first is taken."""
    from triton.runtime.autotuner import Autotuner
    Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]
    assert fla.serves(torch.device("cpu"), torch.bfloat16) is False and fla._fla() is not None
    out = []
    for i, (b, hk, hv, dk, dv, dtype) in enumerate(shapes):
        inputs = _raw_decode_inputs(b, hk, hv, dk, dv, "cpu", getattr(torch, dtype), seed=i)
        o = fla.decode(*inputs)
        out.append((o, inputs[-1]))
    torch.save({"decode": out, "norm": [_gated_norm_inputs(dtype, seed) for dtype, seed in NORM_CASES]}, path)


def test_fla_decode_matches_the_torch_decode_under_the_interpreter(fla_in_child):
    """fla-core's fused recurrent kernel runs under Triton's interpreter (its chunked prefill does
    not: it asks for a GPU driver), so CI holds ``fla.decode``'s use of it (the raw inputs, key
    head h // (Hv / Hk), the gates, the state written back) to ``gated_delta_decode``. fla-core
    is installed apart (requirements/fla.txt) and put on the child's path only."""
    got = fla_in_child["decode"]
    for i, ((b, hk, hv, dk, dv, dtype), (o, state)) in enumerate(zip(DECODE_SHAPES, got)):
        inputs = _raw_decode_inputs(b, hk, hv, dk, dv, "cpu", getattr(torch, dtype), seed=i)
        want = gated_delta_decode(*inputs)                    # float32
        assert o.dtype == inputs[2].dtype and o.shape == (b, hv, dv)       # v's: rounded once
        # float32 sums in another order: in bf16, one rounding may land an ulp away
        ulp = torch.finfo(o.dtype).eps * want.abs()
        assert ((o.float() - want).abs() <= ulp + 1e-6).all(), (o.float() - want).abs().max()
        torch.testing.assert_close(state, inputs[-1], atol=1e-6, rtol=1e-5)


DECODE_SHAPES = [(3, 2, 4, 32, 16, "float32"), (2, 1, 3, 16, 32, "bfloat16")]
NORM_CASES = [("float32", 0), ("bfloat16", 1)]


def _gated_norm_inputs(dtype: str, seed: int, run: bool = True):
    """A DeltaNet output norm (dim 128, weight near 1) and its x, z (6 heads' rows of 4 tokens); in
    the child (``run``) fla's gated norm of them."""
    from kvslim.models.layers import RMSNormGated
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNormGated(128, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(128, generator=gen))
    x, z = ((torch.randn(4, 6, 128, generator=gen) * s).to(getattr(torch, dtype)) for s in (3, 1))
    return fla.gated_norm(x, z, norm.weight, norm.eps) if run else (norm, x, z)


@pytest.fixture(scope="module")
def fla_in_child(tmp_path_factory):
    """fla-core's decode and gated norm, run once in an interpreted child."""
    if not (FLA_PATH / "fla").is_dir():
        pytest.skip(f"fla-core is not installed in {FLA_PATH} (make test's setup puts it there)")
    return run_interpreted("tests.test_gpu_delta_rule", "fla_in_child_process", DECODE_SHAPES,
                           tmp_path_factory.mktemp("fla"), paths=(FLA_PATH,))


@pytest.mark.parametrize("dtype,seed", NORM_CASES)
def test_fla_gated_norm_matches_the_layers_norm_under_the_interpreter(fla_in_child, dtype, seed):
    """``gated_norm`` (fla-core's fused gated RMSNorm: one launch for the DeltaNet output norm on
    CUDA) against ``RMSNormGated``'s torch form: float32 to 1e-6; bf16 within two ulps, as it
    rounds once where the form rounds three times."""
    got = fla_in_child["norm"][NORM_CASES.index((dtype, seed))]
    norm, x, z = _gated_norm_inputs(dtype, seed, run=False)
    with torch.no_grad():
        want = norm(x, z)
    assert got.dtype == want.dtype and got.shape == want.shape
    ulps = 1e-6 if dtype == "float32" else 2 * torch.finfo(torch.bfloat16).eps
    assert ((got.float() - want.float()).abs() <= ulps * want.float().abs() + 1e-6).all(), \
        (got.float() - want.float()).abs().max()


@cuda_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_decode_from_raw_inputs_matches_the_torch_decode(dtype):
    """One fused launch (normalise, read key head h // 2 for value head h, gates, step) against
    the torch decode on the CPU, with 2 key heads for 4 value heads as Qwen3.5 groups them."""
    inputs = _raw_decode_inputs(3, 2, 4, 128, 128, "cuda", dtype, seed=1)
    want_inputs = [x.cpu() for x in inputs]
    want = gated_delta_decode(*want_inputs)
    got = fla.decode(*inputs)
    assert got.dtype == dtype                                  # v's: float32 sums rounded once
    rtol = 2e-3 if dtype == torch.float32 else 8e-3
    assert torch.allclose(got.float().cpu(), want, atol=2e-3, rtol=rtol), (got.float().cpu() - want).abs().max()
    assert torch.allclose(inputs[-1].cpu(), want_inputs[-1], atol=2e-3, rtol=2e-3)


@cuda_fla
@pytest.mark.parametrize("dtype,seed", NORM_CASES)
def test_fla_gated_norm_on_cuda_matches_the_layers_norm(dtype, seed):
    """The DeltaNet output norm as a CUDA model runs it with the kernels on (one fla-core launch)
    against the torch form on the CPU."""
    norm, x, z = _gated_norm_inputs(dtype, seed, run=False)
    got = fla.gated_norm(x.cuda(), z.cuda(), norm.weight.cuda(), norm.eps).cpu()
    with torch.no_grad():
        want = norm(x, z)
    ulps = 1e-6 if dtype == "float32" else 2 * torch.finfo(torch.bfloat16).eps
    assert got.dtype == want.dtype
    assert ((got.float() - want.float()).abs() <= ulps * want.float().abs() + 1e-6).all()
