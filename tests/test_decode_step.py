"""The decode step's two paths: a DecodeBatch (caches prepared on the host, one opaque paged
attention op) against the flattened-Batch reference, eager for every K/V pair, and traced by
torch.compile for greedy tokens (with the aot_eager backend: the traced, functionalised graph
on eager kernels; inductor's C++ build of the same graph takes minutes on two busy cores and
is exercised by ``benchmarks/compile_decode.py``; where a test asks only for no graph break,
dynamo's capture alone, the eager backend)."""
from __future__ import annotations

import os

import pytest
import torch

from kvslim.engine import Engine, EngineConfig, SamplingParams
from kvslim.engine.decode_step import DecodeStep
from kvslim.loading import load_model
from kvslim.models import Batch

PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "iq4_nl"), ("turbo4", "turbo3"), ("q8_0", "turbo4"),
         ("turbo2", "q4_0")]


@pytest.fixture(scope="module")
def hybrid(tiny_folder):
    model, tok, eos = load_model(tiny_folder("qwen3_5")[0], "f32")
    return model, tok, eos


def filled(model, type_k: str, type_v: str, prompts: list[list[int]]):
    """A cache of small pages with each prompt prefilled in its own slot; last logits per slot."""
    cache = model.make_cache(96, len(prompts), type_k, type_v, page_size=8)
    with torch.inference_mode():
        logits = [model(Batch.build([(s, ids, 0)]), cache) for s, ids in enumerate(prompts)]
    return cache, torch.cat(logits)


@pytest.mark.parametrize("type_k,type_v", PAIRS)
def test_decode_batch_matches_the_flat_batch(hybrid, type_k, type_v):
    model, _, _ = hybrid
    prompts = [list(range(5, 22)), list(range(30, 39)), list(range(50, 75))]   # lengths cross page edges
    ref_cache, logits = filled(model, type_k, type_v, prompts)
    new_cache, _ = filled(model, type_k, type_v, prompts)
    reference = DecodeStep(model, ref_cache, compile=False, native=False)
    prepared = DecodeStep(model, new_cache, compile=False, native=False)
    slots, positions = [2, 0, 1], [len(prompts[s]) for s in (2, 0, 1)]          # not in slot order
    tokens = [int(logits[s].argmax()) for s in slots]
    for _ in range(12):
        want = reference(slots, tokens, positions)
        new_cache.prepare_decode(slots, positions)
        with torch.inference_mode():
            got = prepared._forward(*(torch.tensor(x) for x in (tokens, positions, slots)),
                                    new_cache.decode_pages(positions))
        new_cache.commit_decode(slots)
        assert (got - want).abs().max() < 2e-4
        tokens, positions = [int(t) for t in want.argmax(-1)], [p + 1 for p in positions]
    assert [new_cache.offset(s) for s in range(3)] == [ref_cache.offset(s) for s in range(3)]
    assert new_cache.kv_bytes == ref_cache.kv_bytes


def test_prepare_refuses_a_wrong_position_and_changes_nothing(hybrid):
    model, _, _ = hybrid
    cache, _ = filled(model, "q8_0", "turbo4", [list(range(5, 12))])
    with pytest.raises(ValueError, match="writes position 9 but the cache holds 7 tokens"):
        cache.prepare_decode([0], [9])
    assert cache.offset(0) == 7


def test_a_step_may_take_consecutive_rows_of_one_slot(hybrid):
    """A drafted chunk through the C step: rows of one slot at consecutive positions from its
    length; a gap or a repeat is refused; with an f16 window one row per slot."""
    model, _, _ = hybrid
    cache, _ = filled(model, "q8_0", "q8_0", [list(range(5, 12))])
    with pytest.raises(ValueError, match=r"writes position 9 but the cache holds 7 tokens \(and 1 earlier in this step\)"):
        cache.prepare_decode([0, 0], [7, 9])
    cache.prepare_decode([0, 0, 0], [7, 8, 9])
    cache.commit_decode([0, 0, 0])
    assert cache.offset(0) == 10 and all(kv.n_packed(0) == 10 for kv in cache.kv_layers)
    windowed = model.make_cache(64, 1, "q8_0", "q8_0", page_size=8, f16_window=4)
    with pytest.raises(ValueError, match="with an f16 window a decode step takes one token per slot"):
        windowed.prepare_decode([0, 0], [0, 1])


def greedy(model, tok, eos, compile: bool, backend: str = "aot_eager") -> tuple[list[list[int]], Engine, float]:
    """``backend``: aot_eager, the traced and functionalised graph on eager kernels (inductor's
    C++ build takes minutes on 2 busy cores), or eager, dynamo's capture alone (graph breaks
    are dynamo's; a third of aot_eager's time)."""
    engine = Engine(model, tok, EngineConfig.build(256, 2, "q8_0", "turbo4", page_size=16, device="cpu",
                                                   n_ubatch=32, compile=compile, native=False), eos)
    if compile:
        engine.decode_step = DecodeStep(model, engine.cache, compile=True, backend=backend, native=False)
    warm = engine.warm_up()                                          # traces batch 1 and 2 up front
    assert engine.n_free_slots == 2 and engine.cached_tokens() == 0
    seqs = [engine.submit(list(range(3, 3 + n)), 30, SamplingParams(temperature=0)) for n in (20, 45)]
    engine.run(seqs)
    return [s.generated for s in seqs], engine, warm


def test_compiled_greedy_tokens_equal_eager(hybrid):
    model, tok, eos = hybrid
    eager, _, no_warm = greedy(model, tok, eos, compile=False)
    compiled, engine, warm = greedy(model, tok, eos, compile=True)
    assert no_warm == 0.0 and warm > 0 and engine.decode_step.compile_s == warm   # no compiling after warm-up
    assert compiled == eager and all(len(g) > 1 for g in eager)


def test_the_f16_window_keeps_the_eager_path(hybrid):
    model, _, _ = hybrid
    cache = model.make_cache(64, 1, "turbo3", "turbo3", f16_window=8)
    assert not DecodeStep(model, cache, compile=True).compiled


def test_quantized_weights_trace_through_the_native_matmul(tiny_folder):
    """Matrices kept as f16 rows go through the ``kvslim::block_linear`` op: traced without a
    graph break at the ctypes call, with the eager path's greedy tokens."""
    from kvslim.native import block_linear
    if not block_linear.available():
        pytest.skip("no C compiler: quant_linear keeps the torch path")
    model, tok, eos = load_model(tiny_folder("qwen3_5")[0], "f32", weights="f16")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, _, _ = greedy(model, tok, eos, compile=False)
    compiled, _, _ = greedy(model, tok, eos, compile=True, backend="eager")
    assert compiled == eager
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_compiled_code_goes_to_kvslims_cache_unless_the_user_chose(monkeypatch, tmp_path):
    """Importing torch's compiler pieces sets TORCHINDUCTOR_CACHE_DIR to inductor's default:
    that value is replaced by kvslim's folder; a folder the user set is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    from kvslim.engine import decode_step
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_default())
    decode_step.use_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kvslim" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    decode_step.use_cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_klt3_rides_the_decode_batch_and_the_compiled_step():
    """A calibrated V format is bound per layer: the paged_decode op finds each layer's by the name
    registered for it, so the DecodeBatch step (and a traced one) match the flat batch with klt3."""
    model, _, _ = load_model(None, "f32")
    prompts = [list(range(5, 22)), list(range(30, 39))]
    ref_cache, logits = filled(model, "nl4s", "klt3", prompts)
    new_cache, _ = filled(model, "nl4s", "klt3", prompts)
    assert new_cache.static_decode
    reference = DecodeStep(model, ref_cache, compile=False, native=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    traced = DecodeStep(model, new_cache, compile=True, backend="eager", native=False)   # dynamo's capture
    slots, positions = [1, 0], [len(prompts[1]), len(prompts[0])]
    tokens = [int(logits[s].argmax()) for s in slots]
    for _ in range(3):
        want, got = reference(slots, tokens, positions), traced(slots, tokens, positions)
        assert (got - want).abs().max() < 2e-4
        tokens, positions = [int(t) for t in want.argmax(-1)], [p + 1 for p in positions]
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
