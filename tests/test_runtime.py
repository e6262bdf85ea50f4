"""The runtime core: ModelCache (rewind, snapshots, checksummed files, all-or-nothing loads),
per-sequence isolation in the engine, the typed config, --device, and CUDA end to end where
a GPU exists."""
from __future__ import annotations

import pytest
import torch

import kvslim
from kvslim.cache import CacheConfig, KVCache, ModelCache, RecurrentStateCache
from kvslim.cli import main as cli_main
from kvslim.engine import Engine, EngineConfig, SamplingParams, resolve_device
from kvslim.loading import load_model
from kvslim.models import Batch

from .conftest import assert_devices_agree


@pytest.fixture(scope="module")
def hybrid(tiny_folder):
    model, tok, eos = load_model(tiny_folder("qwen3_5")[0], "f32")
    return model, tok, eos


def fill(model, cache: ModelCache, slot: int, ids: list[int], start: int = 0) -> torch.Tensor:
    return model(Batch.build([(slot, ids, start)]), cache, all_logits=True)


def test_make_cache_follows_the_declared_layout(hybrid):
    model, _, _ = hybrid
    cache = model.make_cache(CacheConfig(64, 2, "q8_0", "turbo3", page_size=16))
    kinds = [type(c) for c in cache]
    assert kinds == [KVCache if t == "full_attention" else RecurrentStateCache for t in model.config.layer_types]
    assert cache.kv_bytes == 0 and cache.reserved_kv_bytes == len(cache.kv_layers) * (2 * 4 + 1) * 16 * \
        cache.kv_layers[0].spec.bytes_per_token


def test_rewind_restores_a_checkpoint_and_continues_identically(hybrid):
    model, _, _ = hybrid
    ids = list(range(5, 45))
    cache = model.make_cache(CacheConfig(64, 1, "q8_0", "q8_0", page_size=8))
    fill(model, cache, 0, ids[:20])
    cp = cache.checkpoint(0)
    fill(model, cache, 0, ids[20:33], 20)
    with pytest.raises(ValueError, match="cannot rewind from 33 to 10 tokens with a checkpoint at 20"):
        cache.rewind(0, 10, cp)
    cache.rewind(0, 20, cp)
    again = fill(model, cache, 0, ids[20:], 20)
    fresh = model.make_cache(CacheConfig(64, 1, "q8_0", "q8_0", page_size=8))
    want = fill(model, fresh, 0, ids)[20:]
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


def test_saved_cache_files_are_checksummed(hybrid, tmp_path):
    model, _, _ = hybrid
    cache = model.make_cache(CacheConfig(64, 2, "q4_0", "turbo4", page_size=8))
    fill(model, cache, 0, list(range(3, 30)))
    path = tmp_path / "c.safetensors"
    cache.save(path)
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x10                                                 # one bit of tensor data
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    other = model.make_cache(CacheConfig(64, 2, "q4_0", "turbo4", page_size=8))
    fill(model, other, 0, list(range(50, 60)))
    before = other.state(0)
    with pytest.raises(ValueError, match="corrupted"):
        other.load(bad)
    assert other.offset(0) == 10 and all(torch.equal(a[k], b[k]) for a, b in zip(before, other.state(0)) for k in a)
    other.load(path)
    assert other.offset(0) == 27


def test_a_load_that_fails_part_way_leaves_the_slot_as_it_was(hybrid, tmp_path):
    model, _, _ = hybrid
    cache = model.make_cache(CacheConfig(64, 1, "f16", "f16", page_size=8))
    fill(model, cache, 0, list(range(3, 20)))
    states, lengths = cache.state(0), [c.offset(0) for c in cache]
    target = model.make_cache(CacheConfig(64, 1, "f16", "f16", page_size=8))
    fill(model, target, 0, list(range(70, 75)))
    kept = target.state(0)
    last = cache.recurrent[-1]

    def broken(slot, tensors, n):                                      # the last recurrent layer fails mid-way
        raise RuntimeError("disk went away")

    target[last].load_state, original = broken, target[last].load_state
    with pytest.raises(RuntimeError, match="disk went away"):
        target.load_state(0, states, lengths)
    target[last].load_state = original
    assert target.offset(0) == 5
    assert all(torch.equal(a[k], b[k]) for a, b in zip(kept, target.state(0)) for k in a)


def test_one_failing_sequence_leaves_the_others_identical(hybrid):
    model, tok, eos = hybrid
    config = EngineConfig.build(128, 3, "q8_0", "turbo4", device="cpu", n_ubatch=16)
    prompts = [list(range(10, 30)), list(range(40, 52)), list(range(60, 85))]
    alone = Engine(model, tok, config, eos)
    expected = []
    for i in (0, 2):
        seq = alone.submit(prompts[i], 8, SamplingParams(temperature=0))
        alone.run([seq])
        alone.release(seq)
        expected.append(seq.generated)
    engine = Engine(model, tok, config, eos)
    seqs = [engine.submit(p, 8, SamplingParams(temperature=0)) for p in prompts]

    class Broken:                                   # a grammar that fails at its second token
        calls = 0

        def allowed(self, n_vocab):
            self.calls += 1
            if self.calls == 2:
                raise ValueError("the grammar broke")
            return torch.ones(n_vocab, dtype=torch.bool)

        def accept(self, token):
            pass

    seqs[1].sampler.constraint = Broken()
    engine.run(seqs)
    assert seqs[1].finish_reason == "error" and "the grammar broke" in seqs[1].error
    assert len(seqs[1].generated) == 1
    assert [seqs[0].generated, seqs[2].generated] == expected
    for s in seqs:
        engine.release(s)
    assert engine.n_free_slots == 3 and engine.cached_tokens() == 0


def test_a_step_that_raises_leaves_no_half_written_slot_for_prefix_reuse(hybrid, monkeypatch):
    """A forward that raises in its attention layer has already advanced the DeltaNet layers before
    it. Its sequence used to be released as "cancelled" and its slot kept for prefix reuse with a
    history one token short of the cache: the next prompt continuing that conversation failed to
    restore ("cannot rewind from 28 to 27 tokens"), and so did every later one. Now the step's
    sequences end with an error, their slots are cleared, and the next prompt reads afresh."""
    model, tok, eos = hybrid
    config = EngineConfig.build(128, 1, "f16", "f16", device="cpu", n_ubatch=16, native=False, prefix_cache=True)
    engine = Engine(model, tok, config, eos)
    seq = engine.submit(list(range(20, 45)), 20, SamplingParams(temperature=0))
    while len(seq.generated) < 3:
        engine.step()
    attention = model.model.layers[model.config.layer_types.index("full_attention")]

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")
    with monkeypatch.context() as patch:
        patch.setattr(attention, "forward", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.step()
    engine.release(seq)                                              # as the server does after a failed step
    follow = seq.tokens + [7, 8, 9]
    again = engine.submit(follow, 8, SamplingParams(temperature=0))
    engine.run([again])
    fresh = Engine(model, tok, EngineConfig.build(128, 1, "f16", "f16", device="cpu", n_ubatch=16, native=False), eos)
    want = fresh.submit(follow, 8, SamplingParams(temperature=0))
    fresh.run([want])
    assert again.cached_tokens == 0 and again.generated == want.generated
    assert seq.finish_reason == "error" and "out of memory" in seq.error


def test_a_reply_has_the_same_logits_whatever_else_the_engine_runs(hybrid):
    """A sequence decodes while another reads its prompt in chunks, and the same two run alone:
    every step's logits are the same bits. The decoding row takes the native step either
    way, and the prompt is read in the same n_ubatch chunks as alone."""
    model, tok, eos = hybrid
    config = EngineConfig.build(128, 2, "q8_0", "turbo4", device="cpu", n_ubatch=16)

    def submit(engine, prompt, seen):
        seq = engine.submit(prompt, 10, SamplingParams(temperature=0))
        sample = engine._sample

        def recording(rows, logits):                # each row the sampler sees, for this sequence
            seen.extend(logits[row].clone() for s, row in rows if s is seq)
            sample(rows, logits)
        engine._sample = recording
        return seq

    first, second = list(range(10, 30)), list(range(40, 80))
    alone = [[], []]
    engine = Engine(model, tok, config, eos)
    assert engine.decode_step.native is not None, engine.decode_step.why_not_native
    for prompt, seen in zip((first, second), alone):
        seq = submit(engine, prompt, seen)
        engine.run([seq])
        engine.release(seq)
    together = [[], []]
    engine = Engine(model, tok, config, eos)
    a = submit(engine, first, together[0])
    while len(a.generated) < 2:
        engine.step()
    b = submit(engine, second, together[1])                        # read in 3 chunks while a decodes
    engine.run([a, b])
    for mine, ref in zip(together, alone):
        assert len(mine) == len(ref) == 10
        assert all(torch.equal(x, y) for x, y in zip(mine, ref))


def test_public_engine_api(hybrid):
    model, tok, eos = hybrid
    engine = Engine(model, tok, EngineConfig.build(64, 2, "f32", "f32", device="cpu", n_ubatch=8), eos)
    ids = list(range(3, 40))
    with engine.borrowed_slot() as slot:
        assert engine.n_free_slots == 1 and engine.slot_info(slot)["n_cached_tokens"] == 0
    logits = engine.score(ids)
    assert logits.shape == (len(ids), model.config.vocab_size) and engine.n_free_slots == 2
    other = engine.with_cache_types("q4_0", "turbo3")
    assert other.model is engine.model and other.type_k == "q4_0"
    assert 1e-4 < (other.score(ids) - logits).abs().max() < 1.0


def test_device_choice_is_checked(capsys):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type in ("cpu", "cuda", "mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda")
        assert cli_main(["run", "-p", "hi", "-n", "2", "--device", "cuda"]) == 2
        assert "sees no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown device 'gpu9'"):
        resolve_device("gpu9")
    with pytest.raises(ValueError, match="unknown attention backend"):
        EngineConfig.build(64, backend="fast")


def test_a_numbered_cuda_device_becomes_the_current_one(monkeypatch):
    """Triton and fla-core launch on the current CUDA device whatever their tensors' device, so
    ``--device cuda:1`` makes device 1 current; plain ``cuda`` leaves the choice to torch.
    (No GPU here: torch's device queries are stood in for.)"""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and current == [torch.device("cuda:1")]
    assert resolve_device("cuda") == torch.device("cuda") and len(current) == 1
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")
    assert len(current) == 1


def test_an_op_missing_on_mps_is_named(capsys, monkeypatch):
    # torch's own wording (aten/src/ATen/mps), raised where the tool runs: no Mac here to raise it for real
    torch_says = ("The operator 'aten::_linalg_solve_ex.result' is not currently implemented for the MPS "
                  "device. If you want this op to be considered for addition please comment on ...")

    def raise_it(argv):
        raise NotImplementedError(torch_says)

    monkeypatch.setattr("kvslim.tools.run.main", raise_it)
    assert cli_main(["run", "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvslim run: error: torch ") and "no MPS kernel for aten::_linalg_solve_ex.result" in err
    assert "PYTORCH_ENABLE_MPS_FALLBACK=1" in err and err.count("\n") == 1
    monkeypatch.setattr("kvslim.tools.run.main", lambda argv: (_ for _ in ()).throw(NotImplementedError("other")))
    with pytest.raises(NotImplementedError, match="other"):                 # not ours to rephrase
        cli_main(["run", "-p", "hi"])


def test_device_agreement_allows_rare_code_flips_not_systematic_error():
    """The CUDA tests' criterion for quantized caches (conftest.assert_devices_agree), on CPU
    tensors shaped like session 31's H200 outcome."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(100, 500, generator=gen) * 5
    unquantized = ref + torch.randn(100, 500, generator=gen) * 0.1      # the format's own effect, max ~0.4
    flips = ref.clone()
    flips.view(-1)[torch.randperm(ref.numel(), generator=gen)[:500]] += 8e-3   # 1% off by 8e-3
    assert_devices_agree(flips, ref, unquantized)
    with pytest.raises(AssertionError, match="agree to float tolerance"):
        assert_devices_agree(ref * 1.01, ref, unquantized)                   # a 1% scale error everywhere
    one_big = ref.clone()
    one_big[3, 7] += 0.2
    with pytest.raises(AssertionError, match="over a tenth"):
        assert_devices_agree(one_big, ref, unquantized)
    with pytest.raises(AssertionError):
        assert_devices_agree(flips, ref)                                      # float caches: no flips allowed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "turbo4"), ("turbo3", "q4_0"), ("nl4s", "klt3")])
def test_cuda_matches_cpu_end_to_end(type_k, type_v):
    ids = list(range(3, 300))
    cpu = kvslim.load(ctx=512, cache_type_k=type_k, cache_type_v=type_v, dtype="f32", device="cpu")
    gpu = kvslim.load(ctx=512, cache_type_k=type_k, cache_type_v=type_v, dtype="f32", device="cuda")
    assert gpu.engine.cache.kv_layers[0].k_pool.device.type == "cuda"
    unquantized = None if type_k == type_v == "f16" else \
        kvslim.load(ctx=512, cache_type_k="f16", cache_type_v="f16", dtype="f32", device="cpu").logits(ids)
    assert_devices_agree(gpu.logits(ids), cpu.logits(ids), unquantized)
    prompt = "Once upon a time"
    assert gpu.generate(prompt, 16, temperature=0).token_ids == cpu.generate(prompt, 16, temperature=0).token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "turbo4")])
def test_cuda_forward_makes_no_host_sync(type_k, type_v):
    """A decode step's forward and a prompt chunk's, on a GPU, with torch's sync debugging set to
    raise: no layer reads a value back to the host (the overflow flag is checked once per step,
    by the engine, outside the forward)."""
    llm = kvslim.load(ctx=512, n_parallel=2, cache_type_k=type_k, cache_type_v=type_v, dtype="f32", device="cuda")
    model, cache = llm.engine.model, llm.engine.cache
    model(Batch.build([(0, list(range(3, 40)), 0)], device="cuda"), cache)         # history to read
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(Batch.build([(0, [41], 37)], device="cuda"), cache)                      # decode token
        model(Batch.build([(0, [42], 38), (1, list(range(5, 30)), 0)], device="cuda"), cache)   # mixed
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights", [None, "q8_0"])
def test_cuda_mixture_decode_makes_no_host_sync(tiny_folder, weights):
    """A mixture-of-experts decode step on a GPU: the router's choice stays on the device (dense
    experts through Experts.grouped; q8_0 experts through the grouped Triton GEMV, with the
    kernels on), so sync debugging set to raise sees nothing. With the kernels on, a prompt
    chunk goes that way too (the pairs sorted into tiles on the device, one grouped GEMM)."""
    from kvslim import gpu
    if weights and not gpu.TRITON:
        pytest.skip("quantized experts group through the Triton kernels: KVSLIM_TRITON=1")
    model, _, _ = load_model(tiny_folder("qwen3_5_moe")[0], "f32", device="cuda", weights=weights)
    cache = model.make_cache(128, 2, "q8_0", "turbo4")
    model(Batch.build([(0, list(range(3, 20)), 0), (1, list(range(5, 9)), 0)], device="cuda"), cache)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(Batch.build([(0, [41], 17), (1, [42], 4)], device="cuda"), cache)          # one decode step
        if gpu.TRITON:                                                                 # dense or q8_0 experts
            model(Batch.build([(1, list(range(7, 107)), 5)], device="cuda"), cache)      # a prompt chunk
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sequences_sharing_a_prompt_read_it_once(hybrid):
    model, tok, eos = hybrid
    prompt = list(range(10, 60))
    config = EngineConfig.build(128, 3, "q8_0", "turbo4", page_size=16, device="cpu", n_ubatch=16)
    alone = Engine(model, tok, config, eos)
    ref = alone.submit(prompt, 10, SamplingParams(temperature=0))
    alone.run([ref])
    engine = Engine(model, tok, config, eos)
    seqs = [engine.submit(prompt, 10, SamplingParams(temperature=0)) for _ in range(3)]
    prefill_steps = 0
    while not all(s.done for s in seqs):
        prefill_steps += any(len(s.pending) > 1 for s in seqs)
        engine.step()
    assert prefill_steps == 4                                           # 50 tokens in ubatches of 16, once
    assert [s.generated for s in seqs] == [ref.generated] * 3
    assert [s.cached_tokens for s in seqs] == [0, len(prompt), len(prompt)]
    assert {engine.cache.offset(s.slot) for s in seqs} == {alone.cache.offset(ref.slot)}


def test_a_follower_whose_leader_is_cancelled_reads_its_prompt_itself(hybrid):
    model, tok, eos = hybrid
    prompt = list(range(10, 60))
    config = EngineConfig.build(128, 2, "f16", "f16", device="cpu", n_ubatch=16)
    alone = Engine(model, tok, config, eos)
    ref = alone.submit(prompt, 6, SamplingParams(temperature=0))
    alone.run([ref])
    engine = Engine(model, tok, config, eos)
    leader, follower = (engine.submit(prompt, 6, SamplingParams(temperature=0)) for _ in range(2))
    engine.step()
    engine.release(leader)
    engine.run([follower])
    assert follower.generated == ref.generated and follower.cached_tokens == 0
