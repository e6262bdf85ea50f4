"""nl4 / nl3: llama.cpp's rotation, an fp16 scale per block and a fitted grid; nl4s / nl3s:
the same with two scale levels (fp16 per 128, a 2-bit ladder rung per 16).

The fast encoder is checked byte for byte against a slow per-block reference written
from the format's description, then for error, hooks, attention and refusals."""
import pytest
import torch

from kvslim import formats
from kvslim.cache import KVCache, KVLayerSpec, attend, attend_reference
from kvslim.formats.grid import GRIDS, SCALE_SPAN, SCALE_TRIES, SUB_LADDER
from kvslim.formats.rotation import hadamard_blocks, llama_rot_size

NL = ["nl4", "nl3", "nl4s", "nl3s"]


def reference_block(v: torch.Tensor, grid: torch.Tensor) -> tuple[float, list[int]]:
    """One block, plainly: try each candidate scale, nearest grid point per value by argmin,
    least-squares refit, keep the best; reassign with it and refit once more."""
    amax = float(v.abs().max())
    if amax == 0:
        return 0.0, [int((grid.abs()).argmin())] * len(v)
    best, best_d = -1.0, 0.0
    for f in torch.linspace(SCALE_SPAN[0], SCALE_SPAN[1], SCALE_TRIES).tolist():
        d = amax / float(grid.abs().max()) * f
        g = grid[(v[:, None] / d - grid[None, :]).abs().argmin(-1)]
        sxg, sgg = float((g * v).sum()), float((g * g).sum())
        if sxg * sxg / sgg > best:
            best, best_d = sxg * sxg / sgg, sxg / sgg
    codes = (v[:, None] / best_d - grid[None, :]).abs().argmin(-1)
    g = grid[codes]
    return float((g * v).sum() / (g * g).sum()), codes.tolist()


def reference_row(fmt, x: torch.Tensor, role: str) -> tuple[list[float], list[list[int]]]:
    y = hadamard_blocks(x[None], llama_rot_size(x.shape[-1], role))[0]
    grid = torch.tensor(GRIDS[fmt.spec.code_bits])
    out = [reference_block(b, grid) for b in y.reshape(-1, fmt.spec.block_size)]
    return [d for d, _ in out], [c for _, c in out]


def unpack(fmt, packed: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Scales and codes of one packed row, read bit by bit (little-endian, dense)."""
    blocks = packed.reshape(-1, fmt.spec.block_bytes)
    d = blocks[:, :2].contiguous().view(torch.float16).float().flatten()
    bits, n = fmt.spec.code_bits, fmt.spec.block_size
    codes = []
    for blk in blocks[:, 2:]:
        stream = sum(int(b) << (8 * i) for i, b in enumerate(blk.tolist()))
        codes.append([(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(n)])
    return d, codes


def reference_two_level(y: torch.Tensor, grid: torch.Tensor) -> tuple[float, list[int], list[int]]:
    """One nls block of 128, plainly: d starts at the largest sub-block scale (the nl search
    per 16), then twice: each sub-block takes the rung and nearest codes of least squared
    error, d is refit by least squares and rounded to fp16."""
    subs = y.reshape(-1, 16)
    d = torch.tensor(max(reference_block(b, grid)[0] for b in subs)).half().float().item()
    for _ in range(2):
        rungs, codes = [], []
        for b in subs:
            trials = []
            for j, f in enumerate(SUB_LADDER):
                s = max(d * f, 1e-30)
                c = (b[:, None] / s - grid[None, :]).abs().argmin(-1)
                trials.append((float(((b - grid[c] * s) ** 2).sum()), j, c.tolist()))
            _, j, c = min(trials, key=lambda t: t[:2])
            rungs.append(j), codes.extend(c)
        g = grid[torch.tensor(codes)] * torch.tensor(SUB_LADDER)[torch.tensor(rungs)].repeat_interleave(16)
        d = torch.tensor(float((g * y).sum() / max(float((g * g).sum()), 1e-30))).half().float().item()
    return d, rungs, codes


def unpack_two_level(fmt, packed: torch.Tensor) -> tuple[float, list[int], list[int]]:
    """Scale, rungs and codes of one packed 128-value nls block, read bit by bit."""
    d = packed[:2].contiguous().view(torch.float16).float().item()
    def fields(data, bits, n):
        stream = sum(int(b) << (8 * i) for i, b in enumerate(data.tolist()))
        return [(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(n)]
    return d, fields(packed[2:4], 2, 8), fields(packed[4:], fmt.spec.code_bits, 128)


@pytest.mark.parametrize("name", ["nl4s", "nl3s"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_two_level_encoder_matches_the_reference(name, role):
    fmt = formats.get(name, role=role)
    grid = torch.tensor(GRIDS[fmt.spec.code_bits])
    gen = torch.Generator().manual_seed(17)
    rows = [torch.randn(128, generator=gen), torch.randn(128, generator=gen) * 1e-3, torch.zeros(128),
            torch.randn(128, generator=gen) * torch.linspace(0.1, 3, 128)]   # uneven sub-blocks
    rows[0][9] = 25.0
    for x in rows:
        y = hadamard_blocks(x[None], llama_rot_size(128, role))[0]
        d_ref, rungs_ref, codes_ref = reference_two_level(y, grid)
        d, rungs, codes = unpack_two_level(fmt, fmt.encode(x[None])[0])
        assert d == pytest.approx(d_ref, rel=1e-3, abs=0)
        assert sum(a != b for a, b in zip(rungs, rungs_ref)) <= 1
        assert sum(a != b for a, b in zip(codes, codes_ref)) <= 2          # float ties at a midpoint


@pytest.mark.parametrize("name", ["nl4", "nl3"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_fast_encoder_matches_the_reference(name, role):
    fmt = formats.get(name, role=role)
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randn(128, generator=gen), torch.randn(128, generator=gen) * 1e-3,
            torch.zeros(128), torch.randn(128, generator=gen).exp()]        # skewed, all positive
    rows[0][9] = 25.0                                                        # an outlier channel
    for x in rows:
        d_ref, codes_ref = reference_row(fmt, x, role)
        d, codes = unpack(fmt, fmt.encode(x[None])[0])
        torch.testing.assert_close(d, torch.tensor(d_ref).half().float(), rtol=1e-3, atol=0)
        mismatched = sum(a != b for ca, cb in zip(codes, codes_ref) for a, b in zip(ca, cb))
        assert mismatched <= 1, f"{mismatched} codes differ"                # float ties at a midpoint


@pytest.mark.parametrize("name,row_bytes,bits", [("nl4", 68, 4.25), ("nl3", 56, 3.5), ("nl4s", 68, 4.25),
                                                  ("nl3s", 52, 3.25)])
def test_sizes(name, row_bytes, bits):
    fmt = formats.get(name)
    assert fmt.row_bytes(128) == row_bytes and fmt.bits_per_value(128) == bits
    assert fmt.encode(torch.randn(3, 128)).shape == (3, row_bytes)
    layout = fmt.row_layout(256)
    assert layout.row_bytes == 2 * row_bytes and layout.fields[0].name == "scale"


@pytest.mark.parametrize("name,bound", [("nl4", 0.0072), ("nl3", 0.0265), ("nl4s", 0.0058), ("nl3s", 0.0237)])
def test_error_on_gaussian_rows(name, bound):
    x = torch.randn(4000, 128, generator=torch.Generator().manual_seed(8))
    fmt = formats.get(name)
    nmse = float(((fmt.decode(fmt.encode(x), 128) - x) ** 2).sum() / (x ** 2).sum())
    assert nmse < bound
    turbo = formats.get("turbo4" if name.startswith("nl4") else "turbo3")
    turbo_nmse = float(((turbo.decode(turbo.encode(x), 128) - x) ** 2).sum() / (x ** 2).sum())
    assert nmse < 0.8 * turbo_nmse                      # and clearly below TurboQuant's at a similar size


@pytest.mark.parametrize("name", NL)
@pytest.mark.parametrize("role", ["k", "v"])
def test_hooks_keep_scores_and_values(name, role):
    fmt = formats.get(name, role=role)
    x = torch.randn(30, 256, generator=torch.Generator().manual_seed(9))
    q = torch.randn(2, 256, generator=torch.Generator().manual_seed(10))
    packed = fmt.encode(x)
    plain, coded = fmt.decode(packed, 256), fmt.decode_code_domain(packed, 256)
    torch.testing.assert_close(fmt.to_code_domain(q) @ coded.T, q @ plain.T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fmt.from_code_domain(coded), plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("type_k,type_v", [("nl4", "nl4"), ("nl3", "nl3"), ("q8_0", "nl3"), ("nl4", "q4_0"),
                                           ("nl4s", "nl3s"), ("nl3s", "f16")])
def test_attention_matches_reference(type_k, type_v):
    gen = torch.Generator().manual_seed(11)
    cache = KVCache(KVLayerSpec(2, 128, type_k, type_v), ctx=256, page_size=32)
    cache.append(0, torch.randn(90, 2, 128, generator=gen), torch.randn(90, 2, 128, generator=gen))
    q = torch.randn(5, 4, 128, generator=gen)
    torch.testing.assert_close(attend(cache, 0, q[-5:], chunk_tokens=32), attend_reference(cache, 0, q[-5:]),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["nl4", "nl4s"])
def test_scale_is_relative(name):
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(12))
    fmt = formats.get(name)
    torch.testing.assert_close(fmt.decode(fmt.encode(x * 8), 128), 8 * fmt.decode(fmt.encode(x), 128),
                               rtol=2e-3, atol=1e-4)


def test_refusals():
    with pytest.raises(ValueError, match="multiple of 64"):
        formats.get("nl4").encode(torch.randn(2, 96))
    big = torch.full((1, 128), 6e4)
    with pytest.raises(ValueError, match="exceeds"):
        formats.get("nl3").encode(big)
    assert bool(formats.get("nl3").overflow_flag(big))
    with pytest.raises(ValueError, match="multiple of the block size 128"):
        formats.get("nl4s").encode(torch.randn(2, 64))
    with pytest.raises(ValueError, match="exceeds"):
        formats.get("nl4s").encode(torch.full((1, 128), 4e4))
    with pytest.raises(ValueError, match="role"):
        formats.get("nl4", role="x")
