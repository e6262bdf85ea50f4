"""fla-core's gated-delta-rule kernels (kvslim/gpu/delta_rule.py) against kvslim's torch forms.

On the CPU the torch forms must be chosen (fla-core is never imported there). On a CUDA device
with fla-core installed, its chunked prefill and recurrent step are held to the token-by-token
reference, with an initial state, lengths that are and are not multiples of its 64-token chunk,
and dk/dv as the Qwen3.5/3.6 layers use (128).
"""
from __future__ import annotations

import pytest
import torch

from kvslim.gpu import delta_rule as fla
from kvslim.models.delta_rule import chunk_gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule, rule_for


def test_the_cpu_never_takes_fla():
    """fla-core never serves the CPU: prompts take the C recurrence (or, without a compiler, the
    torch chunked form; tests/test_native_delta_rule.py), decode steps the torch step."""
    assert not fla.serves(torch.device("cpu"))
    chunk, step = rule_for(torch.device("cpu"))
    assert step is gated_delta_step
    assert chunk is not fla.chunk and (chunk is chunk_gated_delta_rule or chunk.__name__ == "_native_chunk")


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


@cuda_fla
def test_fla_step_updates_the_state_in_place_as_the_torch_step():
    q, k, v, g, beta, state = _inputs(3, 1, 4, 128, 128, "cuda", seed=1)
    want_state = state.cpu().clone()
    want = gated_delta_step(q[:, 0].cpu(), k[:, 0].cpu(), v[:, 0].cpu(), g[:, 0].cpu(), beta[:, 0].cpu(), want_state)
    got = fla.step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert torch.allclose(got.cpu(), want, atol=2e-3, rtol=2e-3)
    assert torch.allclose(state.cpu(), want_state, atol=2e-3, rtol=2e-3)
