"""TurboQuant: converged codebooks, MSE at the optimum, rotations, the product variant."""
import math

import numpy as np
import pytest
import torch

from kvslim import formats
from kvslim.formats.codebook import lloyd_max
from kvslim.formats.rotation import rotation_matrix

# Optimal distortion of a rotated unit vector (shared/FACTS.md, exact optimum).
OPTIMUM = {128: {1: 0.3609, 2: 0.1160, 3: 0.03397, 4: 0.009315},
           256: {1: 0.3621, 2: 0.1167, 3: 0.03426, 4: 0.009408}}
# Lloyd-Max centroids for N(0, 1), positive half; ours are for the exact Beta
# density at d=128 scaled by sqrt(d), so they sit slightly inside these.
GAUSS = {2: [0.452780, 1.510418], 3: [0.245094, 0.756005, 1.343909, 2.151946]}


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_reaches_the_published_optimum(dim, bits):
    cb = lloyd_max(dim, bits)
    assert cb.distortion == pytest.approx(OPTIMUM[dim][bits], rel=2e-3)
    assert cb.distortion > 4.0 ** -bits                       # never below the lower bound
    np.testing.assert_allclose(cb.centroids, -cb.centroids[::-1], atol=1e-9)   # symmetric


@pytest.mark.parametrize("bits", [2, 3])
def test_codebook_tends_to_the_gaussian_one(bits):
    half = lloyd_max(128, bits).centroids[1 << (bits - 1):] * math.sqrt(128)
    np.testing.assert_allclose(half, GAUSS[bits], rtol=0.015)


def _nmse(name, head_dim, n=40000, seed=0):
    x = torch.randn(n, head_dim, generator=torch.Generator().manual_seed(seed))
    fmt = formats.get(name)
    y = fmt.decode(fmt.encode(x), head_dim)
    return ((x - y).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()


# Pinned figures (measured with this code). The stored scale ||x|| / ||c|| keeps
# each vector's length; that costs about D^2/4 over the scalar optimum D (+2.4% at
# 2 bits) and gains at 3-4 bits, where it acts like a per-vector gain correction.
PINNED = {("turbo4", 128): 0.009170, ("turbo3", 128): 0.033802, ("turbo2", 128): 0.11883,
          ("turbo4", 256): 0.009170, ("turbo3", 256): 0.033802, ("turbo2", 256): 0.11883}


@pytest.mark.parametrize("name,head_dim", list(PINNED))
def test_turbo_mse_pinned_and_near_the_optimum(name, head_dim):
    got = _nmse(name, head_dim)
    assert got == pytest.approx(PINNED[name, head_dim], rel=0.01)
    bits = int(name[-1])
    # head_dim 256 is coded as two groups of 128, so the 128 optimum applies.
    assert got <= OPTIMUM[128][bits] * (1.03 if bits == 2 else 1.015)


def test_length_is_kept():
    x = torch.randn(1000, 128) * 3
    fmt = formats.get("turbo3")
    y = fmt.decode(fmt.encode(x), 128)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-3, atol=0)


@pytest.mark.parametrize("n", [64, 96, 128, 80])
def test_rotations_are_orthogonal_and_seeded(n):
    r = rotation_matrix(n, 7)
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-5, rtol=0)
    assert torch.equal(r, rotation_matrix(n, 7))
    assert not torch.equal(r, rotation_matrix(n, 8))


def test_keys_can_stay_rotated():
    """<q, k_hat> equals <rotate(q), decode_rotated(k)>: attention never un-rotates keys."""
    fmt = formats.get("turbo4")
    k, q = torch.randn(50, 256), torch.randn(256)
    packed = fmt.encode(k)
    full = fmt.decode(packed, 256) @ q
    rotated = fmt.decode_rotated(packed, 256) @ fmt.rotate(q)
    torch.testing.assert_close(full, rotated, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fmt.unrotate(fmt.rotate(q)), q, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["turbo4p", "turbo3p"])
def test_product_variant_is_unbiased_for_inner_products(name):
    """Mean of <q, x_hat> - <q, x> over many x is ~0 for the product variant,
    while the MSE variant at the same bits shrinks inner products."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20000, 128, generator=gen)
    q = x[:, :].roll(1, 0) + 0.5 * x                       # queries correlated with x
    fmt = formats.get(name)
    err = ((fmt.decode(fmt.encode(x), 128) - x) * q).sum(-1)
    scale = (x * q).sum(-1).abs().mean()
    assert abs(err.mean().item()) / scale.item() < 0.01
    mse = formats.get(name[:-1])
    mse_err = ((mse.decode(mse.encode(x), 128) - x) * q).sum(-1)
    assert mse_err.mean().item() / scale.item() < -0.002


def test_zero_vector_decodes_to_zero():
    for name in ("turbo2", "turbo4", "turbo4p"):
        fmt = formats.get(name)
        assert fmt.decode(fmt.encode(torch.zeros(2, 128)), 128).abs().max() == 0


def test_the_c_bucketize_gives_torchs_codes():
    """formats.base.bucketize (turbo's and the grids' code search) on the CPU takes kv_encode.c's
    count: torch.bucketize's codes for ties on a boundary, NaN (past the last) and infinities, in
    every build."""
    from kvslim.native import build, kv_encode
    if not build.compiler():
        pytest.skip("no C compiler: torch.bucketize serves")
    gen = torch.Generator().manual_seed(0)
    bounds = torch.sort(torch.randn(15, generator=gen)).values
    v = torch.randn(3000, generator=gen)
    v[:15] = bounds
    v[20], v[21], v[22] = float("nan"), float("inf"), -float("inf")
    assert kv_encode.serves_bucketize(v, bounds)
    for variant in (None, "avx2", "portable"):
        assert torch.equal(kv_encode.bucketize(v.view(30, 100), bounds, variant), torch.bucketize(v.view(30, 100), bounds))
    assert not kv_encode.serves_bucketize(v.double(), bounds.double())       # torch's for anything else
