"""Speculative decoding from prompt-lookup drafts (``engine/speculative.py``, ``Engine._speculate``):
the tokens are those of decoding one at a time, for hybrid models (DeltaNet state restored
from a checkpoint and read again) and attention-only ones (KV trimmed)."""
from __future__ import annotations

import pytest

import kvslim
from kvslim.data import TEXT
from kvslim.engine import EngineConfig, SamplingParams
from kvslim.engine.speculative import PromptLookup


def test_the_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup()
    tokens = [5, 6, 7, 1, 2, 9, 9, 6, 7, 3, 4, 0, 6, 7]
    assert lookup.draft(tokens, 3) == [3, 4, 0]              # "6 7" last seen before 3 4 0
    assert lookup.draft(tokens + [3], 2) == [4, 0]          # "7 3" (3-gram 6 7 3 too): then 4 0
    assert PromptLookup().draft([1, 2, 3, 4], 5) == []       # no suffix seen before
    assert PromptLookup().draft([1, 2, 1, 2], 5) == [1, 2]  # runs into the suffix itself
    assert lookup.draft([8, 8, 8], 2) == [8]                 # fewer tokens: indexed again


def passage_prompt() -> str:
    """Held-out text, then its opening again: a model that has read a passage tends to copy it."""
    text = (TEXT / "austen-heldout.txt").read_text(encoding="utf-8")[:2400]
    return text[:1200] + "\n\n" + text[:200]


def generate_both(path, n, stop=(), dtype="f32", **sampling):
    outs = []
    for draft in (0, 8):
        llm = kvslim.load(path, dtype=dtype,
                          config=EngineConfig.build(2048, 1, "f16", "f16", draft_max=draft, prefix_cache=True))
        out = llm.generate(passage_prompt(), max_tokens=n, ignore_eos=True, stop=list(stop), **sampling)
        again = llm.generate(passage_prompt() + out.text + " and", max_tokens=8, temperature=0)   # reuses the slot
        outs.append((out, again))
    return outs


def test_greedy_tokens_are_those_of_decoding_one_at_a_time():
    """The bundled hybrid in float32: drafts kept and drafts cut (so the DeltaNet checkpoint
    path runs), the same 120 tokens, and a follow-up request over the slot's kept contents
    gives the same reply too."""
    (plain, plain_again), (spec, spec_again) = generate_both(None, 120, temperature=0)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 120
    t = spec.timings
    assert 0 < t["draft_n_accepted"] < t["draft_n"], t
    assert "draft_n" not in plain.timings
    assert spec_again.token_ids == plain_again.token_ids


def test_the_c_step_verifies_drafts_with_the_bits_of_one_token_steps(monkeypatch):
    """Where the C step decodes, a drafted chunk goes through it as rows of one slot, each row
    with the bits of its own one-token step: in bfloat16 too (the prompt-style forward breaks the
    bundled model's exact logit ties otherwise than the step, and drifted at token 179 of 200)."""
    from kvslim.engine.native_step import NativeStep
    rows = []
    step = NativeStep.__call__

    def counted(self, slots, tokens, positions):
        rows.append(len(slots) - len(set(slots)))
        return step(self, slots, tokens, positions)
    monkeypatch.setattr(NativeStep, "__call__", counted)
    (plain, _), (spec, _) = generate_both(None, 200, dtype="bf16", temperature=0)
    if not rows:
        pytest.skip("no C step here")
    assert max(rows) > 0                                   # chunks went through the C step
    assert spec.token_ids == plain.token_ids and spec.timings["draft_n_accepted"] > 0


def test_seeded_sampling_draws_the_same_tokens():
    """Each kept token is the sampler's own draw, one draw per token as without drafts."""
    (plain, _), (spec, _) = generate_both(None, 60, temperature=0.7, seed=11, top_k=5)
    assert spec.token_ids == plain.token_ids
    assert spec.timings["draft_n"] > 0


def test_attention_only_models_and_stops_inside_a_draft(tiny_folder):
    """An attention-only model (KV trimmed back, no checkpoint); a stop string that falls inside
    a kept draft ends the reply where decoding one at a time ends it; max_tokens is exact."""
    folder, _ = tiny_folder("llama")
    (plain, _), (spec, _) = generate_both(folder, 40, temperature=0)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 40
    (plain, _), (spec, _) = generate_both(None, 80, stop=["the"], temperature=0)
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"


def test_bad_draft_max_is_refused():
    with pytest.raises(ValueError, match=r"draft_max \(--draft-max\) must be 0 \(off\) or positive, got -1"):
        EngineConfig.build(64, 1, draft_max=-1)
    assert SamplingParams(temperature=0).greedy


def test_run_and_serve_take_draft_max():
    from kvslim.tools import run, serve
    from kvslim.tools.engine_args import engine_config
    for tool in (run, serve):
        args = tool.build_parser().parse_args(["--draft-max", "6"])
        assert engine_config(args, ctx=64, n_parallel=1).draft_max == 6
