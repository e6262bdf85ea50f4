"""kvslim eval ruler: each task generator's samples are exact, determined and at their depth; the CLI runs."""
from __future__ import annotations

import collections
import json
import re

import pytest
import torch

import kvslim
from kvslim.cli import main as cli_main
from kvslim.eval import ruler as R
from kvslim.eval.haystack import TokenSpace
from kvslim.loading import BUNDLED
from kvslim.tokenizer import Tokenizer
from kvslim.tools.eval import read_documents

LENGTHS = (1024, 4096)
DEPTHS = (0.0, 0.3, 0.7, 1.0)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder(BUNDLED)


@pytest.fixture(scope="module")
def builder(tok):
    space = TokenSpace(lambda t: tok.encode(t, False), tok.decode, tok.vocab_size)
    stream = []
    for doc in read_documents([]):
        stream += tok.encode(doc, False) + [space.blank_line]
    return R.RulerBuilder(space, stream, tok.decode)


@pytest.fixture(scope="module")
def queries(builder):
    return builder.build(R.TASKS, LENGTHS, DEPTHS, samples=2, seed=7)


def by_task(queries, task):
    found = [q for q in queries if q.task == task]
    assert found, f"no {task} queries"
    return found


def test_every_task_fills_its_length_exactly_and_leaves_room_for_the_answer(queries, builder):
    assert {q.task for q in queries} == set(R.TASKS)
    for q in queries:
        assert len(q.prompt) + q.max_tokens == q.length
        need = sum(len(builder.space.encode(" " + a)) for a in q.answers)
        assert q.max_tokens > need, (q.task, q.max_tokens, need)
    counts = collections.Counter((q.task, q.length) for q in queries)
    assert counts["niah_single", 1024] == counts["niah_multikey", 4096] == counts["kv_retrieval", 4096] == 8
    assert counts["vt", 1024] == counts["cwe", 4096] == counts["niah_multiquery", 1024] == 2


def test_answers_are_determined_and_distractors_do_not_collide(queries, tok):
    for q in queries:
        text = tok.decode(q.prompt)
        if q.task in ("vt", "cwe"):
            continue
        told = 2 if q.task == "niah_single" else 1          # the pass-key needle states its key twice
        numbers = collections.Counter(re.findall(r"\d{5,}", text))
        assert set(numbers.values()) == {told}, f"{q.task}: a number occurs twice"   # the filler has none
        for answer in q.answers:
            assert numbers[answer] == told
        if q.single and q.task != "niah_single":
            key = re.search(r"for (\S+)\? ", text[-200:]).group(1)
            haystack = text[:text.rindex("\n\n")]
            assert len(re.findall(rf"for {re.escape(key)} is", haystack)) == 1, "the asked key is not unique"
        assert not re.search(r"\d\.(One of|The special|The pass)", text), "two needles glued together"


def test_each_needle_sits_at_its_depth(queries, tok):
    for q in (q for q in queries if q.task not in ("vt", "cwe")):
        body = len(q.prompt) - len(tok.encode(tok.decode(q.prompt).rsplit("\n\n", 1)[1], False))
        for answer, depth, pos in zip(q.answers, q.depths, q.positions):
            assert answer in tok.decode(q.prompt[pos:pos + 24]), (q.task, answer)
            # the needle goes after the last sentence end before its depth (held-out prose: one every
            # few dozen tokens); earlier needles of the same haystack push it back a little
            assert depth * body - 0.04 * q.length - 80 <= pos <= depth * body + 0.04 * q.length, (q.task, depth)
    for q in by_task(queries, "niah_multiquery"):
        assert sorted(q.depths) == sorted(DEPTHS)


def test_multi_needle_tasks_share_one_haystack(queries):
    """multikey, multivalue and multiquery of one (length, sample) differ only in the question."""
    for length in LENGTHS:
        group = [q for q in queries if q.task.startswith("niah_multi") and q.length == length and q.sample == 0]
        n = min(len(q.prompt) for q in group)
        heads = {tuple(q.prompt[:n - 60]) for q in group}
        assert len(group) == len(DEPTHS) + 2 and len(heads) == 1


def test_variable_tracking_chain_is_in_order_and_resolves_to_the_asked_value(queries, tok):
    for q in by_task(queries, "vt"):
        text = tok.decode(q.prompt)
        value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
        first, *rest = q.answers
        assert f"VAR {first} = {value}." in text
        for a, b in zip(q.answers, rest):
            assert text.index(f"VAR {b} = VAR {a}.") > text.index(f"VAR {a} =")
        assert q.positions == sorted(q.positions) and len(set(q.answers)) == R.VT_HOPS + 1
        others = re.findall(r"VAR ([A-Z]{5}) = ", text)
        assert len(others) == 2 * (R.VT_HOPS + 1) and len(set(others)) == len(others)


def test_common_words_are_the_most_frequent_by_a_wide_margin(queries, tok):
    for q in by_task(queries, "cwe"):
        items = re.findall(r"\d+\. ([a-z]+)", tok.decode(q.prompt))
        counts = collections.Counter(items)
        top = [w for w, _ in counts.most_common(R.CWE_COMMON)]
        assert sorted(top) == sorted(q.answers)
        others = max(c for w, c in counts.items() if w not in q.answers)
        assert min(counts[a] for a in q.answers) >= 3 * others


def test_scoring_needs_whole_numbers_and_names_in_any_order():
    single = R.Query("niah_single", 64, 0, [1], ["12345"], [0.5], [0], 4, True)
    assert R.score_output(single, " 12345.") == [True]
    assert R.score_output(single, " 123456") == [False] and R.score_output(single, " 1234") == [False]
    multi = R.Query("niah_multivalue", 64, 0, [1], ["11111", "22222"], [0.0, 1.0], [0, 9], 9)
    assert R.score_output(multi, " 22222, 11111") == [True, True]
    assert R.score_output(multi, " 222221, 11111") == [True, False]
    vt = R.Query("vt", 64, 0, [1], ["ABCDE", "FGHIJ"], [None, None], [0, 5], 9)
    assert R.score_output(vt, " VAR ABCDE VAR XFGHIJ") == [True, False]


def test_bad_task_names_and_depths_are_refused(builder):
    with pytest.raises(ValueError, match="unknown ruler task"):
        R.check_tasks(["niah_single", "needles"])
    with pytest.raises(ValueError, match=r"depths must lie in \[0, 1\]"):
        builder.build(["niah_single"], [1024], [1.5], 1)
    with pytest.raises(ValueError, match="cannot hold"):
        builder.build(["kv_retrieval"], [64], [0.5], 1)


def test_prefix_reuse_in_token_order_gives_the_answers_of_fresh_prompts(builder):
    torch.set_num_threads(1)
    qs = builder.build(["niah_single", "niah_multikey"], [384], [0.0, 1.0], 1)
    fresh = kvslim.load(ctx=392, dtype="f32")
    reuse = kvslim.load(ctx=392, dtype="f32", prefix_cache=True, checkpoint_interval=128, n_ubatch=128,
                        max_checkpoints=8)
    assert [r["output"] for r in R.run(reuse, qs)] == [r["output"] for r in R.run(fresh, qs)]


def test_cli_runs_every_task_at_1k_and_writes_json_and_heatmaps(capsys, tmp_path):
    png = tmp_path / "ruler.png"
    code = cli_main(["eval", "ruler", "-c", "1024", "--depths", "0.5", "-n", "1", "--pairs", "f16",
                     "--png", str(png), "-o", "json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and png.stat().st_size > 10_000
    report = json.loads(out)
    tasks = report["results"][0]["tasks"]
    assert set(tasks) == set(R.TASKS) and report["lengths"] == [1024]
    assert all(0.0 <= g["overall"] <= 1.0 for g in tasks.values())
    assert tasks["niah_single"]["overall"] == 1.0     # the bundled model retrieves a pass key at 1K
