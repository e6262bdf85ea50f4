"""ggml block types against gguf.quants (numpy ports of llama.cpp's C reference)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from kvslim import formats

ORACLE_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
N_RANDOM_BLOCKS = 100_000


def random_blocks(n: int, seed: int) -> np.ndarray:
    """Mixed distributions and magnitudes: normal, heavy-tailed, skewed, outliers."""
    rng = np.random.default_rng(seed)
    kinds = [
        rng.standard_normal((n // 4, 32)),
        rng.standard_t(2.0, (n // 4, 32)),
        rng.exponential(1.0, (n // 4, 32)) - 0.2,
        rng.standard_normal((n - 3 * (n // 4), 32)) * (1 + 50 * (rng.random((n - 3 * (n // 4), 32)) < 0.02)),
    ]
    blocks = np.concatenate(kinds)
    blocks *= 10.0 ** rng.uniform(-4, 3, (len(blocks), 1))      # scales across many magnitudes
    amax = np.abs(blocks).max(-1, keepdims=True)
    blocks *= np.minimum(1.0, 3e4 / amax)                           # stay inside every type's fp16 fields
    return blocks.astype(np.float32)


def edge_blocks() -> np.ndarray:
    """All zeros, one huge value, exact ties, rounding half-points, subnormals, constants."""
    rows = [np.zeros(32), np.full(32, 3.0), np.full(32, -1e-3)]
    huge = np.random.default_rng(1).standard_normal(32); huge[7] = 2e4; rows.append(huge)
    tie = np.linspace(-1, 1, 32); tie[3], tie[20] = 5.0, -5.0; rows.append(tie)           # +-max tie
    tie2 = tie.copy(); tie2[3], tie2[20] = -5.0, 5.0; rows.append(tie2)
    half = np.arange(32) - 15.5; half[0] = 127.0; rows.append(half)                         # q8_0 .5 ties
    rows.append(np.arange(32) - 16.0)                                                       # q4/q5 exact steps
    rows.append(np.arange(32) * 0.5 - 8.0)
    rows.append(np.full(32, 1e-40))                                                         # fp32 subnormal
    sub = np.random.default_rng(2).standard_normal(32) * 1e-39; rows.append(sub)
    rows.append(np.random.default_rng(3).standard_normal(32) * 1e-6)                        # fp16-subnormal scale
    rows.append(np.random.default_rng(4).standard_normal(32) * 1e4)                         # near the fp16 top
    one = np.zeros(32); one[31] = -7.0; rows.append(one)
    return np.stack(rows).astype(np.float32)


@pytest.fixture(scope="module")
def blocks():
    return np.concatenate([random_blocks(N_RANDOM_BLOCKS, 0), edge_blocks()])


def oracle_quantize(blocks: np.ndarray, name: str) -> np.ndarray:
    """gguf.quants' bytes. The edge blocks (scales that overflow fp16, infinities) make its numpy
    divide and cast overflow on purpose, as the C reference does; the warnings say nothing here."""
    with np.errstate(over="ignore", invalid="ignore"):
        return quants.quantize(blocks, T[name.upper()])


@pytest.mark.parametrize("name", ORACLE_TYPES)
def test_bytes_identical_to_gguf_quants(name, blocks):
    fmt = formats.get(name)
    ours = fmt.encode(torch.from_numpy(blocks)).numpy()
    ref = oracle_quantize(blocks, name)
    mismatched = np.flatnonzero((ours != ref).any(-1))
    assert mismatched.size == 0, f"{name}: {mismatched.size} blocks differ, first {mismatched[:5]}"


@pytest.mark.parametrize("name", ORACLE_TYPES)
def test_decode_identical_to_gguf_quants(name, blocks):
    ref_bytes = oracle_quantize(blocks, name)
    ours = formats.get(name).decode(torch.from_numpy(ref_bytes), 32).numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = quants.dequantize(ref_bytes, T[name.upper()])
    np.testing.assert_array_equal(ours, want)


def test_multi_block_rows_are_blocks_in_order():
    x = torch.randn(5, 256)
    packed = formats.get("q4_0-norot").encode(x)
    ref = quants.quantize(x.reshape(-1, 32).numpy(), T.Q4_0).reshape(5, -1)
    np.testing.assert_array_equal(packed.numpy(), ref)


@pytest.mark.parametrize("name,nmse", [("q8_0", 0.00003), ("q5_1", 0.00143), ("q5_0", 0.00182),
                                       ("q4_1", 0.00612), ("q4_0", 0.00738)])
def test_normalised_mse_matches_published_figures(name, nmse):
    x = torch.randn(20000, 128, generator=torch.Generator().manual_seed(5))
    fmt = formats.get(name)
    y = fmt.decode(fmt.encode(x), 128)
    got = ((x - y).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    assert got == pytest.approx(nmse, rel=0.05)
