"""klt3's C encoder (kv_encode.c's encode_klt and the per-head code-domain transforms the decode
step runs) against the torch encoder of kvslim/formats/klt.py, the reference.

The C projection sums in another order than torch's matmul, so a value on a grid midpoint, or a
row scale on an fp16 rounding edge, may land on the other side: rows may differ, rarely, and only
by such near-ties (the decoded error stays torch's). Overflow flags must agree exactly.
"""
from __future__ import annotations

from functools import cache

import pytest
import torch

from kvslim import formats
from kvslim.cache import KVCache, KVLayerSpec
from kvslim.formats.klt import calibrate_layer, random_calibration
from kvslim.native import build, kv_encode

pytestmark = pytest.mark.skipif(kv_encode._library() is None, reason="no C compiler: klt3 keeps the torch encoder")


def decaying_rows(n: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """(n, heads, dim) whose spread falls four decades from the strongest direction to the weakest:
    calibrated on these, directions get every width from 0 to 8 bits (random rows give 2 or 3)."""
    gen = torch.Generator().manual_seed(seed)
    rotation, _ = torch.linalg.qr(torch.randn(heads, dim, dim, generator=gen))
    white = torch.randn(n, heads, dim, generator=gen) * torch.logspace(0, -4, dim)
    return torch.einsum("nhd,hed->nhe", white, rotation) + torch.randn(heads, dim, generator=gen)


@cache
def bound(kind: str, heads: int, dim: int):
    cal = (random_calibration("klt3", heads, dim) if kind == "random"
           else calibrate_layer(decaying_rows(3000, heads, dim), {"klt3": 2.625}))
    return formats.get("klt3", role="v").bind(cal)


def sample_rows(fmt, n: int, seed: int = 1) -> torch.Tensor:
    """N(0, 1) rows at magnitudes 1e-2 .. 1e2, rows near the calibration's mean (tiny row scales,
    fp16 subnormal) and one on it (scale 0): (n + n // 4 + 1, H, D)."""
    heads, dim = fmt.cal.n_heads, fmt.cal.head_dim
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, heads, dim, generator=gen) * torch.logspace(-2, 2, n)[:, None, None]
    near = fmt.cal.mean + 1e-3 * torch.randn(n // 4, heads, dim, generator=gen)
    return torch.cat([wide, near, fmt.cal.mean[None]])


def assert_near_ties_only(fmt, x, codes, want):
    """At most 0.5% of rows differ, and the C rows decode to the error torch's do (over 20 draws of
    each case, native and portable builds: 0.01% of rows differed, at most 0.1% of one draw)."""
    differ = (codes != want).any(-1)
    assert differ.float().mean() <= 0.005, f"{int(differ.sum())} of {differ.numel()} rows differ"
    got, ref = (float(((fmt.decode(c, x.shape[-1]) - x) ** 2).sum()) for c in (codes, want))
    assert got == pytest.approx(ref, rel=1e-4)


CASES = [("random", 1, 64), ("random", 2, 64), ("random", 4, 64), ("random", 1, 128), ("random", 2, 128),
         ("decaying", 2, 64), ("decaying", 1, 128), ("decaying", 2, 128)]


@pytest.mark.parametrize("kind,heads,dim", CASES)
def test_the_c_encoder_writes_the_torch_encoders_bytes(kind, heads, dim):
    fmt = bound(kind, heads, dim)
    x = sample_rows(fmt, 800)
    codes, flags = kv_encode.encode_rows(fmt, x)
    want, want_flags = fmt.encode_flagged(x)
    assert not flags.any() and torch.equal(flags, want_flags)
    assert_near_ties_only(fmt, x, codes, want)


def scales(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., :2].contiguous().view(torch.float16).squeeze(-1).float()


@pytest.mark.parametrize("variant", list(build.VARIANTS))
def test_rows_torch_flags_are_flagged_and_coded_as_torch_codes_them(variant):
    """NaN, inf, a row whose scale overflows fp16 with finite values, and one whose squares
    overflow float32: the same flags, and the same code bytes (NaN codes as torch's searchsorted
    puts it: past every midpoint), scales non-finite in both."""
    fmt = bound("decaying", 2, 128)
    x = sample_rows(fmt, 200)
    x[1, 0, 5], x[2, 1, 0] = float("nan"), float("inf")
    x[3, 1] *= 1e6
    x[4, 0] = 1e30
    codes, flags = kv_encode.encode_rows(fmt, x, variant)
    want, want_flags = fmt.encode_flagged(x)
    assert torch.equal(flags, want_flags) and flags.nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert torch.equal(codes[1:5, :, 2:], want[1:5, :, 2:])
    assert not scales(codes[1:5]).isfinite().all(-1).any() and not scales(want[1:5]).isfinite().all(-1).any()
    good = ~flags
    assert_near_ties_only(fmt, x[good], codes[good], want[good])


@pytest.mark.parametrize("heads,dim", [(2, 64), (4, 64), (1, 128)])
def test_code_domain_transforms_are_the_formats(heads, dim):
    """to_code_domain_head / from_code_domain_head: KLTFormat's per-head affine maps (heads first
    there, rows (N, H, D) here), and back to the row."""
    fmt = bound("decaying", heads, dim)
    enc = kv_encode.RowEncoder(fmt, dim)
    x = sample_rows(fmt, 64)
    y = enc.code_domain(x)
    torch.testing.assert_close(y, fmt.to_code_domain(x.transpose(0, 1)).transpose(0, 1), atol=1e-3, rtol=1e-4)
    back = enc.code_domain(y, inverse=True)
    torch.testing.assert_close(back, fmt.from_code_domain(y.transpose(0, 1)).transpose(0, 1), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(back, x, atol=1e-3, rtol=1e-4)


def test_other_formats_code_domain_ignores_the_head():
    fmt = formats.get("q8_0", role="k")
    x = torch.randn(6, 2, 128)
    y = kv_encode.RowEncoder(fmt, 128).code_domain(x)
    torch.testing.assert_close(y, fmt.to_code_domain(x), atol=1e-5, rtol=1e-5)


def test_prompts_take_the_c_encoder_for_a_bound_klt3():
    fmt = bound("random", 2, 64)
    assert kv_encode.RowEncoder.for_prompts(fmt, 64) is not None
    assert kv_encode.RowEncoder.for_prompts(formats.get("klt3", role="v"), 64) is None      # unbound
    with pytest.raises(kv_encode.Unsupported, match="bound"):
        kv_encode.encoder(formats.get("klt3", role="v"), 64, kv_encode.Keep())
    with pytest.raises(ValueError, match="heads"):
        kv_encode.RowEncoder(fmt, 64)(torch.randn(3, 64))                 # the head axis is missing
    cache = KVCache(KVLayerSpec(2, 64, "q8_0", "klt3"), ctx=64, calibration=fmt.cal)
    assert cache.cpu_encoders is not None
