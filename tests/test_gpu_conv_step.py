"""The Triton conv step (kvslim/gpu/conv_step.py) against ``causal_conv_step``, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py):
bf16 inputs (the rows of a fused projection's output, strided) and float32 ones, a channel count
that is not a whole number of the kernel's blocks, kernel widths 4 (Qwen3.5/3.6) and 2, slots
out of order among idle ones, whose states must stay as they were.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import conv_step as gpu
from kvslim.gpu import available
from kvslim.models.delta_rule import causal_conv_step

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (sequences, channels, kernel width, slots in the cache, input dtype)
CASES = [(3, 200, 4, 6, "bfloat16"), (2, 64, 4, 2, "float32"), (4, 300, 2, 5, "float32")]


def _inputs(case, seed: int):
    """x (B, C) as the first C columns of wider rows; every slot's state; B distinct slots out of
    order; the conv weight."""
    batch, channels, width, n_slots, dtype = case
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, channels + 7, generator=gen) * 2).to(getattr(torch, dtype))[:, :channels]
    state = torch.randn(n_slots, channels, width - 1, generator=gen)
    slots = torch.randperm(n_slots, generator=gen)[:batch]
    return x, state, slots, torch.randn(channels, width, generator=gen) * 0.5


def conv_in_child(cases, path: Path) -> None:
    """In the interpreted child: each case's output and the states after the step."""
    out = []
    for i, case in enumerate(cases):
        x, state, slots, weight = _inputs(case, i)
        out.append((gpu.conv_step(x, state, slots, weight), state))
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_conv_step", "conv_in_child", CASES, tmp_path_factory.mktemp("conv"))


def _check(case, got: torch.Tensor, state: torch.Tensor, seed: int) -> None:
    """The output within float32 ulps of the torch step's (sums in another order); the chosen
    slots' states exactly the torch step's new states, every other slot's untouched."""
    x, before, slots, weight = _inputs(case, seed)
    want, want_state = causal_conv_step(x, before[slots], weight)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(state[slots], want_state)
    idle = torch.ones(before.shape[0], dtype=torch.bool)
    idle[slots] = False
    assert torch.equal(state[idle], before[idle])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-c{c[1]}-k{c[2]}-{c[4]}")
def test_conv_step_matches_the_torch_step(interpreted, case):
    _check(case, *interpreted[CASES.index(case)], CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-c{c[1]}-k{c[2]}-{c[4]}")
def test_conv_step_on_cuda_matches_the_torch_step(case):
    compiled_process()
    x, state, slots, weight = (t.cuda() for t in _inputs(case, CASES.index(case)))
    got = gpu.conv_step(x, state, slots, weight)
    _check(case, got.cpu(), state.cpu(), CASES.index(case))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"state \(S, C, K-1\)"):
        gpu.conv_step(torch.zeros(2, 8), torch.zeros(3, 8, 3), torch.arange(2), torch.zeros(8, 3))


def test_conv_step_compiles_for_an_h100_without_one():
    """A 35B-A3B layer's step: bf16 rows of the projection, float32 states, width 4."""
    from kvslim.gpu import _conv_step_kernel as kernel, cuobjdump, load_waves
    pointers = {"x_ptr": "*bf16", "state_ptr": "*fp32", "slots_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*fp32"}
    constexprs = {"K": 4, "BLOCK_C": gpu.BLOCK_C, "BLOCK_K": 4}
    compiled = compile_for_sm90(kernel.conv_step, pointers, constexprs, 4)
    # the slot, then x, the held inputs and the weights at once, x read straight into its 2D
    # columns (``conv_operands``): widened from a 1D load through shared memory it was 3 waits
    assert load_waves(cuobjdump(compiled, "-sass")) == 2
