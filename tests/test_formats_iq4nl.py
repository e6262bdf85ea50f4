"""iq4_nl: gguf.quants has no quantizer for it, so we check against
(1) a scalar transliteration of llama.cpp's quantize_row_iq4_nl_ref (slow and
obvious, written from the C source's logic), and (2) golden bytes produced by
llama.cpp's own libggml (tests/data/iq4_nl_golden.npz, see make_iq4nl_golden.py).
"""
import pathlib

import numpy as np
import pytest
import torch

from kvslim import formats
from kvslim.formats.ggml import IQ4NL_VALUES

GOLDEN = pathlib.Path(__file__).parent / "data" / "iq4_nl_golden.npz"
f32 = np.float32


def best_index(x: np.float32) -> int:
    vals = IQ4NL_VALUES
    if x <= vals[0]:
        return 0
    if x >= vals[-1]:
        return len(vals) - 1
    lo, hi = 0, len(vals) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < vals[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if f32(x - f32(vals[hi - 1])) < f32(f32(vals[hi]) - x) else hi


def fit(xb, w, inv):
    sumqx = sumq2 = f32(0)
    for j in range(32):
        q = f32(IQ4NL_VALUES[best_index(f32(inv * xb[j]))])
        sumqx = f32(sumqx + f32(f32(w[j] * q) * xb[j]))
        sumq2 = f32(sumq2 + f32(f32(w[j] * q) * q))
    return sumqx, sumq2


def reference_block(xb: np.ndarray) -> bytes:
    """One block, scalar float32 arithmetic in the C code's order."""
    xb = xb.astype(f32)
    w = (xb * xb).astype(f32)
    amax, mx = f32(0), f32(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = f32(abs(v)), v
    d = f32(0)
    if amax >= f32(1e-15):
        d = f32(-mx / f32(IQ4NL_VALUES[0]))
        sumqx, sumq2 = fit(xb, w, f32(f32(1) / d))
        d = f32(sumqx / sumq2)
        best = f32(d * sumqx)
        for itry in range(-7, 8):
            sx, s2 = fit(xb, w, f32(f32(itry + IQ4NL_VALUES[0]) / mx))
            if s2 > 0 and f32(sx * sx) > f32(best * s2):
                d = f32(sx / s2)
                best = f32(d * sx)
    inv = f32(f32(1) / d) if d != 0 else f32(0)
    idx = [best_index(f32(inv * v)) for v in xb]
    qs = bytes(idx[j] | (idx[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + qs


def test_matches_scalar_reference_on_random_and_edge_blocks():
    rng = np.random.default_rng(11)
    blocks = [rng.standard_normal(32) * 10 ** rng.uniform(-3, 3) for _ in range(150)]
    blocks += [rng.standard_t(2, 32) for _ in range(50)]
    blocks += [np.zeros(32), np.full(32, 2.5), np.arange(32) - 16.0, np.full(32, 1e-20)]
    x = np.stack(blocks).astype(np.float32)
    ours = formats.get("iq4_nl").encode(torch.from_numpy(x)).numpy()
    for i, xb in enumerate(x):
        assert ours[i].tobytes() == reference_block(xb), f"block {i} differs"


def test_zero_block_layout():
    packed = formats.get("iq4_nl").encode(torch.zeros(1, 32))
    assert packed[0, :2].tolist() == [0, 0] and set(packed[0, 2:].tolist()) == {0x88}


def test_decode_uses_the_nonlinear_grid():
    packed = torch.zeros(1, 18, dtype=torch.uint8)
    packed[0, :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)   # fp16 1.0
    packed[0, 2:] = torch.arange(16, dtype=torch.uint8) | (torch.arange(16, dtype=torch.uint8) << 4)
    y = formats.get("iq4_nl").decode(packed, 32)[0]
    assert y[:16].tolist() == list(map(float, IQ4NL_VALUES)) == y[16:].tolist()


@pytest.mark.skipif(not GOLDEN.exists(), reason="golden file from libggml not generated")
def test_bytes_identical_to_llama_cpp_libggml():
    data = np.load(GOLDEN)
    ours = formats.get("iq4_nl").encode(torch.from_numpy(data["x"])).numpy()
    mismatched = np.flatnonzero((ours != data["q"]).any(-1))
    assert mismatched.size == 0, f"{mismatched.size} of {len(ours)} blocks differ from libggml"
