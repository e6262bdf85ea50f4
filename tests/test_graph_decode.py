"""Decode steps replayed from CUDA graphs (``engine/cuda_graphs.py``).

Without a GPU: the page buckets, the bucketed forward against the exact one, and the
graph bookkeeping (static inputs, one graph per batch size and bucket, outputs that a
later replay does not overwrite, the step taken once when a graph is recorded) with a
stand-in recorder. That stand-in re-runs the recorded call on replay, and undoes what
the call did while "recording", as a real recording runs nothing. On a GPU the real
recorder is held to the eager step: greedy tokens and logits (tests named *cuda*, picked
by ``benchmarks/gpu_session.sh``).
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import kvslim
import kvslim.gpu
from kvslim.engine import Engine, EngineConfig, SamplingParams
from kvslim.engine.cuda_graphs import GraphedDecode, page_bucket
from kvslim.engine.decode_step import DecodeStep
from kvslim.loading import load_model
from kvslim.models import Batch


@pytest.fixture(scope="module")
def hybrid(tiny_folder):
    model, tok, eos = load_model(tiny_folder("qwen3_5")[0], "f32")
    return model, tok, eos


def test_page_buckets_are_few_and_waste_at_most_half():
    buckets = sorted({page_bucket(n, 10_000) for n in range(1, 513)})
    assert buckets[:9] == [2, 3, 4, 6, 8, 12, 16, 24, 32] and buckets[-1] == 512
    assert len(buckets) == 17                                # 128K tokens in pages of 256: 512 pages
    for n in range(1, 2000):
        b = page_bucket(n, 10_000)
        assert n <= b <= max(2, 1.5 * n)
    assert page_bucket(300, 320) == 320 and page_bucket(1, 1) == 2   # the block table's width caps it


def filled(model, type_k, type_v, prompts, page_size=8):
    cache = model.make_cache(160, len(prompts), type_k, type_v, page_size=page_size)
    with torch.inference_mode():
        logits = torch.cat([model(Batch.build([(s, ids, 0)]), cache) for s, ids in enumerate(prompts)])
    return cache, logits


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "turbo4"), ("turbo3", "q4_0")])
def test_reading_a_bucket_of_pages_gives_the_exact_pages_logits(hybrid, type_k, type_v):
    """A graph reads its bucket's pages, past the sequences' ends: the null page, or pages
    masked by position, change nothing."""
    model, _, _ = hybrid
    prompts = [list(range(5, 22)), list(range(30, 39))]
    exact, bucket = (one_step(model, filled(model, type_k, type_v, prompts)[0], extra) for extra in (0, 7))
    torch.testing.assert_close(bucket, exact, atol=1e-6, rtol=0)


def one_step(model, cache, extra_pages: int) -> torch.Tensor:
    """One DecodeBatch step for slots 0 and 1 (at 17 and 9 tokens), reading ``extra_pages`` more
    pages per sequence than they need."""
    slots, positions, tokens = [0, 1], [17, 9], [3, 4]
    step = DecodeStep(model, cache, compile=False, native=False)
    cache.prepare_decode(slots, positions)
    with torch.inference_mode():
        out = step._forward(*(torch.tensor(x) for x in (tokens, positions, slots)),
                            cache.decode_pages(positions) + extra_pages)
    cache.commit_decode(slots)
    return out


def bucketed_logits(pairs, path) -> None:
    """In an interpreted child (the Triton kernels serving decode attention and appends): the
    bundled model's step logits reading the exact pages and 5 more, per pair, and the number of
    decode kernel calls. Only the attention and append kernels serve (``attention_kernels_only``)."""
    from kvslim.gpu import paged_decode

    from .triton_harness import attention_kernels_only
    attention_kernels_only()
    calls = [0]
    inner = paged_decode.step_output

    def counted(*args, **kw):
        calls[0] += 1
        return inner(*args, **kw)
    paged_decode.step_output = counted
    model, _, _ = load_model(None, torch.float32, torch.device("cpu"))
    prompts = [list(range(5, 22)), list(range(30, 39))]
    out = [[one_step(model, filled(model, k, v, prompts, page_size=4)[0], extra) for extra in (0, 5)]
           for k, v in pairs]
    torch.save({"logits": out, "calls": calls[0]}, path)


@pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed")
def test_the_triton_decode_reads_a_bucket_of_pages_as_the_exact_pages(tmp_path):
    """The kernel's key splits past a sequence's end read nothing: a graph's bucket of pages gives
    the exact pages' logits with the kernels on too (under Triton's interpreter)."""
    from .triton_harness import run_interpreted
    pairs = [("q8_0", "turbo4"), ("turbo3", "q4_0")]
    got = run_interpreted("tests.test_graph_decode", "bucketed_logits", pairs, tmp_path)
    assert got["calls"] == 2 * len(pairs) * 2                # 2 attention layers, 2 steps per pair
    for exact, bucket in got["logits"]:
        torch.testing.assert_close(bucket, exact, atol=1e-6, rtol=0)


class StandInGraph:
    """Records (call, args, output) while "capturing"; replay re-runs the call into the output."""
    recording = None

    def __init__(self):
        self.calls = []

    def replay(self):
        for forward, args, out in self.calls:
            out.copy_(forward(*args))


def recording_forward(forward, cache):
    """``forward`` as the graph sees it: while a StandInGraph records, the call is noted and what it
    wrote to the caches is undone (a real recording runs no kernel)."""
    def call(*args):
        graph = StandInGraph.recording
        if graph is None:
            return forward(*args)
        saved = [(t, t.clone()) for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        out = forward(*args)
        for t, before in saved:
            t.copy_(before)
        graph.calls.append((forward, args, out))
        return out
    return call


@contextmanager
def stand_in_capture(graph, pool, stream):
    StandInGraph.recording = graph
    try:
        yield
    finally:
        StandInGraph.recording = None


def test_graph_bookkeeping_against_the_eager_step(hybrid):
    """Twelve steps with the batch changing size and the pages crossing buckets: every step's
    logits are the eager DecodeBatch step's; graphs are made once per (batch, bucket) and replayed."""
    model, _, _ = hybrid
    prompts = [list(range(5, 20)), list(range(30, 39)), list(range(50, 73))]
    ref_cache, logits = filled(model, "q8_0", "turbo4", prompts, page_size=4)
    cache, _ = filled(model, "q8_0", "turbo4", prompts, page_size=4)
    reference = DecodeStep(model, ref_cache, compile=False, native=False)
    step = DecodeStep(model, cache, compile=False, native=False)
    step.graphed = GraphedDecode(recording_forward(step._forward, cache), "cpu", 3, cache.kv_layers[0].pages_per_slot,
                                 graph=StandInGraph, capture=stand_in_capture)
    assert step.path == "graphs" and step.static
    positions = [len(p) for p in prompts]
    tokens = [int(t) for t in logits.argmax(-1)]
    held = []
    for i in range(12):
        slots = [2, 0, 1] if i % 4 else [1]                      # batch 3, and batch 1 every fourth step
        want = reference(slots, [tokens[s] for s in slots], [positions[s] for s in slots])
        got = step(slots, [tokens[s] for s in slots], [positions[s] for s in slots])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        held.append((got, got.clone()))
        for s, t in zip(slots, want.argmax(-1).tolist()):
            tokens[s], positions[s] = t, positions[s] + 1
    assert all(torch.equal(a, b) for a, b in held)            # no replay wrote into a returned tensor
    assert [cache.offset(s) for s in range(3)] == [ref_cache.offset(s) for s in range(3)]
    keys = set(step.graphed._graphs)
    assert {n for n, _ in keys} == {1, 3} and len({b for _, b in keys}) >= 2 and len(keys) < 12


def test_a_failed_recording_keeps_decoding_eagerly(hybrid):
    model, _, _ = hybrid
    prompts = [list(range(5, 20))]
    ref_cache, logits = filled(model, "q8_0", "q8_0", prompts)
    cache, _ = filled(model, "q8_0", "q8_0", prompts)

    @contextmanager
    def refusing(graph, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
        yield

    reference = DecodeStep(model, ref_cache, compile=False, native=False)
    step = DecodeStep(model, cache, compile=False, native=False)
    step.graphed = GraphedDecode(step._forward, "cpu", 1, cache.kv_layers[0].pages_per_slot,
                                 graph=StandInGraph, capture=refusing)
    token, pos = int(logits[0].argmax()), len(prompts[0])
    for _ in range(3):
        want, got = reference([0], [token], [pos]), step([0], [token], [pos])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        token, pos = int(want.argmax()), pos + 1
    assert step.path == "eager (graphs failed)" and "operation not permitted" in step.graphed.why_eager
    assert step.graphed.n_graphs == 0 and cache.offset(0) == ref_cache.offset(0)


def test_graphs_are_refused_where_they_cannot_run(hybrid):
    model, _, _ = hybrid
    step = DecodeStep(model, model.make_cache(32, 1), compile=False, native=False, cuda_graphs=True)
    assert step.graphed is None and "CUDA device" in step.why_not_graphs and step.path == "eager"
    default = DecodeStep(model, model.make_cache(32, 1), compile=False, native=False)   # on where CUDA is
    assert default.graphed is None and "CUDA device" in default.why_not_graphs
    off = DecodeStep(model, model.make_cache(32, 1), compile=False, native=False, cuda_graphs=False)
    assert off.why_not_graphs == "turned off (--no-cuda-graphs)"
    with pytest.raises(ValueError, match="1..2 sequences"):
        GraphedDecode(lambda *a: None, "cpu", 2, 4).run([1, 2, 3], [0, 0, 0], [0, 1, 2], 1)


def test_the_flag_reaches_the_engine_config():
    import argparse

    from kvslim.tools.engine_args import add_device_args, engine_config
    p = argparse.ArgumentParser()
    add_device_args(p)
    args = p.parse_args(["--cuda-graphs", "--device", "cpu"])
    args.ctx_size, args.cache_type_k, args.cache_type_v, args.ubatch_size = 64, "f16", "f16", 32
    assert engine_config(args).cuda_graphs is True
    args = p.parse_args(["--device", "cpu"])
    args.ctx_size, args.cache_type_k, args.cache_type_v, args.ubatch_size = 64, "f16", "f16", 32
    assert engine_config(args).cuda_graphs is None                          # the device decides
    args = p.parse_args(["--no-cuda-graphs", "--device", "cpu"])
    args.ctx_size, args.cache_type_k, args.cache_type_v, args.ubatch_size = 64, "f16", "f16", 32
    assert engine_config(args).cuda_graphs is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "turbo4")])
def test_cuda_graphs_greedy_tokens_equal_eager(type_k, type_v):
    """On a GPU, two sequences decoded through recorded graphs give the eager steps' greedy
    tokens, and the step really replayed graphs (no fallback)."""
    llm = kvslim.load(ctx=512, n_parallel=2, cache_type_k=type_k, cache_type_v=type_v, dtype="f32", device="cuda")
    model = llm.engine.model
    replies = []
    for graphs in (False, True):
        config = EngineConfig.build(512, 2, type_k, type_v, device="cuda", n_ubatch=64, cuda_graphs=graphs)
        engine = Engine(model, llm.engine.tokenizer, config, llm.engine.eog_ids)
        assert engine.warm_up() >= 0
        seqs = [engine.submit(list(range(3, 3 + n)), 40, SamplingParams(temperature=0)) for n in (20, 300)]
        engine.run(seqs)
        replies.append([s.generated for s in seqs])
        if graphs:
            assert engine.decode_step.path == "graphs", engine.decode_step.graphed.why_eager
            assert engine.decode_step.graphed.n_graphs >= 2
    assert replies[1] == replies[0] and all(len(r) > 1 for r in replies[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "turbo4")])
def test_cuda_graphs_with_pdl_give_the_plain_launches_tokens(monkeypatch, type_k, type_v):
    """With the kernels on, decode steps recorded with programmatic dependent launch (each kernel
    waiting for the one before, which let it launch early: ``kvslim.gpu.PDL``) give the greedy
    tokens of plain launches, and the steps replayed graphs (the recording took the launches)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9+")
    monkeypatch.setattr(kvslim.gpu, "TRITON", True)
    llm = kvslim.load(ctx=512, n_parallel=2, cache_type_k=type_k, cache_type_v=type_v, dtype="bf16", device="cuda")
    replies = []
    for pdl in (False, True):
        monkeypatch.setattr(kvslim.gpu, "PDL", pdl)
        config = EngineConfig.build(512, 2, type_k, type_v, device="cuda", n_ubatch=64, cuda_graphs=True)
        engine = Engine(llm.engine.model, llm.engine.tokenizer, config, llm.engine.eog_ids)
        assert engine.warm_up() >= 0
        seqs = [engine.submit(list(range(3, 3 + n)), 40, SamplingParams(temperature=0)) for n in (20, 300)]
        engine.run(seqs)
        replies.append([s.generated for s in seqs])
        assert engine.decode_step.path == "graphs", engine.decode_step.graphed.why_eager
    assert replies[1] == replies[0] and all(len(r) > 1 for r in replies[0])
