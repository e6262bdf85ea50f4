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


@pytest.mark.parametrize("kind", ["llama", "bundled"])
def test_choices_sharing_a_prompt_fork_at_its_end_with_drafts_on(tiny_folder, kind):
    """n > 1 with --draft-max where the prompt's last token is read alone (17 tokens in ubatches
    of 16) and a draft follows it: the leader used to speculate over that token, so the waiting
    choice was not forked at the prompt's end. An attention-only model forked it at a later step
    from a cache past the prompt (the next step raised "writes position 17 but the cache holds
    18", failing every request in the batch); the bundled hybrid, drafting at every step, left it
    to read the prompt again after the leader ended. Now both choices are the one-at-a-time reply
    and the second reads nothing."""
    from kvslim.engine import Engine
    from kvslim.loading import load_model

    model, tok, eos = load_model(tiny_folder(kind)[0] if kind == "llama" else None, "f32")
    prompt = ([11, 12, 13, 14, 15] * 4)[:17]                          # ends in "13 14 15 11 12": a draft
    replies = []
    for draft in (0, 4):
        engine = Engine(model, tok, EngineConfig.build(64, 2, "q8_0", "q8_0", device="cpu", n_ubatch=16,
                                                       draft_max=draft), eos)
        pair = [engine.submit(prompt, 10, SamplingParams(temperature=0)) for _ in range(2)]
        engine.run(pair)
        assert [s.cached_tokens for s in pair] == [0, 17]                 # the second took the first's cache
        assert (pair[0].n_drafted > 0) == bool(draft)
        replies.append([s.generated for s in pair])
    assert replies[1] == [replies[0][0]] * 2 == replies[0]
