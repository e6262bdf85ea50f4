"""kvslim.eval.haystack: training's needle rows come from the library builder, unchanged."""
from __future__ import annotations

import hashlib
import random
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kvslim.data import HELDOUT_FILES
from kvslim.eval import haystack, needle

from .conftest import import_training

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mixture():
    """training's DataMixture over the shipped held-out text instead of the corpus' token caches."""
    train = import_training("train")
    tok = Tokenizer.from_file(str(ROOT / "training" / "tokenizer.json"))
    streams = {}
    for path in HELDOUT_FILES:
        docs = [d for d in path.read_text(encoding="utf-8").split("\f\n") if d.strip()]
        streams[path.stem] = np.concatenate([np.asarray(e.ids + [0], dtype=np.uint16)
                                             for e in tok.encode_batch(docs)])
    args = types.SimpleNamespace(answer_weight=10.0, answer_stop="", kinds="", asks=1, needle_frac=0.35, copy_frac=0.0, seed=1234, source_power=0.5, fill="0.2:1.0", text_weight=1.0, canonical=False)
    return train.DataMixture(args, tok, streams)


def test_training_needle_rows_are_byte_identical_to_before_the_move(mixture):
    # Digest of 40 rows of training's _needle_row taken before its body moved to kvslim.eval.haystack
    # (same seeds, lengths and held-out streams): the training data must not change.
    digest = hashlib.sha256()
    for seed in range(40):
        ids, weights = mixture._needle_row(random.Random(f"pin:{seed}"), [256, 1024, 4096][seed % 3])
        assert len(ids) == [256, 1024, 4096][seed % 3] + 1 and ids.dtype == np.int64
        digest.update(ids.tobytes())
        digest.update(weights.tobytes())
    assert digest.hexdigest() == "77f5bf167b68be2b226d00d00c6545bffd2aefd9af674f780719e30c74f263a3"


def test_insert_puts_each_sentence_after_a_sentence_end_at_its_depth(mixture):
    space, tok = mixture.space, mixture.tok
    filler = mixture.train["austen-heldout"][:3000].astype(np.int64)
    sentences = ["The pass key is 12345.", "The special magic number for apple is 777."]
    ids, starts = space.insert(filler, sentences, [0.5, 0.0])
    ends = space.sentence_ends(filler)
    for sentence, start, depth in zip(sentences, starts, [0.5, 0.0]):
        assert tok.decode(ids[start:start + len(space.encode(" " + sentence))]).strip() == sentence
        cut = haystack.snap(ends, int(depth * len(filler)))
        assert cut == 0 or filler[cut - 1] in np.flatnonzero(space.sentence_end)
        assert abs(cut - depth * len(filler)) < 400      # held-out prose has a sentence end every few dozen tokens
    assert len(ids) == len(filler) + sum(len(space.needle_ids(filler, space.cut_at(filler, d), s))
                                         for s, d in zip(sentences, [0.5, 0.0]))


def test_answer_stop_follows_the_answer_with_the_answer_weight(mixture):
    # --answer-stop "." : the row ends "... is 48213." + end-of-text, and the "." weighs like a digit,
    # so the model is taught where the number ends (the bundled model's misses ran on by one digit).
    eos_id = sys.modules[type(mixture).__module__].EOS_ID
    window = lambda r, n: mixture._window(r, n)[1]  # noqa: E731  (training's filler, as _needle_row passes it)
    plain_row, plain_w = haystack.needle_row(mixture.space, random.Random("stop:1"), 1024, window, eos_id, 10.0)
    ids, weights = haystack.needle_row(mixture.space, random.Random("stop:1"), 1024, window, eos_id, 10.0, ".")
    heavy = np.flatnonzero(weights > 1.0)
    assert mixture.tok.decode(ids[heavy].tolist()).endswith(".")
    assert heavy[-1] == len(ids) - 2 and ids[-1] == eos_id      # "." then end-of-text
    assert len(heavy) == np.count_nonzero(plain_w > 1.0) + 1
    assert mixture.tok.decode(ids[heavy[:-1]].tolist()) == mixture.tok.decode(plain_row[np.flatnonzero(plain_w > 1.0)].tolist())


def test_quiz_rows_ask_several_keyed_facts_each_answered_from_its_own_needle(mixture):
    # --kinds magic_many:1 --asks 3: 5-10 keyed facts in the haystack, then 3 questions about
    # distinct keys, each answer (and its ".") weighted; every answer is the number its key's
    # needle states, so a model can only score by looking the key up.
    eos_id = sys.modules[type(mixture).__module__].EOS_ID
    window = lambda r, n: mixture._window(r, n)[1]  # noqa: E731
    kinds = needle.parse_kinds("magic_many:1")
    for seed in range(6):
        ids, weights = haystack.needle_row(mixture.space, random.Random(f"quiz:{seed}"), 2048, window, eos_id,
                                           20.0, ".", kinds, 3)
        assert len(ids) == 2049 and ids[-1] == eos_id
        text = mixture.tok.decode(ids.tolist())
        facts = dict(re.findall(r"special magic numbers? for (\w+) is:? (\d+)\.", text))
        asked = re.findall(r"for (\w+)\? The special magic number for \1 is (\d+)\.", text)
        assert 5 <= len(facts) <= 10 and len(asked) == 3 and len({k for k, _ in asked}) == 3
        assert all(facts[key] == number for key, number in asked)
        heavy = mixture.tok.decode(ids[weights > 1.0].tolist())
        assert heavy.replace(" ", "") == "".join(f"{number}." for _, number in asked)


def test_make_needle_draws_as_a_one_question_quiz():
    # make_needle is make_quiz with asks=1: the same draws, so earlier training rows are unchanged
    for kind in ("passkey", "magic", "magic_multi", "code"):
        for seed in range(20):
            sentences, asked, question, answer = needle.make_needle(random.Random(seed), kind)
            assert needle.make_quiz(random.Random(seed), kind, 1) == (sentences, [asked], [(question, answer)])


def test_parse_kinds_names_the_bad_item():
    assert needle.parse_kinds("passkey:0.25,magic_many:0.75") == {**dict.fromkeys(needle.KINDS, 0.0),
                                                                  "passkey": 0.25, "magic_many": 0.75}
    for spec, message in (("passkeys:1", "unknown needle kind .passkeys."), ("magic:x", "'magic:x' is not"),
                          ("magic:-1", "negative"), ("magic:0", "every kind weight 0")):
        with pytest.raises(ValueError, match=message):
            needle.parse_kinds(spec)


def _batch_digest(mixture, steps=range(6)) -> tuple[str, list]:
    digest, batches = hashlib.sha256(), []
    for step in steps:
        batch = mixture.batch(step, 512, 8)
        for t in batch[:5]:
            digest.update(t.numpy().tobytes())
        batches.append(batch)
    return digest.hexdigest(), batches


def test_training_batches_are_unchanged_by_logging_row_kinds(mixture):
    # Digest of batch()'s five tensors taken before batches carried row kinds: batch() now
    # draws each needle row's kind itself, and that draw must be the one needle_row made.
    digest, _ = _batch_digest(mixture)
    assert digest == "c5483db187a9b30f7e3ecee2fb04cab3afd983205314df28e17d462e50712b6f"


def test_training_batches_name_the_kind_of_each_needle_row(mixture):
    train = import_training("train")
    _, batches = _batch_digest(mixture)
    seen = set()
    for inputs, _, _, answer, _, kinds in batches:
        assert kinds.shape == (inputs.shape[0],)
        for row, index in enumerate(kinds.tolist()):
            assert bool(answer[row].any()) == (index >= 0)   # needle rows, and only they, have answers
            if index < 0:
                continue
            kind = train.NEEDLE_KINDS[index]
            seen.add(kind)
            text = mixture.tok.decode(inputs[row].tolist())
            assert ("pass key" in text) == (kind == "passkey"), (kind, text[-300:])
    assert {"passkey", "magic"} <= seen


def passkey_row(mixture, rng, length, fill, canonical=False):
    """A training pass-key row of ``mixture`` (answers weigh 10, "." after them); and the eos id."""
    eos_id = sys.modules[type(mixture).__module__].EOS_ID
    window = lambda r, n: mixture._window(r, n)[1]  # noqa: E731
    ids, weights = haystack.needle_row(mixture.space, rng, length, window, eos_id, 10.0, ".",
                                       needle.parse_kinds("passkey:1"), 1, None, fill, canonical)
    return ids, weights, eos_id


def test_fill_sets_the_haystack_share_of_a_row_and_so_the_needle_distance(mixture):
    # --fill 0.8:1.0: the sample (haystack + question) takes 80-100% of the row, so the pass key sits
    # up to the whole row away from its question; the default 0.2:1.0 rows are shorter on average.
    def sample_share(seed, fill):
        ids, _, eos_id = passkey_row(mixture, random.Random(f"fill:{seed}"), 2048, fill)
        eos = np.flatnonzero(ids[:-1] == eos_id)       # the padding window before the sample ends in eos
        return (len(ids) - 1 - (eos[-1] + 1 if len(eos) else 0)) / (len(ids) - 1)

    long_rows = [sample_share(seed, (0.8, 1.0)) for seed in range(12)]
    default_rows = [sample_share(seed, (0.2, 1.0)) for seed in range(12)]
    assert min(long_rows) >= 0.79
    assert np.mean(default_rows) < np.mean(long_rows) - 0.15


def test_canonical_rows_use_the_evaluation_phrasing_and_drawn_rows_vary_it(mixture):
    # --canonical: every pass-key row reads as the grid's sample does; by default the phrasing is drawn
    def row_text(seed, canonical):
        ids, weights, _ = passkey_row(mixture, random.Random(f"canon:{seed}"), 1024, (0.5, 1.0), canonical)
        answer = mixture.tok.decode(ids[weights > 1].tolist())
        return mixture.tok.decode(ids.tolist()), answer.strip().rstrip(".")

    canonical_needle, question = needle._PASSKEY_NEEDLES[0], needle._PASSKEY_QUESTIONS[0]
    for seed in range(6):
        text, number = row_text(seed, True)
        assert canonical_needle.format(n=number) in text and question + " " + number + "." in text
    drawn = [row_text(seed, False) for seed in range(12)]
    assert sum(canonical_needle.format(n=n) in t for t, n in drawn) < 12


def test_parse_fill_names_the_bad_value():
    train = import_training("train")
    assert train.parse_fill("0.8:1.0") == (0.8, 1.0)
    for spec, message in (("0.8", "expected LO:HI"), ("a:b", "expected LO:HI"), ("0.9:0.5", "0 < LO <= HI <= 1"),
                          ("0:1", "0 < LO <= HI <= 1"), ("0.5:1.5", "0 < LO <= HI <= 1")):
        with pytest.raises(ValueError, match=message):
            train.parse_fill(spec)


def test_text_weight_scales_the_loss_of_everything_but_the_answers(mixture):
    train = import_training("train")
    args = types.SimpleNamespace(**{**vars(mixture.args), "text_weight": 0.0, "needle_frac": 1.0})
    zeroed = train.DataMixture(args, mixture.tok, mixture.train)
    plain = train.DataMixture(types.SimpleNamespace(**{**vars(args), "text_weight": 1.0}), mixture.tok, mixture.train)
    ids0, _, w0, answer0, _, _ = zeroed.batch(3, 512, 2)
    ids1, _, w1, answer1, _, _ = plain.batch(3, 512, 2)
    assert torch.equal(ids0, ids1) and torch.equal(answer0, answer1) and answer0.any()
    assert torch.equal(w0[answer0], w1[answer1]) and (w0[answer0] > 1).all()
    assert (w0[~answer0] == 0).all() and (w1[~answer1] == 1).all()


def test_steps_from_trains_on_the_batches_of_the_listed_steps_in_order(mixture, tmp_path):
    train = import_training("train")
    args = types.SimpleNamespace(**{**vars(mixture.args), "phases": "512:1.0", "steps": 10,
                                    "tokens_per_step": 1024, "draws": [(None, 7), (99, 2)]})
    batches = train.StepBatches(mixture, args, 0, 3)
    other_seed = train.DataMixture(types.SimpleNamespace(**{**vars(mixture.args), "seed": 99}),
                                   mixture.tok, mixture.train)
    for i, want in enumerate([mixture.batch(7, 512, 2), other_seed.batch(2, 512, 2), mixture.batch(7, 512, 2)]):
        assert all(torch.equal(a, b) for a, b in zip(batches[i], want))
    assert not torch.equal(batches[1][0], mixture.batch(2, 512, 2)[0])   # the pair's seed is used
    parser = train.build_parser()
    good = tmp_path / "hard.json"
    good.write_text("[7, [99, 2]]")
    assert train.read_draws(parser, [str(good)]) == [(None, 7), (99, 2)]
    assert train.read_draws(parser, [f"{good}@5", str(good)]) == [(5, 7), (99, 2), (None, 7), (99, 2)]
    with pytest.raises(SystemExit):
        train.read_draws(parser, [f"{good}@five"])
    for text in ("[]", '{"step": 7}', "[7, -1]", "[[1, 2, 3]]", "[true]", "not json"):
        good.write_text(text)
        with pytest.raises(SystemExit):
            train.read_draws(parser, [str(good)])
