"""benchmarks/gpu_session.sh, what a lent GPU runs, checked here before a lease spends device time.

A lease is 15 minutes, the machine's start included, and comes rarely. A flag typo in one of its
commands, or a CUDA test that its pytest selection leaves out, costs a step of it, found only
in the output that comes back. So the lease's phases run here with ``$PY`` a recorder: each
command is written down, not run, and each one's arguments are then parsed by the script it
names (``parse`` of benchmarks/gpu_decode.py and gpu_model.py, which check their values too).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bench import _benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
# what the next lease calls (`followup`, then `second`: the tests it cut short and the launch
# switches' A/B), and session 41's `rerun`
PHASES = ("followup", "second", "rerun")

RECORDER = """import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items()
                                                      if k.startswith("KVSLIM_")}}) + "\\n")
"""


def _script_list(name: str) -> list[str]:
    """A test-file list the script holds in a shell variable (KERNEL_TESTS, MODEL_TESTS)."""
    match = re.search(rf'^{name}="([^"]*)"', SCRIPT.read_text(), re.M)
    assert match, f"{name} is not set in {SCRIPT.name}"
    return match.group(1).split()


def recorded(phase: str, tmp_path: Path) -> list[dict]:
    """The commands ``gpu_session.sh <phase>`` runs through $PY, in order, none of them run."""
    stubs, out = tmp_path / "bin", tmp_path / "out"
    stubs.mkdir()
    out.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'name, memory.total [MiB], driver_version'\n")
    (stubs / "nvidia-smi").chmod(0o755)
    (tmp_path / "recorder.py").write_text(RECORDER)
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "OUT": str(out), "RECORD": str(record), "PATH": f"{stubs}:{os.environ['PATH']}",
           "PY": f"{sys.executable} {tmp_path / 'recorder.py'}"}
    env.pop("KVSLIM_DECODE_TUNED", None)
    done = subprocess.run(["bash", str(SCRIPT), phase], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in record.read_text().splitlines()]


@pytest.fixture(scope="module")
def calls(tmp_path_factory) -> dict[str, list[dict]]:
    return {phase: recorded(phase, tmp_path_factory.mktemp(phase)) for phase in PHASES}


def test_the_lease_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("phase", PHASES)
def test_every_benchmark_a_lease_runs_takes_its_arguments(phase, calls):
    """Each benchmarks/*.py command of the phase parses and checks its flags and values as the
    script would on the device (formats, numbers, the flags that go together)."""
    benches = [c["argv"] for c in calls[phase] if c["argv"] and c["argv"][0].startswith("benchmarks/")]
    assert benches, calls[phase]
    for argv in benches:
        module = _benchmark(Path(argv[0]).stem)
        assert hasattr(module, "parse"), f"{argv[0]} has no parse(argv) to check a lease's command with"
        try:
            module.parse(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"{' '.join(argv)}: exits {exc.code} on its arguments")
    if phase == "followup":                              # the sweep's file serves the model after it
        assert any("--tuned-out" in argv for argv in benches)
        models = [c for c in calls[phase] if c["argv"][:1] == ["benchmarks/gpu_model.py"]]
        assert models and all(c["env"].get("KVSLIM_DECODE_TUNED") == "0" for c in models), models


def test_a_leases_pytest_keeps_every_test_that_waits_for_cuda(calls, tmp_path):
    """The phases' pytest with the kernels on selects its tests by name (-k "cuda or fla or h100")
    from two lists of files. A test that skips without CUDA but whose name lacks those words, or a
    file with such tests left off the lists, would never run on a GPU. Each selection the phases
    make is collected once, with a plugin that lists what skips for want of CUDA and what -k
    deselects."""
    listed = set(_script_list("KERNEL_TESTS") + _script_list("MODEL_TESTS"))
    waiting = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
               if "torch.cuda.is_available()" in p.read_text() and p.name != Path(__file__).name}
    assert waiting - listed == set(), "test files with CUDA tests that no lease runs"
    runs = [c["argv"] for phase in PHASES for c in calls[phase]
            if c["argv"][:2] == ["-m", "pytest"] and c["env"].get("KVSLIM_TRITON") == "1"]
    assert len(runs) >= len(PHASES), runs
    selections = set()
    for argv in runs:
        files = tuple(sorted(a for a in argv if a.startswith("tests/")))     # (one selection, in any order)
        assert files and all((ROOT / f).is_file() for f in files), argv
        assert set(files) == listed, argv
        selections.add((files, argv[argv.index("-k") + 1]))
    for files, expr in sorted(selections):
        report = tmp_path / "report.json"
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                               "--co", "-p", "tests.lease_selection", *files, "-k", expr], cwd=ROOT,
                              env={**os.environ, "LEASE_REPORT": str(report), "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        found = json.loads(report.read_text())
        assert len(found["waiting"]) > 500, found       # the plugin saw the skips (809 when written)
        assert found["waiting_deselected"] == [], f"-k {expr!r} leaves out CUDA tests"


def test_the_check_fails_on_a_flag_the_script_does_not_take(tmp_path, monkeypatch):
    """The recorder and parse together catch a typo: a copy of the script with one flag misspelt."""
    copy = tmp_path / "benchmarks" / "gpu_session.sh"
    copy.parent.mkdir()
    text = SCRIPT.read_text()
    assert "--profile 4" in text
    copy.write_text(text.replace("--profile 4", "--profiles 4"))
    monkeypatch.setattr(sys.modules[__name__], "SCRIPT", copy)     # (it runs from tmp_path: nothing there is run)
    calls = recorded("followup", tmp_path)
    argv = next(c["argv"] for c in calls if "--profiles" in c["argv"])
    with pytest.raises(SystemExit):
        _benchmark(Path(argv[0]).stem).parse(argv[1:])
