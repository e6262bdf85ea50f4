"""The paged KV pool under the model's access pattern: flat batches that mix prefill
chunks and decode tokens of several sequences, trims, slot reuse and save/restore,
for every K/V pair, head size and GQA group, against ``attend_reference``."""
import itertools

import pytest
import torch

from kvslim.cache import KVCache, KVLayerSpec, attend_reference, get_backend
from kvslim.cache.attention import attend_batch
from kvslim.models import Batch

TYPES = ["f16", "q8_0", "q4_0", "iq4_nl", "turbo2", "turbo3", "turbo4"]
N_KV = 2


def step(cache, parts, gen, group):
    """One flat batch: store K/V of every row, attend, compare each segment with the reference."""
    batch = Batch.build([(slot, [0] * n, cache.offset(slot)) for slot, n in parts])
    n, dim = batch.tokens.shape[0], cache.head_dim
    k, v = (torch.randn(n, N_KV, dim, generator=gen) for _ in range(2))
    q = torch.randn(n, N_KV * group, dim, generator=gen)
    out = cache.forward(batch, q, k, v)
    for seg in batch.segments:
        want = attend_reference(cache, seg.slot, q[seg.begin:seg.end])
        torch.testing.assert_close(out[seg.begin:seg.end], want, atol=3e-5, rtol=1e-4)
    return out


@pytest.mark.parametrize("type_k,type_v", list(itertools.product(TYPES, TYPES)))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batches_match_the_reference(type_k, type_v, head_dim, group):
    gen = torch.Generator().manual_seed(hash((type_k, type_v, head_dim, group)) % 2**31)
    cache = KVCache(KVLayerSpec(N_KV, head_dim, type_k, type_v), ctx=80, n_slots=3, page_size=16)
    step(cache, [(0, 20), (1, 33)], gen, group)                        # two prefill chunks
    step(cache, [(0, 1), (1, 7), (2, 5)], gen, group)                  # decode + prefill mixed
    step(cache, [(0, 1), (1, 1), (2, 1)], gen, group)                  # one decode step for all
    cache.trim(1, 10)                                                  # rewind into a page
    cache.clear(2)                                                     # the slot is reused
    step(cache, [(2, 18), (1, 1), (0, 1)], gen, group)
    saved = cache.state(1)
    fresh = KVCache(KVLayerSpec(N_KV, head_dim, type_k, type_v), ctx=80, n_slots=3, page_size=16)
    fresh.load_state(0, saved, cache.offset(1))
    q = torch.randn(1, N_KV * group, head_dim, generator=gen)
    torch.testing.assert_close(attend_reference(fresh, 0, q), attend_reference(cache, 1, q), atol=0, rtol=0)


@pytest.mark.parametrize("window", [0, 6])
def test_torch_backend_equals_reference_backend_through_a_run(window):
    """Two caches fed the same batches, one per backend: same outputs, same bytes."""
    gen = torch.Generator().manual_seed(1)
    spec = KVLayerSpec(N_KV, 128, "q8_0", "turbo3")
    fast = KVCache(spec, ctx=100, n_slots=2, page_size=8, f16_window=window)
    ref = KVCache(spec, ctx=100, n_slots=2, page_size=8, f16_window=window, backend="reference")
    for parts in ([(0, 30), (1, 3)], [(0, 1), (1, 12)], [(1, 1), (0, 1)], [(0, 1), (1, 1)]):
        batch = Batch.build([(slot, [0] * n, fast.offset(slot)) for slot, n in parts])
        n = batch.tokens.shape[0]
        k, v = (torch.randn(n, N_KV, 128, generator=gen) for _ in range(2))
        q = torch.randn(n, N_KV * 4, 128, generator=gen)
        torch.testing.assert_close(fast.forward(batch, q, k, v), ref.forward(batch, q, k, v), atol=3e-5, rtol=1e-4)
    for slot in (0, 1):
        assert torch.equal(fast.state(slot)["k"], ref.state(slot)["k"])
    assert fast.nbytes == ref.nbytes


def test_pages_come_back_to_the_pool_and_the_table_points_at_the_null_page():
    cache = KVCache(KVLayerSpec(N_KV, 64, "q4_0", "q4_0"), ctx=64, n_slots=2, page_size=16)
    assert cache.nbytes == 0 and cache.reserved_bytes == (2 * 4 + 1) * cache.page_bytes
    cache.append(0, torch.randn(40, N_KV, 64), torch.randn(40, N_KV, 64))
    assert cache.nbytes == 3 * cache.page_bytes
    assert cache.block_table[0, :3].tolist() == [0, 1, 2] and cache.block_table[0, 3] == cache.null_page
    cache.trim(0, 16)
    assert cache.nbytes == cache.page_bytes and cache.block_table[0, 1] == cache.null_page
    cache.append(1, torch.randn(64, N_KV, 64), torch.randn(64, N_KV, 64))   # reuses the released pages
    assert sorted(cache.block_table[1].tolist()) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="would exceed the context size 64"):
        cache.append(1, torch.randn(1, N_KV, 64), torch.randn(1, N_KV, 64))
    assert not cache.k_pool[:, cache.null_page].any()


def test_bad_values_on_the_hot_path_flag_their_slot_only():
    """forward() never checks on the host; the flag names the slot whose K/V were bad."""
    cache = KVCache(KVLayerSpec(N_KV, 128, "q8_0", "f16"), ctx=32, n_slots=3, page_size=8)
    batch = Batch.build([(0, [0] * 4, 0), (1, [0] * 3, 0), (2, [0] * 2, 0)])
    k, v = torch.randn(9, N_KV, 128), torch.randn(9, N_KV, 128)
    v[5, 1, 7] = 1e6                                                   # row 5 is slot 1's: past f16's range
    k[8, 0, 0] = float("nan")                                          # row 8 is slot 2's
    cache.forward(batch, torch.randn(9, 4, 128), k, v)
    assert cache.take_overflow().tolist() == [0, 1, 1]
    assert cache.take_overflow().tolist() == [0, 0, 0]                 # read once


def test_unknown_backend_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="valid: bf16, reference, torch"):
        get_backend("cuda-magic")


def test_decode_memory_does_not_grow_with_depth():
    """The block-wise read holds one block of decoded K/V whatever the depth: the largest
    float32 tensor a decode step makes is the same at 4K and 16K tokens of history."""
    sizes = {}
    for depth in (4096, 16384):
        cache = KVCache(KVLayerSpec(N_KV, 128, "turbo4", "turbo4"), ctx=depth + 1, page_size=256)
        cache.append(0, torch.randn(depth, N_KV, 128), torch.randn(depth, N_KV, 128))
        batch = Batch.build([(0, [0], depth)])
        largest = []

        def record(t):
            largest.append(t.numel() * t.element_size())

        with _TensorSizes(record):
            cache.forward(batch, torch.randn(1, 4, 128), torch.randn(1, N_KV, 128), torch.randn(1, N_KV, 128))
        sizes[depth] = max(largest)
    assert sizes[4096] == sizes[16384] <= 8 << 20


class _TensorSizes(torch.overrides.TorchFunctionMode):
    """Calls ``record`` with every tensor a torch function returns."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.record(t)
        return out


def test_attend_batch_without_the_cache_method():
    """attend_batch reads what store_batch wrote (the two halves of the torch backend)."""
    cache = KVCache(KVLayerSpec(N_KV, 64, "turbo4", "q4_0"), ctx=40, n_slots=2, page_size=8)
    batch = Batch.build([(0, [0] * 9, 0), (1, [0], 0)])
    k, v, q = torch.randn(10, N_KV, 64), torch.randn(10, N_KV, 64), torch.randn(10, 2, 64)
    cache.store_batch(batch, k, v)
    out = attend_batch(cache, batch, q)
    torch.testing.assert_close(out[:9], attend_reference(cache, 0, q[:9]), atol=3e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="writes position 0 but the cache holds 9"):
        cache.store_batch(batch, k, v)


@pytest.mark.parametrize("type_k,type_v", [("nl4s", "nl4s"), ("nl3s", "q8_0"), ("f16", "nl3s"), ("nl4", "nl3")])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_nl_grids_in_mixed_batches(type_k, type_v, head_dim):
    """The nl rows (block 128 for nls: no head_dim 64) through the same run, GQA group 4."""
    test_mixed_batches_match_the_reference(type_k, type_v, head_dim, 4)
