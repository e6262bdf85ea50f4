"""The measured K/V ranking the planner recommends from (kvslim/plan/quality.py)."""
from kvslim import formats
from kvslim.plan import quality


def test_measured_pairs_are_table_formats():
    assert quality.MEASURED_KLD, "no measurements recorded"
    for k, v in quality.MEASURED_KLD:
        formats.get(k), formats.get(v)                      # unknown names raise
        assert quality.MEASURED_KLD[(k, v)] > 0


def test_ladder_is_the_best_at_each_budget():
    rows = quality.ladder()
    bits = [b for _, b, _ in rows]
    klds = [k for _, _, k in rows]
    assert bits == sorted(bits, reverse=True) and klds == sorted(klds)
    for pair, b, kld in rows:
        assert quality.best_at(b) == pair                   # nothing at most as wide measures better
        assert all(k >= kld for p, k in quality.MEASURED_KLD.items() if quality.pair_bits(p) <= b)


def test_best_at_respects_the_budget():
    assert quality.best_at(1.0) is None
    pair = quality.best_at(4.25)
    assert pair is not None and quality.pair_bits(pair) <= 4.25
