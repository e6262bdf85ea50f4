"""klt3: the calibrated transform-coded V format (kvslim/formats/klt.py) and its calibration."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvslim import formats
from kvslim.cache import KVCache, KVLayerSpec, attend, attend_reference
from kvslim.formats.klt import MAX_BITS, KVCalibration, allocate, calibrate_layer, fit_grid


def correlated_rows(n: int, heads: int = 2, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows with a decaying spectrum and a mean, like a layer's values: (n, heads, dim)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for h in range(heads):
        basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(100 + h)))
        spread = torch.logspace(0, -2, dim)                  # 40 dB from the first direction to the last
        mean = torch.randn(dim, generator=torch.Generator().manual_seed(200 + h))
        out.append((torch.randn(n, dim, generator=gen) * spread) @ basis.T + mean)
    return torch.stack(out, 1)


@pytest.fixture(scope="module")
def calibration():
    return calibrate_layer(correlated_rows(6000), {"klt3": 2.625})


def nmse(x, y):
    return float(((x - y) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())


def test_allocation_is_exact_bounded_and_follows_variance():
    var = torch.logspace(2, -3, 128)
    bits = allocate(var, 2.625)
    assert int(bits.sum()) == 336 and int(bits.min()) >= 0 and int(bits.max()) <= MAX_BITS
    assert bool((bits[:-1] >= bits[1:]).all())               # more variance, never fewer bits
    assert int(allocate(torch.ones(64), 3.0).sum()) == 192 and set(allocate(torch.ones(64), 3.0).tolist()) == {3}


def test_fitted_grid_beats_the_gaussian_start_on_a_heavy_tailed_direction():
    x = torch.distributions.Laplace(0.0, 1.0).sample((20000,)).double()
    fitted = fit_grid(x, 3)
    start = fit_grid(x, 3, rounds=0)
    err = lambda g: float(((x - g[torch.bucketize(x, (g[1:] + g[:-1]) / 2)]) ** 2).mean())
    assert bool((fitted[1:] > fitted[:-1]).all()) and err(fitted) < 0.9 * err(start)


def test_sizes_come_from_the_table():
    fmt = formats.get("klt3", role="v")
    assert (fmt.row_bytes(128), fmt.bits_per_value(128), fmt.row_bytes(64), fmt.row_bytes(256)) == (44, 2.75, 23, 86)
    with pytest.raises(ValueError, match="multiple of 64"):
        fmt.check_head_dim(96)


def test_round_trip_uses_the_correlation(calibration):
    """On correlated rows (held out from the calibration), 2.75 bits/value beat rotated q4_0 at 4.5:
    the transform gain that a random rotation throws away."""
    fmt = formats.get("klt3").bind(calibration)
    x = correlated_rows(2000, seed=1)
    packed = fmt.encode(x)
    assert packed.shape == (2000, 2, 23) and packed.dtype == torch.uint8
    q4 = formats.get("q4_0", role="v")
    assert nmse(x, fmt.decode(packed, 64)) < 0.5 * nmse(x, q4.decode(q4.encode(x), 64))


def test_packing_is_lossless_for_every_code(calibration):
    fmt = formats.get("klt3").bind(calibration)
    bits, _ = calibration.tables["klt3"]
    gen = torch.Generator().manual_seed(3)
    codes = (torch.rand(50, 2, 64, generator=gen) * (1 << bits).float()).long()
    scale = torch.rand(50, 2, generator=gen) + 0.5
    values, got_scale = fmt._unpack(fmt._pack(scale.half().float(), codes))
    consts = fmt._tables(torch.device("cpu"))
    expect = torch.stack([consts.levels[h, torch.arange(64), codes[:, h]] for h in range(2)], 1)
    assert torch.equal(values, expect) and torch.equal(got_scale, scale.half().float())


def test_code_search_matches_counting_midpoints(calibration):
    """The batched binary search picks the same level as counting the midpoints below each value."""
    fmt = formats.get("klt3").bind(calibration)
    z, scale = fmt._spread_units(correlated_rows(300, seed=12).reshape(3, 100, 2, 64))
    u = z / scale[..., None]
    expect = (u.unsqueeze(-1) > fmt._tables(torch.device("cpu")).mids).sum(-1)
    assert torch.equal(fmt._codes(z, scale), expect)


@pytest.mark.parametrize("type_k", ["f16", "q4_0"])
def test_attention_matches_reference(calibration, type_k):
    cache = KVCache(KVLayerSpec(2, 64, type_k, "klt3"), ctx=256, page_size=32, n_slots=2, calibration=calibration)
    x = correlated_rows(120, seed=2)
    k = torch.randn(120, 2, 64, generator=torch.Generator().manual_seed(4))
    cache.append(0, k[:100], x[:100])
    q = torch.randn(100, 4, 64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(attend(cache, 0, q, chunk_tokens=32), attend_reference(cache, 0, q), atol=3e-5, rtol=1e-4)
    cache.append(0, k[100:101], x[100:101])
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(attend(cache, 0, q), attend_reference(cache, 0, q), atol=3e-5, rtol=1e-4)
    assert cache.static_decode                   # its bound format rides the DecodeBatch op by a registered name


def test_f16_window_joins_the_code_domain(calibration):
    cache = KVCache(KVLayerSpec(2, 64, "f16", "klt3"), ctx=256, page_size=32, f16_window=16, calibration=calibration)
    x = correlated_rows(70, seed=7)
    cache.append(0, torch.randn(70, 2, 64), x)
    q = torch.randn(3, 4, 64)
    torch.testing.assert_close(attend(cache, 0, q), attend_reference(cache, 0, q), atol=3e-5, rtol=1e-4)


def test_misuse_is_refused_clearly(calibration):
    with pytest.raises(ValueError, match="kvslim calibrate"):
        KVCache(KVLayerSpec(2, 64, "f16", "klt3"), ctx=64)
    with pytest.raises(ValueError, match="V cache type"):
        KVCache(KVLayerSpec(2, 64, "klt3", "f16"), ctx=64, calibration=calibration)
    with pytest.raises(ValueError, match="not bound"):
        formats.get("klt3").encode(torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="head_dim 64"):
        formats.get("klt3").bind(calibration).encode(torch.zeros(1, 2, 128))
    bound = formats.get("klt3").bind(calibration)
    for bad, msg in [(torch.full((1, 2, 64), float("nan")), "NaN or infinite"), (torch.zeros(0, 2, 64), "empty"),
                     (torch.ones(1, 2, 64, dtype=torch.int32), "floating-point"), ("rows", "torch.Tensor")]:
        with pytest.raises(ValueError, match=msg):
            bound.encode(bad)
    packed = bound.encode(correlated_rows(3))
    with pytest.raises(ValueError, match="bytes per row"):
        bound.decode(packed[..., :-1], 64)
    with pytest.raises(ValueError, match="too large for the fp16 row scale"):
        bound.encode(correlated_rows(1) * 1e9)


def test_calibration_file_round_trip_and_damage(calibration, tmp_path):
    KVCalibration([calibration, calibration], "synthetic").save(tmp_path / "c.safetensors")
    back = KVCalibration.load(tmp_path / "c.safetensors")
    assert back.source == "synthetic" and len(back.layers) == 2
    assert torch.equal(back.layers[1].basis, calibration.basis)
    assert torch.equal(back.layers[0].tables["klt3"][0], calibration.tables["klt3"][0])
    with pytest.raises(ValueError, match="layer 2 has none"):
        back.layer(2)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="cannot read the KV calibration"):
        KVCalibration.load(tmp_path / "bad.safetensors")


def test_bundled_model_ships_a_calibration_and_klt3_stays_close_to_f16():
    from kvslim.engine.llm import load
    from kvslim.loading import default_model
    llm = load(None, ctx=512, dtype=torch.float32, cache_type_k="nl4s", cache_type_v="klt3")
    assert llm.model.kv_calibration is not None and "klt3" in llm.model.kv_calibration.layers[0].tables
    text = (default_model().parent / "text" / "austen-heldout.txt").read_text()[:3000]
    ids = llm.tokenize(text, add_special=False)[:300]
    ref = torch.log_softmax(llm.with_cache_types("f16", "f16").logits(ids), -1)
    got = torch.log_softmax(llm.logits(ids), -1)
    kld = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert 0 < kld < 0.01


def test_a_model_without_calibration_names_the_fix(tmp_path):
    from kvslim.engine.llm import load
    from kvslim.loading import default_model
    src = default_model()
    for f in src.iterdir():
        if f.name != "kv-calibration.safetensors" and f.is_file():
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(ValueError, match="kvslim calibrate"):
        load(tmp_path, ctx=256, cache_type_v="klt3")


def test_calibrate_tool_writes_a_file_loading_finds(tmp_path):
    from kvslim.cli import main
    from kvslim.loading import default_model
    src = default_model()
    for f in src.iterdir():
        if f.name != "kv-calibration.safetensors" and f.is_file():
            (tmp_path / f.name).symlink_to(f)
    text = src.parent / "text" / "bible-heldout.txt"
    assert main(["calibrate", "-m", str(tmp_path), "-f", str(text), "-c", "1024", "--windows", "2"]) == 0
    cal = KVCalibration.load(tmp_path / "kv-calibration.safetensors")
    assert len(cal.layers) == 2 and cal.source == "bible-heldout.txt"
    shutil.rmtree(tmp_path)


def test_output_weighting_moves_bits_to_where_the_projection_reads():
    """Calibrated with the error measure |e @ W|, the weighted error is lower than with plain |e|:
    bits go to the directions the output projection amplifies, not only where V is large."""
    x = correlated_rows(6000)
    gen = torch.Generator().manual_seed(11)
    proj = torch.randn(2, 64, 64, generator=gen) * torch.logspace(1, -1, 64)      # uneven gains
    w = torch.linalg.cholesky(proj @ proj.transpose(-1, -2) + 1e-3 * torch.eye(64))
    w = w @ w.transpose(-1, -2)                                                   # symmetric PD
    weighted = calibrate_layer(x, {"klt3": 2.625}, w)
    torch.testing.assert_close(torch.einsum("hde,hef->hdf", weighted.basis, weighted.synthesis),
                               torch.eye(64).expand(2, 64, 64), atol=1e-4, rtol=0)
    held = correlated_rows(2000, seed=1)
    err = lambda cal: nmse(torch.einsum("nhd,hde->nhe", held, w),
                           torch.einsum("nhd,hde->nhe", formats.get("klt3").bind(cal).decode(
                               formats.get("klt3").bind(cal).encode(held), 64), w))
    plain = calibrate_layer(x, {"klt3": 2.625})
    assert err(weighted) < 0.8 * err(plain)


def test_output_weights_are_the_square_root_of_the_projection_gram():
    from kvslim.engine.calibrate import output_weights
    from kvslim.models.layers import Attention
    attn = Attention(96, n_heads=4, n_kv_heads=2, head_dim=32, eps=1e-6, o_bias=True)
    torch.nn.init.normal_(attn.o_proj.bias)
    w = output_weights(attn)
    W = attn.o_proj.weight.detach().double()
    for h in range(2):                      # query heads 2h and 2h+1 read KV head h
        cols = W[:, 64 * h:64 * (h + 1)].reshape(96, 2, 32)
        gram = torch.einsum("kgd,kge->de", cols, cols)
        torch.testing.assert_close(w[h] @ w[h], gram, atol=1e-6, rtol=1e-4)     # f32 projection
        torch.testing.assert_close(w[h], w[h].T)


def test_a_calibration_from_an_older_kvslim_still_loads(calibration, tmp_path):
    """Session-12 files: no synthesis matrix (orthogonal basis) and 64-level grids."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    flat = torch.randn(4000, 2, 64, generator=torch.Generator().manual_seed(9))
    cal = calibrate_layer(flat, {"klt3": 2.625})                 # white rows: every direction 2-3 bits
    assert int(cal.tables["klt3"][0].max()) <= 6
    KVCalibration([cal], "old").save(tmp_path / "new.safetensors")
    t = load_file(tmp_path / "new.safetensors")
    with safe_open(str(tmp_path / "new.safetensors"), "pt") as f:
        meta = f.metadata()
    del t["layer0.synthesis"]
    t["layer0.klt3.grid"] = t["layer0.klt3.grid"][..., :64].contiguous()
    save_file(t, tmp_path / "old.safetensors", metadata=meta)
    old = formats.get("klt3").bind(KVCalibration.load(tmp_path / "old.safetensors").layer(0))
    new = formats.get("klt3").bind(cal)
    x = torch.randn(50, 2, 64, generator=torch.Generator().manual_seed(10))
    assert torch.equal(old.encode(x), new.encode(x))
    torch.testing.assert_close(old.decode(old.encode(x), 64), new.decode(new.encode(x), 64), atol=1e-5, rtol=1e-5)


def test_quant_measures_klt3_on_a_random_calibration(capsys):
    """kvslim quant times a calibrated type too, fitted to random draws (white: no transform gain,
    so its error sits near a 2.6-bit scalar quantizer's, worse than nl3s at 3.25 bits)."""
    import json
    from kvslim.cli import main
    assert main(["quant", "-t", "klt3,nl3s", "--n", "2000", "-r", "1", "-o", "json", "--no-progress"]) == 0
    rows = {r["type"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["klt3"]["bits_per_value"] == 2.75 and 0.04 < rows["klt3"]["nmse"] < 0.08
    assert rows["nl3s"]["nmse"] < rows["klt3"]["nmse"] and rows["klt3"]["decode_vps"] > 0
