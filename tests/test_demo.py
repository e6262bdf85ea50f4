"""``kvslim demo``: its generation is streamed, its progress goes to stderr, and its table holds the
medians of the timed runs it reports (run in its small form: a 256-token prompt)."""
from __future__ import annotations

import io
import re
import statistics
import sys

import pytest

from kvslim import cli
from kvslim.tools.demo import OPENING


class Writes(io.StringIO):
    """stdout that remembers each write, to tell a streamed generation from one printed whole."""

    def __init__(self):
        super().__init__()
        self.chunks: list[str] = []

    def write(self, text: str) -> int:
        self.chunks.append(text)
        return super().write(text)


@pytest.fixture
def threads():
    """-t sets torch's threads for the process: put them back for the tests that follow."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_demo(monkeypatch, capsys, *flags: str) -> tuple[Writes, str]:
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["demo", "-c", "256", *flags]) == 0
    return out, capsys.readouterr().err


def test_generation_streams_and_the_table_holds_medians(monkeypatch, capsys, threads):
    # -t 1: on a busy machine two threads wait on each other at every small op (see the demo's help)
    out, err = run_demo(monkeypatch, capsys, "-n", "12", "-r", "3", "-t", "1")
    assert "1 threads)" in err
    assert out.chunks[0] == OPENING
    generation = out.chunks[1:out.chunks.index("\n")]   # print("\n") ends it
    assert len(generation) >= 6, f"the generation came in {len(generation)} writes, not streamed"
    assert "[demo] loading" in err and "[demo] generating 12 tokens" in err
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.getvalue().splitlines()
             if line.startswith("| ")]
    table = {row[0]: row for row in cells}
    for pair in ("f16/f16", "q8_0/turbo4"):
        assert f"[demo] {pair} warm-up" in err
        runs = re.findall(rf"\[demo\] {pair} run \d/3: prompt \d+ tok (\d+) tok/s, gen \d+ tok ([\d.]+) tok/s", err)
        assert len(runs) == 3
        row = table[pair]
        assert row[2] == "yes", f"{pair} missed the pass key: {row}"
        assert float(row[4]) == statistics.median(int(p) for p, _ in runs)
        assert float(row[5]) == pytest.approx(statistics.median(float(g) for _, g in runs), abs=0.051)
    assert "median of 3 run(s) per pair after a 256-token warm-up" in out.getvalue()


def test_bad_threads_are_refused(capsys):
    assert cli.main(["demo", "-t", "0"]) == 2
    assert "-t must be at least 1" in capsys.readouterr().err
