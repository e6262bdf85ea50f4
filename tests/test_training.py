"""training/train.py helpers that the training log relies on."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from kvslim.eval import ruler

from .conftest import import_training

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train():
    return import_training("train")


def test_answer_exact_counts_whole_answers_not_tokens(train):
    answer = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0],
                           [1, 1, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    correct = torch.ones_like(answer)
    correct[0, 2] = False          # one wrong digit spoils the first answer of row 0
    correct[1, 7] = False          # and the last answer of row 1 (it ends the row)
    correct[0, 0] = False          # a miss outside any answer does not count
    # 4 answers: row 0 [1:4] wrong, [5:7] right; row 1 [0:2] right, [6:8] wrong.
    assert train.answer_exact(answer, correct) == pytest.approx(0.5)
    # The per-token figure would read 7/9 for the same predictions.
    assert correct[answer].float().mean().item() == pytest.approx(7 / 9)


def test_answer_exact_splits_answers_at_row_ends(train):
    # Row 0 ends in an answer and row 1 starts with one: two answers, not one.
    answer = torch.tensor([[0, 1], [1, 0]], dtype=torch.bool)
    correct = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    assert train.answer_exact(answer, correct) == pytest.approx(0.5)


def test_answer_exact_without_answers_is_nan(train):
    answer = torch.zeros(2, 4, dtype=torch.bool)
    assert math.isnan(train.answer_exact(answer, torch.ones_like(answer)))


def _ruler(hits_16k: list[list[bool]]) -> dict:
    """kvslim eval ruler's JSON for one f16 pair: niah_multikey answers at 16,384 tokens, one
    haystack per inner list with one key asked per depth, tables from ruler.summary itself."""
    depths = [0.0, 1.0][:len(hits_16k[0])]
    records = [{"task": "niah_multikey", "length": 16384, "sample": i, "depths": [d], "answers": ["12345"],
                "output": "", "hits": [hit]}
               for i, hits in enumerate(hits_16k) for d, hit in zip(depths, hits)]
    return {"depths": depths, "samples": len(hits_16k), "command": "kvslim eval ruler -m MODEL -c 16384",
            "results": [{"type_k": "f16", "type_v": "f16", "tasks": ruler.summary(records, depths),
                         "queries": records}]}


@pytest.fixture(scope="module")
def card():
    return import_training("model_card")


def test_card_judges_multikey_on_answers_found_at_16k(card):
    met = "\n".join(card.ruler_section(_ruler([[True, True], [True, False], [True, True]])))
    assert re.search(r"\| niah_multikey +\| +16384 \| +100% \| +67% \| +83% \|", met)   # ruler.render's table
    assert "80% at 16,384 tokens: met (83.3%, 5 of 6)" in met
    missed = "\n".join(card.ruler_section(_ruler([[True, False], [False, True]])))
    assert "80% at 16,384 tokens: **missed** (50.0%, 2 of 4)" in missed


def test_card_names_a_drill_runs_rows_and_parameters_and_reproduces_into_the_folder(card):
    args = {"train_only": "layers\\.7\\.self_attn\\.q_norm", "canonical": "True",
            "steps_from": "['runs/a.jsonl', 'runs/b.jsonl']"}
    note = card.drill_note(args)
    assert "`layers\\.7\\.self_attn\\.q_norm`" in note and "`runs/a.jsonl`, `runs/b.jsonl`" in note
    assert "--canonical" in note
    assert card.drill_note({"train_only": "None", "steps_from": "None", "canonical": "False"}) == ""
    assert "mined in `runs/steps.json`" in card.drill_note({"steps_from": "runs/steps.json"})  # logs before nargs="+"
    cmd = "--name t --init-from x/last.pt --export-dir /tmp/s/t --eval-every 9"
    assert card.reproduce_cmd(cmd, feeds_next=False) == "--name t --init-from x/last.pt --eval-every 9"
    assert card.reproduce_cmd(cmd, feeds_next=True) == "--name t --init-from x/last.pt --no-export --eval-every 9"
    assert card.reproduce_cmd("--name t --steps 5", feeds_next=True) == "--name t --steps 5"


def test_evaluate_runs_the_ruler_alone_without_loading_the_model(tmp_path, monkeypatch):
    # The ruler runs kvslim in its own process on the exported folder, so a ruler-only
    # evaluation must not spend memory and minutes loading the model in this one.
    evaluate = import_training("evaluate")

    def no_load(args):
        raise AssertionError("load_model called for a ruler-only evaluation")

    asked = []
    monkeypatch.setattr(evaluate, "load_model", no_load)
    monkeypatch.setattr(evaluate, "ruler_eval", lambda args: asked.append(args.ruler) or _ruler([[True]]))
    monkeypatch.setattr(import_training("train"), "ensure_corpus", lambda: ["austen"])
    out = tmp_path / "eval"
    assert evaluate.main(["--skip-ppl", "--skip-needle", "--ruler", "-c 16384 -n 1", "--out", str(out)]) == 0
    assert asked == ["-c 16384 -n 1"]
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["model"].endswith("tiny-qwen35") and "perplexity" not in report and "needle" not in report
    assert report["ruler"]["results"][0]["type_k"] == "f16"
    assert "niah_multikey" in (tmp_path / "eval.md").read_text()


def test_answer_exact_by_kind_scores_each_kind_on_its_own_rows(train):
    answer = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    correct = torch.ones_like(answer)
    correct[0, 2] = False                      # the passkey row's answer is wrong
    kinds = torch.tensor([train.NEEDLE_KINDS.index("passkey"), train.NEEDLE_KINDS.index("magic"), -1,
                          train.NEEDLE_KINDS.index("magic")])
    assert train.answer_exact_by_kind(answer, correct, kinds) == {
        "answer_exact_passkey": 0.0, "answer_exact_magic": 1.0}
    # The mixed figure (1 answer wrong in 3) hides that every pass key was missed.
    assert train.answer_exact(answer, correct) == pytest.approx(2 / 3)


def test_weakest_answer_prob_follows_greedy_path_until_the_first_miss():
    evaluate = import_training("evaluate")
    # vocab of 4; expected answer tokens [1, 2, 3]
    def row(probs):
        return torch.log(torch.tensor([probs]))
    scores = [row([0.1, 0.7, 0.1, 0.1]), row([0.1, 0.1, 0.6, 0.2]), row([0.05, 0.05, 0.1, 0.8])]
    # all right: the smallest of 0.7, 0.6, 0.8
    assert evaluate.weakest_answer_prob(scores, [1, 2, 3], [1, 2, 3]) == pytest.approx(0.6)
    # second token wrong (3 taken): stops there with its probability of the right token
    wrong = [row([0.1, 0.7, 0.1, 0.1]), row([0.1, 0.1, 0.3, 0.5]), row([0.97, 0.01, 0.01, 0.01])]
    assert evaluate.weakest_answer_prob(wrong, [1, 3, 0], [1, 2, 3]) == pytest.approx(0.3)
    # a whole right answer then a run-on digit (tokens 1-3 are digits here): the end of the number
    # had 1 - 0.9 = 0.1
    run_on = scores + [row([0.1, 0.3, 0.3, 0.3])]
    assert evaluate.weakest_answer_prob(run_on, [1, 2, 3, 1], [1, 2, 3], [1, 2, 3]) == pytest.approx(0.1)
    assert evaluate.weakest_answer_prob(run_on, [1, 2, 3, 1], [1, 2, 3]) == pytest.approx(0.6)


def test_probe_swaps_the_pass_key_in_both_needle_mentions_only():
    probe = import_training("probe_passkey")
    from kvslim.eval import needle
    prompt = "In 1812 it rained. The pass key is 48213. Remember it. 48213 is the pass key. Page 148213.\n\nWhat is the pass key? The pass key is"
    sample = needle.NeedleSample(prompt=prompt, answer=" 48213", kind="passkey", depth=0.5,
                                 needle="", needle_offset=0, question="")
    new_prompt, answer = probe.with_number(sample, "70707")
    assert answer == " 70707"
    assert new_prompt.count("70707") == 2 and "148213" in new_prompt and "1812" in new_prompt
    clash = needle.NeedleSample(prompt=prompt + " 48213", answer=" 48213", kind="passkey", depth=0.5,
                                needle="", needle_offset=0, question="")
    with pytest.raises(ValueError, match="not exactly the needle's two mentions"):
        probe.with_number(clash, "70707")
    assert probe.parse_samples("16384:0.2:3,4096:1:0") == [(16384, 0.2, 3), (4096, 1.0, 0)]
    with pytest.raises(SystemExit, match="LENGTH:DEPTH:INDEX"):
        probe.parse_samples("16384:0.2")


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch):
    train = import_training("train")
    for flags, want in (("fpu sse avx512f avx512_vnni", False), ("fpu avx512f avx512_bf16", True),
                        ("fpu amx_tile amx_bf16", True), (None, None)):
        monkeypatch.setattr(train, "_cpuinfo", lambda field, flags=flags: flags if field == "flags" else None)
        assert train.cpu_has_native_bf16() is want


def tiny_model(train):
    """A 4-layer qwen3_5 model of train.py's builder (layer 3 attention, head_dim 32)."""
    return train.build_model(train.build_parser().parse_args(
        ["--hidden", "64", "--layers", "4", "--intermediate", "128", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "32", "--lin-head-dim", "16"]))


def test_train_only_freezes_all_but_the_matched_parameters_and_the_optimizer_skips_them(train):
    import argparse
    model = tiny_model(train)
    kept = train.freeze_except(model, r"layers\.3\.self_attn\.[qk]_norm")
    assert kept == 2 * 32
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight"}
    opt = train.make_optimizer(model, argparse.Namespace(weight_decay=0.1, lr=1e-3))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == kept
    with pytest.raises(SystemExit, match="matches no parameter"):
        train.freeze_except(model, r"no_such_layer")
    with pytest.raises(SystemExit, match="not a regular expression"):
        train.freeze_except(model, r"layers\.(3")


def test_probe_q_scale_multiplies_only_the_named_query_dims_of_an_attention_layer():
    train, probe = import_training("train"), import_training("probe_passkey")
    model = tiny_model(train)
    with torch.no_grad():
        model.model.layers[3].self_attn.q_norm.weight.normal_(0, 0.1)
    x = torch.randn(5, 32)
    norm = model.model.layers[3].self_attn.q_norm
    before = norm(x).detach()
    probe.scale_queries(model, "3n=1.5")           # 32 dims, a quarter rotary: dims 8.. scaled
    after = norm(x).detach()
    assert torch.allclose(after[:, :8], before[:, :8]) and torch.allclose(after[:, 8:], 1.5 * before[:, 8:], rtol=1e-5)
    probe.scale_queries(model, "3r=2")
    assert torch.allclose(norm(x).detach()[:, :8], 2 * before[:, :8], rtol=1e-5)
    for bad in ("0=1.5", "9=1.5", "3x=1.5", "3=fast"):
        with pytest.raises(SystemExit, match="--q-scale"):
            probe.scale_queries(model, bad)


def test_steps_from_a_mine_file_picks_its_hard_rows_each_with_an_easy_one(train, tmp_path):
    # the committed mining run and the step list that tiny-qwen35-temp3 trained on
    mine = ROOT / "training" / "runs" / "tiny-qwen35-pkmine" / "mine.jsonl"
    want = json.loads((mine.parent / "steps.json").read_text())
    records = [json.loads(line) for line in mine.read_text().splitlines()]
    assert train.hard_rows(records) == want
    hard = {r["step"] for r in records if r["answer_exact"] < 1 or r["answer_loss_max"] > 0.3}
    assert set(want[0::2]) == hard and not hard & set(want[1::2])
    assert train.read_draws(train.build_parser(), [str(mine)]) == [(None, s) for s in want]
    assert train.read_draws(train.build_parser(), [f"{mine}@2041"]) == [(2041, s) for s in want]
    seeded = tmp_path / "seeded.jsonl"      # rows mined since they carry their seed
    seeded.write_text("".join(json.dumps({**r, "seed": 7}) + "\n" for r in records))
    assert train.read_draws(train.build_parser(), [str(seeded)]) == [(7, s) for s in want]
    # a --mine file records the options its rows were drawn with; a run drawing other rows is refused
    parser = train.build_parser()
    mined_with = parser.parse_args(["--fill", "0.9:1.0", "--canonical", "--phases", "16384:1.0"])
    header = {"event": "mine", "seed": 7, "options": train.row_options(mined_with)}
    seeded.write_text(json.dumps(header) + "\n" + "".join(json.dumps({**r, "seed": 7}) + "\n" for r in records))
    assert train.read_draws(parser, [str(seeded)], mined_with) == [(7, s) for s in want]
    for other in (["--fill", "0.5:1.0", "--canonical", "--phases", "16384:1.0"], ["--fill", "0.9:1.0", "--phases", "16384:1.0"]):
        with pytest.raises(SystemExit):
            train.read_draws(parser, [str(seeded)], parser.parse_args(other))
    # the same values written another way draw the same rows: accepted
    same = parser.parse_args(["--fill", "0.9:1", "--canonical", "--phases", "16384:2"])
    assert train.read_draws(parser, [str(seeded)], same) == [(7, s) for s in want]
    empty = tmp_path / "easy.jsonl"
    empty.write_text(json.dumps({"step": 0, "answer_exact": 1.0, "answer_loss_max": 0.01}) + "\n")
    with pytest.raises(SystemExit):
        train.read_draws(train.build_parser(), [str(empty)])      # no hard rows: nothing to train on
