"""The Triton row rotations (kvslim/gpu/rotation.py) against the formats' torch forms, on the CPU.

The kernel runs under Triton's interpreter in one child process (tests/triton_harness.py):
llama.cpp's Hadamard rotation (q8_0, q4_0 and iq4_nl K/V) bit for bit against the torch
butterfly, on a decode step's queries as the gated query projection leaves them (rows and heads
strided), on a head of 96 (runs of 32, a padded tile) and on f16 rows; TurboQuant's group
rotation and its inverse against ``TurboFormat.rotate`` / ``unrotate`` within float32 sums.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvslim import formats
from kvslim.formats.rotation import hadamard_blocks_torch
from kvslim.gpu import available
from kvslim.gpu import rotation as gpu

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted, spilled_bytes

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

# (tokens, heads, head_dim, run n, dtype)
HADAMARD = [(3, 8, 256, 256, "bfloat16"), (5, 2, 96, 32, "float32"), (2, 4, 64, 64, "float16")]
# (tokens, heads, head_dim, format): turbo4 at 256 has two groups of 128; at 96 one group of 96
TURBO = [(3, 8, 256, "turbo4"), (4, 2, 96, "turbo3")]


def _queries(tokens: int, heads: int, dim: int, dtype: str, seed: int) -> torch.Tensor:
    """Queries as a gated projection leaves them: each head's first half of (N, H, 2D), strided."""
    q = torch.randn(tokens, heads, 2 * dim, generator=torch.Generator().manual_seed(seed)) * 3
    return q.to(getattr(torch, dtype))[..., :dim]


def _turbo(case) -> tuple[torch.Tensor, torch.Tensor, object]:
    tokens, heads, dim, name = case
    fmt = formats.get(name, role="k")
    _, g = fmt.blocks(dim)
    from kvslim.formats.rotation import rotation_matrix
    return _queries(tokens, heads, dim, "bfloat16", 7), rotation_matrix(g, fmt.seed), fmt


# formats and roles whose code domains the attention paths move q into and the output out of
DOMAINS = [("q8_0", "k"), ("q8_0", "v"), ("turbo4", "k"), ("turbo3", "v"), ("f16", "k"), ("nl4", "v")]


def rotations_in_child(cases, path: Path) -> None:
    """In the interpreted child: every HADAMARD case, each TURBO case rotated and back, and
    ``to_code_domain`` / ``from_code_domain`` of the DOMAINS formats (the kernels on)."""
    out = {"hadamard": [gpu.hadamard(_queries(*c[:3], c[4], i), c[3]) for i, c in enumerate(HADAMARD)], "turbo": []}
    for case in TURBO:
        q, r, _ = _turbo(case)
        rotated = gpu.rotate(q, r.T)
        out["turbo"].append((rotated, gpu.rotate(rotated, r)))
    q = _queries(3, 4, 256, "bfloat16", 3)
    out["domains"] = [(gpu.to_code_domain(fmt, q), gpu.from_code_domain(fmt, q.float()))
                      for fmt in (formats.get(name, role=role) for name, role in DOMAINS)]
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_gpu_rotation", "rotations_in_child", None, tmp_path_factory.mktemp("rot"))


def _check_hadamard(case, got: torch.Tensor, seed: int) -> None:
    q = _queries(*case[:3], case[4], seed)
    want = hadamard_blocks_torch(q, case[3])
    assert got.dtype == torch.float32 and torch.equal(got, want)


def _check_turbo(case, rotated: torch.Tensor, back: torch.Tensor) -> None:
    """Against the format's torch rotation within float32 sums of g products (values up to ~10),
    and back to the queries within two such sums."""
    q, _, fmt = _turbo(case)
    torch.testing.assert_close(rotated, fmt.rotate(q.float()), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(back, q.float(), atol=4e-5, rtol=1e-5)
    torch.testing.assert_close(back, fmt.unrotate(fmt.rotate(q.float())), atol=4e-5, rtol=1e-5)


@pytest.mark.parametrize("case", HADAMARD, ids=lambda c: f"n{c[0]}-h{c[1]}-d{c[2]}-run{c[3]}-{c[4]}")
def test_hadamard_is_the_torch_butterfly_bit_for_bit(interpreted, case):
    _check_hadamard(case, interpreted["hadamard"][HADAMARD.index(case)], HADAMARD.index(case))


@pytest.mark.parametrize("case", TURBO, ids=lambda c: f"n{c[0]}-h{c[1]}-d{c[2]}-{c[3]}")
def test_group_rotation_matches_turbo_and_inverts(interpreted, case):
    _check_turbo(case, *interpreted["turbo"][TURBO.index(case)])


@pytest.mark.parametrize("domain", DOMAINS, ids=lambda d: "-".join(d))
def test_the_attention_paths_code_domains_are_the_formats(interpreted, domain):
    """``to_code_domain`` / ``from_code_domain`` with the kernels on give the format's own torch
    forms on float32 rows: the Hadamard formats' bits, TurboQuant's within float32 sums; f16's
    identity (a float32 copy) and the format's declaration where it has one."""
    fmt = formats.get(domain[0], role=domain[1])
    q = _queries(3, 4, 256, "bfloat16", 3).float()
    got_to, got_from = interpreted["domains"][DOMAINS.index(domain)]
    want_to, want_from = fmt.to_code_domain(q), fmt.from_code_domain(q)
    assert got_to.dtype == got_from.dtype == torch.float32
    if domain[0] == "turbo4" or domain[0] == "turbo3":
        torch.testing.assert_close(got_to, want_to, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got_from, want_from, atol=2e-5, rtol=1e-5)
    else:
        assert torch.equal(got_to, want_to) and torch.equal(got_from, want_from)
    declared = fmt.code_rotation(256, "cpu")
    assert (declared is None) == (not fmt.transformed) and (domain[0] == "f16") == (not fmt.transformed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
def test_rotations_on_cuda_match_the_torch_forms():
    compiled_process()
    for i, case in enumerate(HADAMARD):
        _check_hadamard(case, gpu.hadamard(_queries(*case[:3], case[4], i).cuda(), case[3]).cpu(), i)
    for case in TURBO:
        q, r, _ = _turbo(case)
        rotated = gpu.rotate(q.cuda(), r.T.cuda())
        _check_turbo(case, rotated.cpu(), gpu.rotate(rotated, r.cuda()).cpu())


def test_bad_rotations_are_named():
    with pytest.raises(ValueError, match="power of two"):
        gpu.hadamard(torch.zeros(2, 96), 48)
    with pytest.raises(ValueError, match="float32 \\(g, g\\) matrix"):
        gpu.rotate(torch.zeros(2, 96), torch.eye(64))
    with pytest.raises(ValueError, match="a float tensor"):
        gpu.hadamard(torch.zeros(2, 64, dtype=torch.int32), 64)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("hadamard", [True, False], ids=["hadamard", "matrix"])
def test_rotate_rows_compiles_for_an_h100_without_one(hadamard, gated):
    """Both forms for sm_90, plain (float32 out) and with gated attention's gate (bf16 in and out),
    without spilling registers (the matrix form in one tl.dot spilled 7,064 bytes a thread); the
    matrix form's program issues every load before it reads one."""
    from kvslim.gpu import _rotation_kernel as kernel
    pointers = {"x_ptr": "*bf16", "m_ptr": "*fp32", "out_ptr": "*bf16" if gated else "*fp32", "rot_scale": "fp32",
                "gate_ptr": "*bf16"}
    constexprs = gpu.launch_config(256, 256 if hadamard else 128, 8 if hadamard else None, gated)
    num_warps = constexprs.pop("num_warps")
    compiled = compile_for_sm90(kernel.rotate_rows, pointers, constexprs, num_warps)
    assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"] and spilled_bytes(compiled) == 0
    if not hadamard:        # a program's slice of the matrix, x and the gate come in one round trip
        from kvslim.gpu import cuobjdump, load_waves
        assert load_waves(cuobjdump(compiled, "-sass")) == 1     # the whole-matrix program's: 8, and 9 gated
