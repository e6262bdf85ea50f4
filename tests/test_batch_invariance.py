"""A greedy reply is the same whatever else the engine runs: with the C decode step (the default
where it applies), every logit a sequence samples from has the bits it has when the sequence
runs alone, beside other prompts and replies of other lengths."""
from __future__ import annotations

import pytest
import torch

from kvslim.engine import Engine, EngineConfig, SamplingParams
from kvslim.loading import load_model


def recorded(engine: Engine, prompt: list[int], n: int, seen: list):
    """Submit ``prompt``; each logits row the sampler draws this sequence's tokens from goes to ``seen``."""
    seq = engine.submit(prompt, n, SamplingParams(temperature=0))
    sample = engine._sample

    def recording(rows, logits):
        seen.extend(logits[row].clone() for s, row in rows if s is seq)
        sample(rows, logits)
    engine._sample = recording
    return seq


def alone(model, tok, eos, config, prompt, n) -> list:
    engine, seen = Engine(model, tok, config, eos), []
    engine.run([recorded(engine, prompt, n, seen)])
    return seen


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_prompts_read_in_one_step_have_the_bits_of_each_read_alone(tiny_folder, kind):
    """Two prompts short enough to share one ubatch, read in the same step while a third
    sequence decodes: each prompt's chunk goes through a forward of its own. In one Batch the
    GEMMs' sums depended on the rows beside them (bundled model, 4 prompts of 96-301 tokens at
    -ub 512: first-token logits up to 0.09 away from each prompt read alone)."""
    model, tok, eos = load_model(tiny_folder(kind)[0], "f32")
    config = EngineConfig.build(256, 3, "q8_0", "turbo4", device="cpu", n_ubatch=128)
    prompts = [list(range(10, 20)), list(range(30, 90)), list(range(100, 150))]
    want = [alone(model, tok, eos, config, p, 6) for p in prompts]
    engine = Engine(model, tok, config, eos)
    assert engine.decode_step.native is not None, engine.decode_step.why_not_native
    seen = [[], [], []]
    first = recorded(engine, prompts[0], 6, seen[0])
    engine.step()                                                  # its prompt read: it decodes from now on
    pair = [recorded(engine, p, 6, s) for p, s in zip(prompts[1:], seen[1:])]
    engine.step()
    assert all(s.n_cached == len(s.prompt) for s in pair)          # 60 + 50 tokens: one step
    engine.run([first, *pair])
    for got, ref in zip(seen, want):
        assert len(got) == len(ref) == 6
        assert all(torch.equal(x, y) for x, y in zip(got, ref))


def test_slots_of_cancelled_sequences_serve_the_next_prompts_as_a_fresh_engine(tiny_folder):
    """With prefix reuse, a sequence cancelled while reading its prompt and one cancelled in its
    reply leave their slots to the next prompts that share them: those reuse what the slots hold
    (the DeltaNet state live at the cut) and reply as an engine reading them fresh, and the
    sequence decoding throughout keeps the bits it has alone."""
    model, tok, eos = load_model(tiny_folder("qwen3_5")[0], "f32")
    config = EngineConfig.build(256, 3, "q8_0", "turbo4", device="cpu", n_ubatch=16, prefix_cache=True)
    survivor, in_prompt, in_reply = list(range(10, 25)), list(range(40, 90)), list(range(100, 118))
    want = alone(model, tok, eos, config, survivor, 24)
    engine, seen = Engine(model, tok, config, eos), []
    first = recorded(engine, survivor, 24, seen)
    cut = [engine.submit(p, 40, SamplingParams(temperature=0)) for p in (in_prompt, in_reply)]
    for seq, gone in zip(cut, (lambda s: s.n_cached >= 32, lambda s: len(s.generated) >= 3)):
        while not gone(seq):
            engine.step()
        engine.release(seq)                                        # its client went away
    assert cut[0].n_cached == 32 and cut[1].finish_reason == "cancelled" and len(cut[1].generated) == 3
    nexts = [in_prompt + [7, 8, 9], cut[1].tokens + [7, 8, 9]]
    fresh = Engine(model, tok, EngineConfig.build(256, 1, "q8_0", "turbo4", device="cpu", n_ubatch=16), eos)
    for prompt, gone in zip(nexts, cut):
        seq = engine.submit(prompt, 8, SamplingParams(temperature=0))
        ref = fresh.submit(prompt, 8, SamplingParams(temperature=0))
        engine.run([seq])
        fresh.run([ref])
        fresh.release(ref)
        assert seq.slot == gone.slot and seq.cached_tokens == gone.n_cached
        assert seq.generated == ref.generated
    engine.run([first])
    assert len(seen) == len(want) == 24 and all(torch.equal(x, y) for x, y in zip(seen, want))
