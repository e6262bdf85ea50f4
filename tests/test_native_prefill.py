"""The bf16 prefill-attention kernel against its reference (the same arithmetic in torch) and
against the float32 block loop it speeds up, through the cache's attention and the engine.

Pools hold rows encoded by each format's own encoder, in shuffled pages; query rows sit at
their own positions (a causal chunk at the end of a history), so tiles are partly visible.
"""
from __future__ import annotations

import pytest
import torch

import kvslim
from kvslim import formats
from kvslim.cache import attention, backends
from kvslim.native import build
from kvslim.native import prefill_attention as prefill

from .test_native_attention import kv_formats, pool

PAIRS = [("f16", "f16"), ("q8_0", "turbo4"), ("iq4_nl", "q8_0"), ("nl4s", "nl3s"), ("bf16", "f32"), ("q8_0", "klt3")]


def _need_kernel():
    if not build.compiler():
        pytest.skip("no C compiler: prefill keeps the torch path")
    assert build.library(prefill.SOURCE) is not None                  # CI has one: the file must build
    if not prefill.available():
        pytest.skip("this CPU has no AVX512_BF16: prefill keeps the float32 torch path")


def _case(name_k, name_v, dim, length, n_rows, page_size, seed=0):
    """Pools of one sequence with ``length`` keys, and n_rows query rows of two GQA heads at the
    last n_rows // 2 positions (row g * T + t is at position length - T + t)."""
    gen = torch.Generator().manual_seed(seed)
    n_kv, per_seq = 2, -(-length // page_size)
    fmt_k, fmt_v = kv_formats(name_k, name_v, n_kv, dim)
    k_pool = pool(fmt_k, torch.randn(n_kv, per_seq + 1, page_size, dim, generator=gen))
    v_pool = pool(fmt_v, torch.randn(n_kv, per_seq + 1, page_size, dim, generator=gen))
    table = (torch.randperm(per_seq, generator=gen) + 1)[None].int()
    q = fmt_k.to_code_domain(torch.randn(n_kv, 1, n_rows, dim, generator=gen) * 2 * dim ** -0.5)
    t = n_rows // 2
    q_pos = (torch.arange(n_rows) % t + length - t)[None]
    return fmt_k, fmt_v, q, k_pool, v_pool, table, q_pos


def _state(q):
    return attention._OnlineSoftmax(*q.shape[:3], q.shape[-1], q.device)


def _decoded(fmt_k, fmt_v, k_pool, v_pool, table, dim):
    """All keys and values of the sequence, decoded by torch and scaled by their row scales."""
    (k, ks), (v, vs) = attention._decode_pages(fmt_k, fmt_v, k_pool, v_pool, table, dim)
    return (k if ks is None else k * ks[..., None]), (v if vs is None else v * vs[..., None])


CASES = [(k, v, dim, page) for k, v in PAIRS for dim, page in ((64, 16), (128, 256), (256, 16))
         if not (dim == 64 and k == "nl4s")]                              # nl4s rows are blocks of 128


@pytest.mark.parametrize("name_k,name_v,dim,page_size", CASES)
def test_pages_kernel_matches_its_reference(name_k, name_v, dim, page_size):
    _need_kernel()
    length = 700
    fmt_k, fmt_v, q, k_pool, v_pool, table, q_pos = _case(name_k, name_v, dim, length, 2 * 150, page_size)
    assert prefill.reads_pages(fmt_k, fmt_v, dim)
    got, want = _state(q), _state(q)
    prefill.fold_pages(got.m, got.l, got.acc, q, fmt_k, fmt_v, k_pool, v_pool, table, length, q_pos)
    k, v = _decoded(fmt_k, fmt_v, k_pool, v_pool, table, dim)
    prefill.reference_fold(want.m, want.l, want.acc, q, k[:, :, :length], v[:, :, :length], q_pos, 0, length)
    assert torch.allclose(got.m, want.m, atol=1e-4)
    err = (got.result() - want.result()).abs()      # a probability near a bf16 rounding edge may round the
    assert err.mean() < 3e-6 and err.max() < 2e-3   # other way (exp and sums differ by an ulp): rare, small


def test_each_row_sees_exactly_the_keys_up_to_its_position():
    """With q = 0 every visible key weighs exactly 1, and values that are small integers (exact in
    bf16) make the output the exact mean of the visible values: any key let in or left out by the
    mask, a tile edge (64) or a block edge (4096) shows."""
    _need_kernel()
    length, dim = 4500, 64
    fmt_k, fmt_v = formats.get("f16", role="k"), formats.get("f32", role="v")
    pos = torch.arange(length).float()
    values = torch.stack([pos % 251, torch.floor(pos / 251)] + [torch.ones(length)] * (dim - 2), -1)
    rows = torch.tensor([0, 1, 62, 63, 64, 65, 127, 4094, 4095, 4096, 4097, 4200, length - 1, length + 30])
    per_seq = -(-length // 16)
    k_pool = pool(fmt_k, torch.randn(2, per_seq, 16, dim))
    v_pool = pool(fmt_v, torch.nn.functional.pad(values, (0, 0, 0, per_seq * 16 - length)).reshape(1, per_seq, 16, dim)
                   .expand(2, -1, -1, -1).contiguous())
    table = torch.arange(per_seq)[None].int()
    q = torch.zeros(2, 1, len(rows), dim)
    got = _state(q)
    prefill.fold_pages(got.m, got.l, got.acc, q, fmt_k, fmt_v, k_pool, v_pool, table, length, rows[None])
    seen = (rows.clamp(max=length - 1) + 1).double()
    assert torch.equal(got.l[0, 0, :, 0].double(), seen)
    want = torch.stack([values[:int(n)].double().mean(0) for n in seen])
    assert torch.allclose(got.result()[0, 0].double(), want, rtol=1e-6)


@pytest.mark.parametrize("name_k,name_v", [("f16", "f16"), ("q8_0", "turbo4")])
def test_bf16_rounding_stays_small_against_float32(name_k, name_v):
    """The float32 block loop is the exact answer: bf16 operands (8 significant bits) move an
    output by ~0.5% of its size on random rows, whose outputs are small averages (on the bundled
    model, KLD 1.3e-6 against float32 attention); a wrong tile or mask moves it by tens of %."""
    _need_kernel()
    length, dim = 900, 128
    fmt_k, fmt_v, q, k_pool, v_pool, table, q_pos = _case(name_k, name_v, dim, length, 2 * 200, 256, seed=1)
    got, exact = _state(q), _state(q)
    prefill.fold_pages(got.m, got.l, got.acc, q, fmt_k, fmt_v, k_pool, v_pool, table, length, q_pos)
    attention._scan_pages(fmt_k, fmt_v, k_pool, v_pool, table, q, q_pos, torch.tensor([length]), exact, 2, dim)
    err = (got.result() - exact.result()).norm(dim=-1) / exact.result().norm(dim=-1)
    assert err.max() < 0.03 and err.mean() < 0.01


def test_torch_decoded_rows_fold_as_the_pages_do():
    """``fold`` (rows torch decoded, for formats without a codec) and ``fold_pages`` agree, whether
    the keys come in one block or in blocks cut on key tiles."""
    _need_kernel()
    length, dim = 650, 128
    fmt_k, fmt_v, q, k_pool, v_pool, table, q_pos = _case("q8_0", "turbo4", dim, length, 2 * 90, 16)
    pages, rows = _state(q), _state(q)
    prefill.fold_pages(pages.m, pages.l, pages.acc, q, fmt_k, fmt_v, k_pool, v_pool, table, length, q_pos)
    k, v = _decoded(fmt_k, fmt_v, k_pool, v_pool, table, dim)
    for start, end in ((0, 192), (192, length)):
        prefill.fold(rows.m, rows.l, rows.acc, q, k[:, :, start:end], None, v[:, :, start:end], None, q_pos,
                     start, length)
    assert torch.equal(pages.m, rows.m)
    assert torch.allclose(pages.result(), rows.result(), atol=1e-6, rtol=1e-5)


def test_a_row_gets_the_same_bits_whatever_rows_and_threads_come_with_it():
    """Rows are tiled independently and keys walked in one order: a prompt cut into other chunks
    (prefix reuse) gives each row the same result."""
    _need_kernel()
    length, dim = 1000, 128
    fmt_k, fmt_v, q, k_pool, v_pool, table, q_pos = _case("q8_0", "turbo4", dim, length, 2 * 300, 256)
    threads = torch.get_num_threads()
    try:
        full = _state(q)
        prefill.fold_pages(full.m, full.l, full.acc, q, fmt_k, fmt_v, k_pool, v_pool, table, length, q_pos)
        torch.set_num_threads(1)
        rows = torch.tensor([5, 77, 299, 300, 451])
        part = _state(q[:, :, rows])
        prefill.fold_pages(part.m, part.l, part.acc, q[:, :, rows].contiguous(), fmt_k, fmt_v, k_pool, v_pool,
                           table, length, q_pos[:, rows])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(part.acc, full.acc[:, :, rows]) and torch.equal(part.l, full.l[:, :, rows])


def test_the_bf16_backend_prefills_the_bundled_model_close_to_float32():
    _need_kernel()
    llm = kvslim.load(ctx=1024, cache_type_k="q8_0", cache_type_v="turbo4", dtype=torch.float32)
    ids = llm.tokenize(" ".join(["The pool keeps pages of packed rows."] * 80))[:700]
    exact = llm.logits(ids).double().log_softmax(-1)
    fast = kvslim.load(ctx=1024, cache_type_k="q8_0", cache_type_v="turbo4", dtype=torch.float32, n_ubatch=256,
                       backend="bf16").logits(ids).double().log_softmax(-1)
    kld = (exact.exp() * (exact - fast)).sum(-1)
    assert 0 < kld.mean() < 2e-5                                        # it ran the kernel, and it is close
    assert (exact.argmax(-1) == fast.argmax(-1)).double().mean() > 0.98


def test_without_the_kernel_the_bf16_backend_is_the_torch_backend(monkeypatch):
    monkeypatch.setattr(prefill, "available", lambda variant=None: False)
    assert "bf16" in backends.backend_names()
    llm = kvslim.load(ctx=512, cache_type_k="q8_0", cache_type_v="q4_0", dtype=torch.float32)
    ids = llm.tokenize("A short prompt that is read in one chunk of tokens.")
    fast = kvslim.load(ctx=512, cache_type_k="q8_0", cache_type_v="q4_0", dtype=torch.float32, backend="bf16")
    assert torch.equal(llm.logits(ids), fast.logits(ids))


@pytest.mark.parametrize("type_k,type_v,window", [("q8_0", "turbo4", 0), ("q4_1", "q5_0", 0), ("f16", "nl4", 16)])
def test_a_prompt_chunk_through_the_cache_with_bf16_dots(type_k, type_v, window):
    """Through the cache: packed pages the kernel decodes (q8_0/turbo4), blocks torch decodes (q4_1,
    q5_0 have no codec), an f16 window after them. Close to the float32 reference, and the same
    bits whatever block size the torch-decoded path cuts the pages into."""
    _need_kernel()
    from kvslim.cache import KVCache, KVLayerSpec
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(KVLayerSpec(2, 128, type_k, type_v), ctx=1024, page_size=16, f16_window=window)
    cache.append(0, torch.randn(600, 2, 128, generator=gen) * 2, torch.randn(600, 2, 128, generator=gen))
    q = torch.randn(200, 4, 128, generator=gen)
    first = 400
    got = attention._attend_segment(cache, 0, q, first, None, dot="bf16")
    exact = attention.attend_reference(cache, 0, q)
    err = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert err.max() < 0.03 and err.mean() < 0.01
    assert not torch.equal(got, attention._attend_segment(cache, 0, q, first, None))   # the kernel ran
    assert torch.equal(got, attention._attend_segment(cache, 0, q, first, None, chunk_tokens=32, dot="bf16"))
