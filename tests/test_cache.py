"""KV cache and recurrent state: parity of the fast attention with the reference,
byte accounting, trimming, slot isolation, save/restore and refusals."""
import itertools

import pytest
import torch

from kvslim import formats
from kvslim.cache import (KVCache, KVLayerSpec, LayerCache, RecurrentStateCache, StateLayerSpec, attend,
                          attend_reference, load_cache, save_cache)

PAIR_TYPES = ["f16", "q8_0", "q4_0", "turbo3", "turbo4"]


def filled(type_k, type_v, head_dim=128, n_kv=2, n_tokens=150, page_size=32, window=0, seed=0, ctx=512):
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(KVLayerSpec(n_kv, head_dim, type_k, type_v), ctx=ctx, page_size=page_size,
                    f16_window=window, n_slots=2)
    k = torch.randn(n_tokens, n_kv, head_dim, generator=gen) * 2
    v = torch.randn(n_tokens, n_kv, head_dim, generator=gen)
    return cache, k, v, gen


@pytest.mark.parametrize("type_k,type_v", list(itertools.product(PAIR_TYPES, PAIR_TYPES)))
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_attention_matches_reference(type_k, type_v, head_dim, group):
    cache, k, v, gen = filled(type_k, type_v, head_dim)
    n_heads = cache.n_kv_heads * group
    # Prefill in two chunks (the second attends over the first), then decode steps.
    cache.append(0, k[:100], v[:100])
    q = torch.randn(100, n_heads, head_dim, generator=gen)
    torch.testing.assert_close(attend(cache, 0, q, chunk_tokens=32), attend_reference(cache, 0, q),
                               atol=2e-5, rtol=1e-4)
    cache.append(0, k[100:140], v[100:140])
    q = torch.randn(40, n_heads, head_dim, generator=gen)
    torch.testing.assert_close(attend(cache, 0, q, chunk_tokens=64), attend_reference(cache, 0, q),
                               atol=2e-5, rtol=1e-4)
    for t in range(140, 143):
        cache.append(0, k[t:t + 1], v[t:t + 1])
        q = torch.randn(1, n_heads, head_dim, generator=gen)
        torch.testing.assert_close(attend(cache, 0, q), attend_reference(cache, 0, q), atol=2e-5, rtol=1e-4)


def test_reference_equals_exact_attention_for_f32():
    cache, k, v, gen = filled("f32", "f32", n_tokens=50)
    cache.append(0, k, v)
    q = torch.randn(50, 4, 128, generator=gen)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(attend(cache, 0, q), exact, atol=1e-5, rtol=1e-4)


def test_compressed_attention_is_close_to_exact():
    """A sanity bound on quality: q8_0 is near exact and turbo4 further off, both bounded."""
    outs = {}
    for t in ("f32", "q8_0", "turbo4"):
        cache, k, v, gen = filled(t, t, n_tokens=200, seed=3)
        cache.append(0, k, v)
        outs[t] = attend(cache, 0, torch.randn(1, 4, 128, generator=gen))
    rel = lambda t: ((outs[t] - outs["f32"]).norm() / outs["f32"].norm()).item()  # noqa: E731
    assert rel("q8_0") < 0.03 and rel("q8_0") < rel("turbo4") < 0.3


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0", "iq4_nl", "turbo2", "turbo3", "turbo4", "turbo4p"])
def test_nbytes_are_exact_at_a_page_boundary(name):
    # 8,192 tokens (32 pages): the accounting is per page, so more tokens only cost encoding
    # time; iq4_nl's exact-order scale search is slow to encode, so its rows are narrower.
    n_tokens, n_kv, head_dim, page = 8192, 2, (64 if name == "iq4_nl" else 128), 256
    cache = KVCache(KVLayerSpec(n_kv, head_dim, name, name), ctx=n_tokens, page_size=page)
    row = formats.get(name).row_bytes(head_dim)
    for _ in range(n_tokens // 4096):
        block = torch.randn(4096, n_kv, head_dim)
        cache.append(0, block, block)
    assert cache.offset(0) == n_tokens
    assert cache.nbytes == 2 * row * n_tokens * n_kv                 # K and V, no slack at a page boundary
    cache.trim(0, n_tokens - 100)
    slack = cache.nbytes - 2 * row * (n_tokens - 100) * n_kv
    assert 0 < slack < 2 * row * page * n_kv                          # under one page


def test_trim_then_append_matches_a_fresh_cache():
    cache, k, v, gen = filled("q4_0", "turbo3", page_size=16)
    cache.append(0, k[:120], v[:120])
    cache.trim(0, 70)
    assert cache.offset(0) == 70
    cache.append(0, k[70:90], v[70:90])
    fresh, *_ = filled("q4_0", "turbo3", page_size=16)
    fresh.append(0, k[:90], v[:90])
    q = torch.randn(5, 4, 128, generator=gen)
    assert torch.equal(attend(cache, 0, q), attend(fresh, 0, q))
    with pytest.raises(ValueError, match="cannot trim to 91 tokens, it holds 90"):
        cache.trim(0, 91)


def test_writing_slot_1_never_changes_slot_0():
    cache, k, v, gen = filled("turbo4", "q8_0")
    cache.append(0, k[:60], v[:60])
    q = torch.randn(1, 4, 128, generator=gen)
    before = attend(cache, 0, q)
    cache.append(1, k[60:150] * 3, v[60:150])
    cache.trim(1, 10)
    cache.append(1, k[:50], v[:50])
    assert torch.equal(attend(cache, 0, q), before)
    assert cache.offset(0) == 60 and cache.offset(1) == 60


@pytest.mark.parametrize("window", [8, 40])
def test_f16_window_packs_each_token_once(window):
    cache, k, v, gen = filled("turbo3", "q4_0", window=window, page_size=16)
    for start in range(0, 100, 7):                                   # uneven appends
        cache.append(0, k[start:min(start + 7, 100)], v[start:min(start + 7, 100)])
    n_packed = cache.n_packed(0)
    assert n_packed == 100 - window and cache.offset(0) == 100
    # The packed rows are exactly the encoding of the original tokens (packed once, from f16).
    _, kb, vb = next(cache.packed_chunks(0, 4096))
    expect = formats.get("turbo3").encode(k[:n_packed].half().float())
    assert torch.equal(kb, expect)
    q = torch.randn(3, 4, 128, generator=gen)
    torch.testing.assert_close(attend(cache, 0, q), attend_reference(cache, 0, q), atol=2e-5, rtol=1e-4)
    cache.trim(0, 95)                                                 # inside the window
    cache.trim(0, 30)                                                 # inside the pages
    assert cache.offset(0) == 30 and cache.n_packed(0) == 30


def test_save_restore_round_trip(tmp_path):
    spec = StateLayerSpec(conv_dim=64, conv_kernel=4, n_v_heads=4, k_head_dim=16, v_head_dim=16)
    kv, k, v, gen = filled("q8_0", "turbo3", window=5)
    rec = RecurrentStateCache(spec, n_slots=2)
    kv.append(0, k[:77], v[:77]); kv.append(1, k[:13], v[:13])
    rec.recurrent.normal_(generator=gen); rec.conv.normal_(generator=gen)
    rec.advance(0, 77); rec.advance(1, 13)
    layers = [kv, rec]
    save_cache(tmp_path / "c.safetensors", layers)
    kv2 = KVCache(KVLayerSpec(2, 128, "q8_0", "turbo3"), ctx=512, page_size=32, f16_window=5, n_slots=2)
    rec2 = RecurrentStateCache(spec, n_slots=2)
    load_cache(tmp_path / "c.safetensors", [kv2, rec2])
    q = torch.randn(1, 4, 128, generator=gen)
    for s in (0, 1):
        assert torch.equal(attend(kv, s, q), attend(kv2, s, q))
        assert kv2.offset(s) == kv.offset(s) and rec2.offset(s) == rec.offset(s)
    assert torch.equal(rec.recurrent, rec2.recurrent) and torch.equal(rec.conv, rec2.conv)
    # One slot into another id.
    kv3 = KVCache(KVLayerSpec(2, 128, "q8_0", "turbo3"), ctx=512, page_size=32, f16_window=5, n_slots=2)
    load_cache(tmp_path / "c.safetensors", [kv3, RecurrentStateCache(spec, n_slots=2)], slots=[0], into=[1])
    assert kv3.offset(1) == 77 and kv3.offset(0) == 0


def test_restore_refuses_other_formats_and_shapes(tmp_path):
    kv, k, v, _ = filled("q8_0", "turbo3")
    kv.append(0, k[:10], v[:10])
    save_cache(tmp_path / "c.safetensors", [kv])
    other = KVCache(KVLayerSpec(2, 128, "turbo4", "turbo3"), ctx=512, page_size=32, n_slots=2)
    with pytest.raises(ValueError, match="type_k is 'q8_0' in the file, 'turbo4' in this cache"):
        load_cache(tmp_path / "c.safetensors", [other])
    with pytest.raises(ValueError, match="the file has 1 layers, this model has 2"):
        load_cache(tmp_path / "c.safetensors", [kv, kv])
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00not really")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_cache(tmp_path / "bad.safetensors", [kv])
    with pytest.raises(ValueError, match="does not exist"):
        load_cache(tmp_path / "missing.safetensors", [kv])


def test_bad_calls_are_refused_clearly():
    cache, k, v, _ = filled("f16", "q4_0", ctx=100)
    with pytest.raises(ValueError, match="would exceed the context size 100"):
        cache.append(0, k[:101], v[:101])
    cache.append(0, k[:60], v[:60])
    with pytest.raises(ValueError, match="60 cached would exceed the context size 100"):
        cache.append(0, k[:41], v[:41])
    assert cache.offset(0) == 60                                       # nothing written
    with pytest.raises(ValueError, match="slot 2 does not exist"):
        cache.append(2, k[:1], v[:1])
    with pytest.raises(ValueError, match="head_dim=128"):
        cache.append(0, torch.randn(1, 2, 64), torch.randn(1, 2, 64))
    with pytest.raises(ValueError, match="multiple of n_kv_heads=2"):
        attend(cache, 0, torch.randn(1, 3, 128))
    with pytest.raises(ValueError, match="NaN"):
        cache.append(0, torch.full((1, 2, 128), float("nan")), v[:1])
    assert cache.offset(0) == 60
    with pytest.raises(ValueError, match="valid types"):
        KVLayerSpec(2, 128, "q4_k", "f16")


def test_recurrent_state_is_fixed_size_and_not_rewindable():
    spec = StateLayerSpec(conv_dim=8192, conv_kernel=4, n_v_heads=32, k_head_dim=128, v_head_dim=128)
    rec = RecurrentStateCache(spec, n_slots=4)
    assert rec.nbytes == 4 * spec.bytes_per_slot
    rec.advance(0, 1000)
    assert rec.nbytes == 4 * spec.bytes_per_slot
    with pytest.raises(ValueError, match="cannot be rewound"):
        rec.trim(0, 500)
    rec.trim(0, 0)
    assert rec.offset(0) == 0
    assert isinstance(rec, LayerCache) and isinstance(KVCache(KVLayerSpec(1, 32), ctx=8), LayerCache)


def test_specs_reproduce_published_sizes():
    """Qwen3.6-35B-A3B: 10 attention layers, 2 KV heads x 256; 30 DeltaNet layers."""
    kv = KVLayerSpec(2, 256, "f16", "f16")
    assert 10 * kv.bytes_per_token == 20480
    assert 10 * kv.bytes_for(32768) == 671_088_640 and 10 * kv.bytes_for(4096) == 80 * 2**20
    state = StateLayerSpec(conv_dim=2 * 16 * 128 + 32 * 128, conv_kernel=4, n_v_heads=32, k_head_dim=128,
                           v_head_dim=128)
    assert 30 * state.bytes_per_slot * 4 / 2**20 == pytest.approx(251.25)


@pytest.mark.parametrize("type_k,type_v", [("iq4_nl", "q8_0"), ("q4_0", "f16"), ("turbo4", "iq4_nl-norot")])
def test_cpu_prompt_encoders_store_the_torch_encoders_bytes(type_k, type_v):
    """On the CPU a prompt chunk's rows go through kv_encode.c where its bytes are the torch
    encoders' (PROMPT_KINDS); a pair with one format outside them keeps torch for both. Pools,
    and the overflow flag of a chunk with a NaN, equal a cache on the torch encoders."""
    from kvslim.native import build, kv_encode
    if not build.compiler():
        pytest.skip("no C compiler: the torch encoders serve")
    spec = KVLayerSpec(2, 128, type_k, type_v)
    fast, ref = KVCache(spec, ctx=96, n_slots=1, page_size=16), KVCache(spec, ctx=96, n_slots=1, page_size=16)
    ref.cpu_encoders = None
    kinds = [formats.get(t).kernel_encoder(128) for t in (type_k, type_v)]
    assert (fast.cpu_encoders is not None) == all(k is not None and k.kind in kv_encode.PROMPT_KINDS for k in kinds)
    gen = torch.Generator().manual_seed(3)
    for n in (40, 1, 30):
        k, v = (torch.randn(n, 2, 128, generator=gen) * torch.logspace(-2, 2, 128) for _ in "kv")
        fast.store(0, k, v), ref.store(0, k, v)
    (fk, fv), (rk, rv) = fast.rows(0), ref.rows(0)
    assert fk.shape[0] == 71 and torch.equal(fk, rk) and torch.equal(fv, rv)
    bad = torch.randn(3, 2, 128)
    bad[1, 0, 5] = float("nan")
    fast.store(0, bad, bad), ref.store(0, bad, bad)
    assert torch.equal(fast.overflow, ref.overflow) and fast.overflow[0]
