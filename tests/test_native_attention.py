"""The C decode-attention kernel against the torch block loop it replaces (its reference).

Pools hold rows encoded by each format's own encoder, pages are handed out in a shuffled
order, sequences have different lengths (a partial last page, one empty), and spans split
long sequences across threads: the kernel's softmax state must match the torch path's.
"""
from __future__ import annotations

import pytest
import torch

from kvslim import formats
from kvslim.cache import attention
from kvslim.formats.klt import random_calibration
from kvslim.native import build
from kvslim.native import paged_attention as native

PAIRS = [("f16", "f16"), ("bf16", "f32"), ("q8_0", "q4_0"), ("iq4_nl", "q8_0"), ("turbo4", "turbo3"),
         ("turbo2", "f16"), ("nl4", "nl3"), ("nl4s", "nl3s"), ("q4_1", "q5_0"), ("q5_1", "q4_1-norot"),
         ("nl4s", "klt3")]
WHOLE_BLOCKS = {"nl4s": 128, "nl3s": 128}          # formats whose rows are blocks of 128


def pool(fmt, rows: torch.Tensor) -> torch.Tensor:
    """rows (Hkv, pages, page_size, D) float -> the packed pool, as the cache stores it (encoded as
    the cache encodes them, tokens of (Hkv, D): klt3 codes each head in its own basis)."""
    n_kv, pages, size, dim = rows.shape
    tokens = rows.permute(1, 2, 0, 3).reshape(-1, n_kv, dim)
    return fmt.encode(tokens).reshape(pages, size, n_kv, -1).permute(2, 0, 1, 3).contiguous()


def kv_formats(name_k: str, name_v: str, n_kv: int, dim: int):
    """The K and V formats, a calibrated V format (klt3) bound to a calibration on random rows."""
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    return fmt_k, fmt_v.bind(random_calibration(name_v, n_kv, dim)) if fmt_v.calibrated else fmt_v


def _case(name_k, name_v, dim, group, lengths, page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_kv, n_seq = 2, len(lengths)
    fmt_k, fmt_v = kv_formats(name_k, name_v, n_kv, dim)
    per_seq = max(1, -(-max(lengths) // page_size))
    pages = n_seq * per_seq + 1
    k_pool = pool(fmt_k, torch.randn(n_kv, pages, page_size, dim, generator=gen))
    v_pool = pool(fmt_v, torch.randn(n_kv, pages, page_size, dim, generator=gen))
    table = (torch.randperm(pages - 1, generator=gen)[:n_seq * per_seq] + 1).reshape(n_seq, per_seq).int()
    q = fmt_k.to_code_domain(torch.randn(n_kv, n_seq, group, dim, generator=gen) * dim ** -0.5)
    return fmt_k, fmt_v, q, k_pool, v_pool, table, torch.tensor(lengths)


def _torch_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys):
    acc = attention._OnlineSoftmax(*q.shape, q.device)
    q_pos = (n_keys - 1)[:, None].expand(n_keys.shape[0], q.shape[2])
    attention._scan_pages(fmt_k, fmt_v, k_pool, v_pool, table, q, q_pos, n_keys, acc, 3, q.shape[-1])
    return acc


def _need_kernel():
    if build.compiler():                                              # CI has one: the kernel must build
        assert build.library(native.SOURCE) is not None
    else:
        pytest.skip("no C compiler: attention keeps the torch path")


CASES = [(k, v, dim, group) for k, v in PAIRS for dim, group in ((64, 1), (128, 4), (256, 2))
         if dim % max(WHOLE_BLOCKS.get(k, 1), WHOLE_BLOCKS.get(v, 1)) == 0]


@pytest.mark.parametrize("name_k,name_v,dim,group", CASES)
def test_kernel_state_matches_torch_block_loop(name_k, name_v, dim, group):
    _need_kernel()
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case(name_k, name_v, dim, group, [37, 300, 16, 0])
    assert native.supports(fmt_k, fmt_v, q)
    want = _torch_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys)
    for threads, variant in ((1, "native"), (2, "native"), (2, "avx2"), (2, "portable")):   # every path of the C
        torch.set_num_threads(threads)
        m, l, acc = native.decode_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys, variant)
        live = n_keys > 0
        assert torch.allclose(m[:, live], want.m[:, live], atol=1e-5)
        assert torch.allclose(acc[:, live] / l[:, live], want.result()[:, live], atol=2e-5, rtol=1e-4)
        assert (l[:, ~live] == 0).all() and torch.isinf(m[:, ~live]).all() and (acc[:, ~live] == 0).all()


@pytest.mark.parametrize("name_k,name_v", [("turbo4", "nl4"), ("q8_0", "turbo2"), ("f16", "iq4_nl")])
@pytest.mark.parametrize("group", [3, 5, 8])
def test_query_rows_in_groups_of_four_two_and_one(name_k, name_v, group):
    """The AVX-512 loops take a head's query rows 4, 2 or 1 at a time (a group of 5 is 4 + 1)
    and keys 8 or 4 at a time (a short last group re-reads a key and drops its sums)."""
    _need_kernel()
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case(name_k, name_v, 128, group, [45, 7, 300])
    want = _torch_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys)
    for variant in ("native", "avx2"):
        m, l, acc = native.decode_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys, variant)
        assert torch.allclose(m, want.m, atol=1e-5)
        assert torch.allclose(acc / l, want.result(), atol=2e-5, rtol=1e-4)


def test_spans_split_one_long_sequence_exactly():
    """A sequence far longer than a span is cut into several work items whose states merge."""
    _need_kernel()
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case("q8_0", "turbo4", 128, 2, [3000], page_size=32)
    assert 3000 > 2 * native.SPAN                                       # several spans per (head, sequence)
    want = _torch_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys).result()
    torch.set_num_threads(2)
    m, l, acc = native.decode_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys)
    assert torch.allclose(acc / l, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name_k,name_v", [("f16", "f16"), ("q8_0", "turbo4"), ("nl4s", "nl3s")])
def test_a_sequence_gets_the_same_bits_whatever_its_batch_and_threads(name_k, name_v):
    """Spans are cut at fixed key counts, so one sequence's state does not depend on the other
    sequences decoded with it or on the thread count: a server's greedy replies do not change
    with what else is running."""
    _need_kernel()
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case(name_k, name_v, 128, 2, [1500, 37, 700, 5])
    torch.set_num_threads(1)
    alone = native.decode_state(fmt_k, fmt_v, q[:, :1].contiguous(), k_pool, v_pool, table[:1], n_keys[:1])
    torch.set_num_threads(2)
    together = native.decode_state(fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys)
    for a, b in zip(alone, together):
        assert torch.equal(a[:, 0], b[:, 0])


def formats_fitting(head_dim: int):
    """Every format, as K and as V, that can store rows of ``head_dim``."""
    for name in formats.names():
        for role in ("k", "v"):
            fmt = formats.get(name, role=role)
            try:
                fmt.check_head_dim(head_dim)
            except ValueError:
                continue
            yield fmt


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_each_format_declares_the_row_the_kernels_read(head_dim):
    """The kernels read a format's ``kernel_row``, not its class: a declared row must give the
    format's own row size (the parity tests above check that its table decodes as the format)."""
    declared = []
    for fmt in formats_fitting(head_dim):
        row = fmt.kernel_row(head_dim)
        if row is None:
            continue
        declared.append(fmt.name)
        assert head_dim // row.block_values * row.block_bytes == fmt.row_bytes(head_dim)
        assert native.codec_fields(fmt, head_dim) is not None
    assert {"f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "turbo4", "turbo3", "turbo2", "nl4",
            "nl3"} <= set(declared)
    assert not {"turbo4p", "turbo3p"} & set(declared)                       # QJL sketches


def test_the_build_variant_can_be_chosen_for_the_whole_process(monkeypatch):
    """KVSLIM_NATIVE_BUILD times the AVX2 or plain loops on a machine with AVX-512 (as a user
    without it runs them); a name that is not a build is refused with the choices."""
    _need_kernel()
    monkeypatch.setenv("KVSLIM_NATIVE_BUILD", "avx2")
    build.clear()
    try:
        chosen = build.library(native.SOURCE)._name
        assert chosen == build.library(native.SOURCE, "avx2")._name != build.library(native.SOURCE, "native")._name
        monkeypatch.setenv("KVSLIM_NATIVE_BUILD", "avx3")
        build.clear()
        with pytest.raises(ValueError, match="avx3.*native, avx2, portable"):
            build.library(native.SOURCE)
    finally:
        monkeypatch.delenv("KVSLIM_NATIVE_BUILD")
        build.clear()


def test_formats_without_a_codec_keep_the_torch_path(monkeypatch):
    q = torch.zeros(2, 1, 2, 128)
    assert not native.supports(formats.get("turbo4p"), formats.get("f16"), q)    # QJL residual sketch
    assert native.supports(formats.get("q4_1"), formats.get("q5_1"), q)          # ggml's offset and 5th bit
    monkeypatch.setenv("KVSLIM_NATIVE", "0")
    build.clear()
    try:
        assert not native.supports(formats.get("f16"), formats.get("f16"), q)    # the switch turns it off
    finally:
        build.clear()


def test_scan_decode_falls_back_to_the_block_loop_with_the_same_result(monkeypatch):
    """Where the kernel cannot serve (no compiler, a format without a codec) attention's decode
    scan runs the torch block loop; both give the same softmax state."""
    _need_kernel()
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case("turbo4", "q8_0", 128, 2, [300, 37])
    kernel = attention._scan_decode(fmt_k, fmt_v, k_pool, v_pool, table, q, n_keys)
    monkeypatch.setattr(attention.native, "supports", lambda *args: False)
    loop = attention._scan_decode(fmt_k, fmt_v, k_pool, v_pool, table, q, n_keys, block_tokens=48)
    assert torch.allclose(kernel.result(), loop.result(), atol=2e-5, rtol=1e-4)
    assert torch.allclose(kernel.m, loop.m, atol=1e-5)
