"""The C gated delta rule (prompts on the CPU) against the torch forms it replaces there: the
chunked form (what prefill ran before) and the token-by-token recurrence (the definition), for
every build of the C file, head shapes of the models kvslim runs, prompt lengths that are and are
not whole chunks, and a state carried in from an earlier segment.
"""
from __future__ import annotations

import pytest
import torch

from kvslim.models import delta_rule as torch_rule
from kvslim.native import build
from kvslim.native import delta_rule as native


def _need_kernel(variant=None):
    if not build.compiler():
        pytest.skip("no C compiler: prefill keeps the torch chunked form")
    assert native._library(variant) is not None                        # CI has one: the file must build


def _inputs(b, t, h, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch_rule.l2norm(torch.randn(b, t, h, dk, generator=gen))
    k = torch_rule.l2norm(torch.randn(b, t, h, dk, generator=gen))
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 2        # log decay: some heads forget fast
    beta = torch.rand(b, t, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("variant", list(build.VARIANTS))
@pytest.mark.parametrize("b,t,h,dk,dv", [(1, 1, 2, 16, 16), (1, 64, 4, 32, 32), (1, 200, 4, 64, 96),
                                         (2, 77, 3, 128, 128), (1, 130, 2, 128, 256)])
def test_c_recurrence_matches_the_torch_forms(variant, b, t, h, dk, dv):
    _need_kernel(variant)
    args = _inputs(b, t, h, dk, dv)
    state_before = args[-1].clone()
    out, final = native.chunk(*args, variant=variant)
    ref_out, ref_final = torch_rule.recurrent_gated_delta_rule(*args)
    chunk_out, chunk_final = torch_rule.chunk_gated_delta_rule(*args)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_final, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, chunk_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, chunk_final, atol=1e-4, rtol=1e-4)
    assert torch.equal(args[-1], state_before)                          # the caller's state is not touched


def test_segments_continue_from_the_carried_state():
    """A prompt read in two segments gives the outputs and state of reading it at once (the
    engine's ubatches and prefix reuse rely on it)."""
    _need_kernel()
    q, k, v, g, beta, state = _inputs(1, 150, 4, 64, 64, seed=1)
    whole, whole_state = native.chunk(q, k, v, g, beta, state)
    first, mid = native.chunk(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state)
    second, end = native.chunk(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], mid)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(end, whole_state, atol=1e-6, rtol=0)


def test_chunk_rule_for_the_cpu_takes_the_c_recurrence_and_leaves_gradients_to_torch():
    _need_kernel()
    chunk = torch_rule.chunk_rule(torch.device("cpu"), torch.float32)
    q, k, v, g, beta, state = _inputs(1, 40, 2, 32, 32, seed=2)
    torch.testing.assert_close(chunk(q, k, v, g, beta, state)[0], native.chunk(q, k, v, g, beta, state)[0],
                               atol=0, rtol=0)
    v.requires_grad_(True)                              # training through kvslim's layers: autograd sees torch ops
    out, _ = chunk(q, k, v, g, beta, state)
    out.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_head_dims_past_the_kernel_scratch_are_refused_and_chunk_rule_keeps_torch_there():
    _need_kernel()
    args = _inputs(1, 2, 1, 16, native.MAX_DIM + 16)
    with pytest.raises(ValueError, match="exceed the C kernel"):
        native.chunk(*args)
    chunk = torch_rule.chunk_rule(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(chunk(*args)[0], torch_rule.chunk_gated_delta_rule(*args)[0], atol=0, rtol=0)
