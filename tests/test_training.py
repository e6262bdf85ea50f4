"""training/train.py helpers that the training log relies on."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train():
    sys.path.insert(0, str(ROOT / "training"))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT / "training"))
    return train


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
