"""The sampler's fast path (a shortlist per row on the logits' device, the rest on the host)
against the chain written over the whole vocabulary (``distribution_reference``)."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvslim.engine.sampling import Sampler, SamplingParams, distribution_reference, sample_rows

V = 3000


def peaked_logits(seed: int, rows: int = 1) -> torch.Tensor:
    """Logits shaped like a language model's: a few likely tokens over a long flat tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 2
    x[:, torch.randint(0, V, (rows, 12), generator=g)] += torch.rand(rows, 12, generator=g) * 12
    return x


class AllowEvery(object):
    """A constraint allowing every ``step``-th token (and counting what it accepted)."""

    def __init__(self, step: int):
        self.step, self.accepted = step, []

    def allowed(self, n_vocab):
        keep = torch.zeros(n_vocab, dtype=torch.bool)
        keep[::self.step] = True
        return keep

    def accept(self, token):
        self.accepted.append(token)


GRID = [dict(temperature=t, top_k=k, top_p=p, min_p=m)
        for t, k, p, m in itertools.product((0.0, 0.7, 1.5), (0, 1, 7, 40), (1.0, 0.9, 0.5), (0.0, 0.05, 0.3))]


@pytest.mark.parametrize("knobs", GRID, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_distribution_equals_the_reference(knobs):
    history = [5, 17, 17, 300, 2999]
    for seed, extra in enumerate([{}, dict(repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)]):
        logits = peaked_logits(seed)[0]
        s = Sampler(SamplingParams(**knobs, **extra), banned=[int(logits.argmax())])
        fast, ref = s.distribution(logits, history), distribution_reference(s, logits, history)
        assert torch.allclose(fast, ref, atol=1e-6), float((fast - ref).abs().max())
        assert (fast > 0).sum() == (ref > 0).sum()                         # the same support
        assert abs(float(fast.sum()) - 1) < 1e-5


def test_a_constraint_and_penalties_shape_the_distribution_as_the_reference():
    logits = peaked_logits(3)[0]
    s = Sampler(SamplingParams(top_k=0, top_p=0.95, min_p=0.0, repeat_penalty=1.5), AllowEvery(3))
    fast, ref = s.distribution(logits, [0, 3, 6]), distribution_reference(s, logits, [0, 3, 6])
    assert torch.allclose(fast, ref, atol=1e-6)
    assert fast[1::3].sum() == 0 and fast[2::3].sum() == 0


def test_a_batch_samples_each_row_as_alone():
    """Mixed rows in one call (greedy, top-k, top-k off, logprobs, a constraint, penalties) draw
    the same tokens as each sampler called on its own row with the same seed."""
    logits = peaked_logits(7, rows=6)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3, top_p=1.0, min_p=0.0, temperature=1.5, seed=1),
              SamplingParams(top_k=0, seed=2),
              SamplingParams(top_k=0, min_p=0.0, top_p=0.8, seed=3), SamplingParams(logprobs=3, seed=4),
              SamplingParams(repeat_penalty=1.2, top_k=100, seed=5)]
    histories = [[], [1, 2], [], [9], [4], list(logits[5].topk(5).indices.tolist())]

    def samplers():
        out = [Sampler(p) for p in params]
        out[2].constraint = AllowEvery(2)
        return out

    together, alone = samplers(), samplers()
    for _ in range(20):
        batch = sample_rows(together, logits, histories)
        assert batch == [s(logits[i], histories[i]) for i, s in enumerate(alone)]
        assert all(t % 2 == 0 for t in together[2].constraint.accepted)
        assert batch[1] in logits[1].topk(3).indices.tolist()             # its own k, not the batch's largest
    assert together[0].params.greedy and batch[0] == int(logits[0].argmax())


def test_logprobs_are_the_models_log_softmax():
    logits = peaked_logits(11)[0]
    s = Sampler(SamplingParams(logprobs=4, seed=0, temperature=1.0))
    token = s(logits)
    lp = torch.log_softmax(logits, -1)
    (got, value, top), = s.logprobs
    assert got == token and abs(value - float(lp[token])) < 1e-5
    assert [i for i, _ in top] == lp.topk(4).indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in top]), lp.topk(4).values, atol=1e-5)


def test_draws_follow_the_truncated_distribution():
    logits = peaked_logits(5)[0]
    s = Sampler(SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.01, seed=9))
    ref = distribution_reference(s, logits)
    draws = torch.tensor([s(logits) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=V).float() / len(draws)
    assert (freq[ref == 0] == 0).all()                                     # never outside the support
    assert torch.allclose(freq, ref, atol=0.03)


def test_a_bad_row_fails_alone_with_a_clear_error():
    logits = peaked_logits(2, rows=3)
    logits[1, 40] = float("nan")
    samplers = [Sampler(SamplingParams(seed=0)) for _ in range(3)]
    samplers[2].constraint = AllowEvery(V + 1)                             # allows token 0 only ...
    samplers[2].banned = [0]                                               # ... which is banned
    tokens = sample_rows(samplers, logits, [[], [], []])
    assert isinstance(tokens[0], int)
    assert isinstance(tokens[1], ValueError) and "NaN or infinite" in str(tokens[1])
    assert isinstance(tokens[2], ValueError) and "exclude every token" in str(tokens[2])
    with pytest.raises(ValueError, match="NaN or infinite"):
        Sampler(SamplingParams(temperature=0))(logits[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_sample_as_on_the_cpu():
    """The shortlists made on the GPU give the CPU's distributions and, seeded, its tokens."""
    logits = peaked_logits(13, rows=4)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, repeat_penalty=1.2),
              SamplingParams(top_k=0, seed=2, logprobs=2), SamplingParams(top_k=0, min_p=0.0, top_p=0.9, seed=3)]
    histories = [[1], [2, 2, 3], [], [4]]
    on_cpu, on_gpu = [Sampler(p) for p in params], [Sampler(p) for p in params]
    for _ in range(10):
        assert sample_rows(on_gpu, logits.cuda(), histories) == sample_rows(on_cpu, logits, histories)
    for i, s in enumerate(on_cpu):
        assert torch.allclose(s.distribution(logits[i].cuda(), histories[i]),
                              distribution_reference(s, logits[i], histories[i]), atol=1e-5)
