"""training/train.py helpers that the training log relies on."""
from __future__ import annotations

import math

import pytest
import torch

from .conftest import import_training


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
    """A ruler JSON of one f16 pair with niah_multikey queries at 16,384 tokens (as kvslim eval ruler writes it)."""
    queries = [{"task": "niah_multikey", "length": 16384, "hits": h} for h in hits_16k]
    flat = [x for h in hits_16k for x in h]
    tasks = {"niah_multikey": {"lengths": [16384], "depths": [0.0, 1.0], "score": [[0.0, 0.0]],
                               "overall": sum(flat) / len(flat), "items": len(flat)}}
    return {"depths": [0.0, 1.0], "samples": len(hits_16k), "command": "kvslim eval ruler -m MODEL -c 16384",
            "results": [{"type_k": "f16", "type_v": "f16", "tasks": tasks, "queries": queries}]}


@pytest.fixture(scope="module")
def card():
    return import_training("model_card")


def test_card_judges_multikey_on_answers_found_at_16k(card):
    met = "\n".join(card.ruler_section(_ruler([[True, True], [True, False], [True, True]])))
    assert "| f16/f16 | niah_multikey | 16384 | **0.833** | 6 |" in met
    assert "80% at 16,384 tokens: met (83.3%)" in met
    missed = "\n".join(card.ruler_section(_ruler([[True, False], [False, True]])))
    assert "80% at 16,384 tokens: **missed** (50.0%)" in missed
