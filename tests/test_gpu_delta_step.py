"""The Triton DeltaNet decode step (kvslim/gpu/delta_step.py) against ``gated_delta_decode``, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py): bf16
inputs as a fused projection's strided columns and float32 ones, key heads shared by 2 value
heads and by 1, head sizes that are not powers of two nor whole blocks of columns, gates far
past softplus's threshold, slots out of order among idle ones, whose states must stay as they were.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim.gpu import available
from kvslim.gpu import delta_step as gpu
from kvslim.models.delta_rule import gated_delta_decode

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted, spilled_bytes

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (sequences, key heads, value heads, dk, dv, slots in the cache, input dtype)
CASES = [(3, 2, 4, 32, 16, 6, "bfloat16"), (2, 1, 3, 24, 20, 2, "float32"), (1, 2, 4, 128, 128, 3, "bfloat16")]


def _inputs(case, seed: int):
    """q, k, v as the columns of one wider row each (a fused projection's output); a, b likewise;
    the layer's A_log and dt_bias; every slot's state; B distinct slots out of order."""
    batch, hk, hv, dk, dv, n_slots, dtype = case
    gen = torch.Generator().manual_seed(seed)
    width = 2 * hk * dk + hv * dv + 5
    mixed = (torch.randn(batch, width, generator=gen) * 2).to(getattr(torch, dtype))
    q = mixed[:, :hk * dk].reshape(batch, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].reshape(batch, hk, dk)
    v = mixed[:, 2 * hk * dk:2 * hk * dk + hv * dv].reshape(batch, hv, dv)
    if batch == 1:      # one row's stride means nothing: a model's view gave each its own (the H200 run, session 41)
        q, k, v = (t.as_strided(t.shape, (t.shape[1] * t.shape[2], t.shape[2], 1), t.storage_offset())
                   for t in (q, k, v))
    gates = (torch.randn(batch, 2 * hv + 1, generator=gen) * 4).to(getattr(torch, dtype))
    gates[0, 0] = 30.0                                                  # softplus(x) = x past 20
    a, b = gates[:, :hv], gates[:, hv:2 * hv]
    A_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    state = torch.randn(n_slots, hv, dk, dv, generator=gen) * 0.1
    slots = torch.randperm(n_slots, generator=gen)[:batch]
    return q, k, v, a, b, A_log, dt_bias, state, slots


def _norm(case, seed: int):
    """The layer's output norm: z (B, Hv, dv) as columns of a wider row, its weight and eps."""
    batch, _, hv, _, dv, _, dtype = case
    gen = torch.Generator().manual_seed(seed + 100)
    z = (torch.randn(batch, hv * dv + 3, generator=gen) * 2).to(getattr(torch, dtype))[:, 3:].view(batch, hv, dv)
    return z, torch.rand(dv, generator=gen) + 0.5, 1e-6


def step_in_child(cases, path: Path) -> None:
    """In the interpreted child: each case's output and every slot's state after the step, then
    the same step with the output norm in its launch (the counters shared across the cases)."""
    out = []
    for i, case in enumerate(cases):
        *inputs, state, slots = _inputs(case, i)
        out.append((gpu.delta_step(*inputs, state, slots), state))
    for i, case in enumerate(cases):
        *inputs, state, slots = _inputs(case, i)
        out.append((gpu.delta_step(*inputs, state, slots, norm=_norm(case, i)), state))
    out += [_conv_runs(case, i) for i, case in enumerate(cases)]
    torch.save(out, path)


def _conv_inputs(case, seed: int):
    """``_inputs``' q, k, v taken as the raw [Q | K | V] columns of their row, a conv state (S, C,
    3) for every slot and the conv's weights (C, 4)."""
    q, k, v, *rest = _inputs(case, seed)
    n_slots, channels = case[5], 2 * case[1] * case[3] + case[2] * case[4]
    gen = torch.Generator().manual_seed(seed + 200)
    return q, k, v, *rest, torch.randn(n_slots, channels, 3, generator=gen), torch.randn(channels, 4, generator=gen)


def _conv_runs(case, seed: int, cuda: bool = False) -> tuple:
    """The step that takes the conv in its launch (``conv``, with the output norm), then the two
    launches it replaces (``conv_step``, then the step on its float32 output): outputs, recurrent
    and conv states of both."""
    from kvslim.gpu import conv_step
    move = (lambda t: t.cuda() if torch.is_tensor(t) else t) if cuda else (lambda t: t)
    runs = []
    for fused in (True, False):
        q, k, v, *rest = _conv_inputs(case, seed)
        key = case[1] * case[3]
        if cuda:        # q, k and v moved as the one row they are (moved apart, they were three tensors: H200 run)
            raw = q.as_strided((q.shape[0], 2 * key + case[2] * case[4]), (q.stride(0), 1)).cuda()
            q, k, v = raw[:, :key].view(q.shape), raw[:, key:2 * key].view(k.shape), raw[:, 2 * key:].view(v.shape)
        a, b, A_log, dt_bias, state, slots, conv, weight = (move(t) for t in rest)
        norm, out = tuple(move(t) for t in _norm(case, seed)), torch.empty_like(v.contiguous())
        if fused:
            got = gpu.delta_step(q, k, v, a, b, A_log, dt_bias, state, slots, out=out, norm=norm, conv=(conv, weight))
        else:
            raw = q.as_strided((q.shape[0], conv.shape[1]), (q.stride(0), 1))     # the [Q | K | V] columns
            mixed = conv_step.conv_step(raw, conv, slots, weight)
            heads = (mixed[:, :key].view(q.shape), mixed[:, key:2 * key].view(k.shape),
                     mixed[:, 2 * key:].view(v.shape))
            got = gpu.delta_step(*heads, a, b, A_log, dt_bias, state, slots, out=out, norm=norm)
        runs.append((got.cpu(), state.cpu(), conv.cpu()))
    return tuple(runs)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_delta_step", "step_in_child", CASES, tmp_path_factory.mktemp("delta"))


def _check(case, got: torch.Tensor, state: torch.Tensor, seed: int) -> None:
    """The output in v's type, within one rounding of the torch step's float32 output (float32
    sums in another order); the chosen slots' states within float32 ulps of the torch step's,
    every other slot's untouched."""
    *inputs, before, slots = _inputs(case, seed)
    want_state = before[slots].clone()
    want = gated_delta_decode(*inputs, want_state)
    assert got.dtype == inputs[2].dtype and got.shape == want.shape
    ulp = torch.finfo(got.dtype).eps * want.abs() if got.dtype != torch.float32 else 0
    assert ((got.float() - want).abs() <= ulp + 1e-5 * want.abs() + 1e-6).all(), (got.float() - want).abs().max()
    torch.testing.assert_close(state[slots], want_state, atol=1e-6, rtol=1e-5)
    idle = torch.ones(before.shape[0], dtype=torch.bool)
    idle[slots] = False
    assert torch.equal(state[idle], before[idle])


def _id(case) -> str:
    return f"b{case[0]}-hk{case[1]}-hv{case[2]}-dk{case[3]}-dv{case[4]}-{case[6]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_delta_step_matches_the_torch_decode(interpreted, case):
    _check(case, *interpreted[CASES.index(case)], CASES.index(case))


def _check_normed(case, got: torch.Tensor, state: torch.Tensor, seed: int) -> None:
    """The step's normed output against the torch step's float32 o normed in float64 (``RMSNormGated``'s
    math): within one rounding of the output's type and float32's error; the states as ``_check``'s."""
    *inputs, before, slots = _inputs(case, seed)
    want_state = before[slots].clone()
    o = gated_delta_decode(*inputs, want_state).double()
    z, weight, eps = _norm(case, seed)
    want = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.double() * torch.nn.functional.silu(z.double())
    assert got.dtype == inputs[2].dtype and got.shape == want.shape
    ulp = torch.finfo(got.dtype).eps * want.abs() if got.dtype != torch.float32 else 0
    assert ((got.double() - want).abs() <= ulp + 1e-4 * want.abs() + 1e-5).all(), (got.double() - want).abs().max()
    torch.testing.assert_close(state[slots], want_state, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_delta_step_with_the_output_norm_matches_the_torch_forms(interpreted, case):
    """The layer's gated output norm applied by each head's last program (``norm``): the torch
    step's o through the norm's math, every head whole although its columns came from
    several programs (dv 16, 20 and 128 over programs of 8 columns)."""
    _check_normed(case, *interpreted[len(CASES) + CASES.index(case)], CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_delta_step_with_the_output_norm_on_cuda(case):
    compiled_process()
    *inputs, state, slots = (t.cuda() for t in _inputs(case, CASES.index(case)))
    z, weight, eps = _norm(case, CASES.index(case))
    got = gpu.delta_step(*inputs, state, slots, norm=(z.cuda(), weight.cuda(), eps))
    _check_normed(case, got.cpu(), state.cpu(), CASES.index(case))


def _check_conv(case, runs: tuple, seed: int, exact: bool = True) -> None:
    """The step with the conv in its launch gives the bits of the conv's launch then the step's:
    output, every slot's recurrent state and every slot's conv state (the idle slots' as they
    were); and the conv states moved by one input for the chosen slots. Compiled (``exact``
    False), the two launches' sums over a head's 128 rows may take another order: the compiler
    lays q out as the conv's sums leave it in one (4 rows 32 apart a thread, sm_90's TTGIR) and
    as loaded in the other (4 consecutive rows), and the state tile likewise; their outputs
    then agree within ``_check``'s bound (a rounding of out's type and float32 sums' error),
    their states within float32 ulps, and the conv states (copies) exactly. The interpreter's
    sums have one order, so its bits are equal."""
    (got, state, conv), (want, want_state, want_conv) = runs
    assert torch.equal(conv, want_conv)
    if exact:
        assert torch.equal(got, want) and torch.equal(state, want_state)
    else:
        size = want.float().abs()           # the bound ``_check`` holds either launch to against torch's
        bound = torch.finfo(got.dtype).eps * size + 1e-5 * size + 1e-6
        assert ((got.float() - want.float()).abs() <= bound).all(), (got.float() - want.float()).abs().max()
        torch.testing.assert_close(state, want_state, atol=1e-6, rtol=1e-5)
    *_, before, slots, conv_before, _ = _conv_inputs(case, seed)
    idle = torch.ones(before.shape[0], dtype=torch.bool)
    idle[slots] = False
    assert torch.equal(conv[idle], conv_before[idle])
    assert torch.equal(conv[slots][..., :-1], conv_before[slots][..., 1:])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_conv_in_the_steps_launch_is_the_conv_launchs(interpreted, case):
    """``conv``: each program convolves the channels it reads (q's and k's shared by the key
    head's programs, whose last one shifts their state), the bits of ``conv_step`` then the step."""
    _check_conv(case, interpreted[2 * len(CASES) + CASES.index(case)], CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_conv_in_the_steps_launch_on_cuda(case):
    compiled_process()
    _check_conv(case, _conv_runs(case, CASES.index(case), cuda=True), CASES.index(case), exact=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_delta_step_on_cuda_matches_the_torch_decode(case):
    compiled_process()
    *inputs, state, slots = (t.cuda() for t in _inputs(case, CASES.index(case)))
    got = gpu.delta_step(*inputs, state, slots)
    _check(case, got.cpu(), state.cpu(), CASES.index(case))


def test_bad_shapes_are_named():
    q = torch.zeros(2, 1, 8)
    args = (q, q, torch.zeros(2, 2, 4), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"float32 state \(S, Hv, dk, dv\)"):
        gpu.delta_step(*args, torch.zeros(3, 2, 8, 5), torch.arange(2))
    with pytest.raises(ValueError, match=r"float32 state"):
        gpu.delta_step(*args, torch.zeros(3, 2, 8, 4, dtype=torch.bfloat16), torch.arange(2))
    with pytest.raises(ValueError, match=r"out: a contiguous \(B, Hv, dv\)"):
        gpu.delta_step(*args, torch.zeros(3, 2, 8, 4), torch.arange(2), out=torch.zeros(2, 2, 5))


# a Qwen3.6-35B-A3B layer's step, for sm_90: bf16 rows of the projection, float32 states, dk = dv = 128
POINTERS = {**{f"{t}_ptr": "*bf16" for t in ("q", "k", "v", "a", "b", "out", "z")}, "a_log_ptr": "*fp32",
            "dt_bias_ptr": "*fp32", "state_ptr": "*fp32", "slots_ptr": "*i64", "scale": "fp32", "eps": "fp32",
            "norm_ptr": "*fp32", "norm_eps": "fp32", "parts_ptr": "*fp32", "count_ptr": "*i32",
            "conv_ptr": "*fp32", "conv_w_ptr": "*bf16", "conv_count_ptr": "*i32"}
STEP = {"DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": gpu.BLOCK_V}
NORM = {"NORM": True, "BLOCK_DV": 128}
CONV = {"CONV": 4, "BLOCK_CK": 4}


def test_delta_step_compiles_for_an_h100_without_one():
    from kvslim.gpu import _delta_step_kernel as kernel
    assert compile_for_sm90(kernel.delta_step, POINTERS, STEP, 1).asm["cubin"]


@pytest.mark.parametrize("folds,before,most", [({}, 3, 3), (NORM, 3, 4), ({**NORM, **CONV}, 2, 4)],
                         ids=["step", "norm", "conv-norm"])
def test_a_programs_loads_go_out_together(folds, before, most):
    """sm_90's SASS (``gpu.load_waves``): every load goes out at once behind the slot's (the
    state's address needs it), so a program stops on memory twice before its first counter's
    fence, and the last programs once more each (the conv's re-reads its held q and k to shift
    them, the norm's reads the head's o); no spills. Loaded where each was used, the step with
    its conv and norm (the model's launch) stopped 4 times before the conv's counter and 12 in
    all (11 under Triton 3.6), the slot loaded again past the counter's fence, then the state;
    with the norm alone 3 and 5 (4 and 5). Without the conv, Triton 3.6 widens q and k through
    shared memory as they arrive: one wait more there (3), none under 3.9 (2)."""
    from kvslim.gpu import _delta_step_kernel as kernel, cuobjdump, load_waves
    compiled = compile_for_sm90(kernel.delta_step, POINTERS, {**STEP, **folds}, 1)
    sass = cuobjdump(compiled, "-sass")
    fence = sass.find("MEMBAR")
    assert load_waves(sass[:fence] if fence > 0 else sass) <= before and load_waves(sass) <= most
    assert spilled_bytes(compiled) == 0


def test_delta_step_with_its_conv_compiles_with_its_ordering():
    """The step that also takes the conv (and the norm), for sm_90: no local memory; the v
    state's shift before, and q's and k's after, the (sequence, key head) counter's atomic."""
    from kvslim.gpu import _delta_step_kernel as kernel
    ptx = compile_for_sm90(kernel.delta_step, POINTERS, {**STEP, **NORM, **CONV}, 1).asm["ptx"]
    assert ".local" not in ptx
    counted = ptx.index("atom.global.gpu.acq_rel.add")                   # the conv's counter comes first
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "st.global" in ptx[counted:ptx.index("atom.global.gpu.relaxed.exch")]


def test_delta_step_with_its_norm_compiles_with_its_ordering():
    """The step that also applies the output norm, for sm_90: each program's store of its o
    columns, a barrier, then the acq_rel atomic; the head's o read back from L2 after it."""
    from kvslim.gpu import _delta_step_kernel as kernel
    ptx = compile_for_sm90(kernel.delta_step, POINTERS, {**STEP, **NORM}, 1).asm["ptx"]
    counted = ptx.index("atom.global.gpu.acq_rel.add")
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, counted):counted]
    assert "ld.global.cg" in ptx[counted:] and "atom.global.gpu.relaxed.exch" in ptx[counted:]
