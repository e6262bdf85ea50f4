"""Every command in the README's ``sh`` blocks runs, so the README cannot drift from the code.

The README's sizes (4,096-token contexts, 20,000 vectors, depth 16,384) take minutes; here each
command runs with its sizes rewritten small (``SMOKE``), in a scratch folder holding the files
the README assumes (``model.gguf``, ``prompt.txt``). ``make demo`` and ``make test`` are checked
as Makefile targets, and the demo they start runs here in its small form.
"""
from __future__ import annotations

import io
import os
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from kvslim import cli
from kvslim.loading import BUNDLED

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

def first(n: int):
    """A comma list cut to its first ``n`` items (every name is still parsed by the README's command)."""
    return lambda value: ",".join(value.split(",")[:n])


# tool (or "eval ppl" etc.) -> flag -> small value (None: a switch; a function: of the README's value),
# set whether or not the README gives the flag
SMOKE = {
    "demo": {"-c": "256", "-n": "4", "-r": "1", "-t": "1"},     # -t 1: two threads crawl on a busy machine
    "run": {"-n": "4"},
    "bench": {"-p": "16", "-n": "4", "-d": "0,32", "-r": "1", "-ctk": first(1), "--no-progress": None},
    "quant": {"--n": "256", "-r": "1", "-t": first(2), "--no-progress": None},
    "eval": {"-c": "32", "--chunks": "1", "--pairs": first(2), "-ctk": first(1), "--no-progress": None},
    "eval niah": {"-c": "128", "--lengths": "128", "--depths": "0.5", "-n": "1"},
    "eval ruler": {"-c": "512", "--depths": "0.5", "-n": "1", "--tasks": "niah_single,vt"},
    "eval depth": {"--bands": "0,16"},
    "eval attention": {"--sentences": "2"},
    "serve": {"-np": "1", "-c": "4096"},
}


def sh_commands() -> list[str]:
    """Each line of every ```sh block, comments dropped."""
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    lines = [shlex.join(shlex.split(line, comments=True)) for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def smoke(argv: list[str]) -> list[str]:
    """``argv`` (after 'kvslim') with the SMOKE sizes of its tool and sub-command."""
    keys = [argv[0]] + ([f"{argv[0]} {argv[1]}"] if len(argv) > 1 else [])
    out = list(argv)
    for key in keys:
        for flag, value in SMOKE.get(key, {}).items():
            given = None
            if flag in out:
                i = out.index(flag)
                given = out[i + 1] if value is not None else None
                del out[i:i + (1 if value is None else 2)]
            if callable(value):
                out += [flag, value(given)] if given is not None else []
            else:
                out += [flag] if value is None else [flag, value]
    return out


COMMANDS = sh_commands()
KVSLIM = [c for c in COMMANDS if c.startswith("kvslim ") and not c.startswith("kvslim serve")]


def test_readme_has_the_commands_this_test_expects():
    tools = {shlex.split(c)[1] for c in COMMANDS if c.startswith("kvslim ")}
    assert {"run", "serve", "eval", "plan", "bench", "quant"} <= tools
    assert {"make demo", "make test"} <= set(COMMANDS)
    assert not [c for c in COMMANDS if not c.startswith(("kvslim ", "make "))], "a sh line this test cannot run"


def test_quick_start_targets_exist_and_the_demo_runs(capsys):
    makefile = (ROOT / "Makefile").read_text()
    for line in (c for c in COMMANDS if c.startswith("make ")):
        target = line.split()[1]
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe, f"Makefile has no target {target!r}"
    assert "kvslim demo" in re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert "pytest" in re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)[1]
    threads = torch.get_num_threads()
    try:
        code = cli.main(smoke(["demo"]))
    finally:
        torch.set_num_threads(threads)                                # -t 1 is process-wide
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("It is a truth universally acknowledged") and "| q8_0/turbo4 |" in out
    assert "[demo] f16/f16 run 1/1: prompt" in err and "median of 1 run(s)" in out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder with what the README's commands assume: model.gguf and prompt.txt."""
    from kvslim.loading import convert_hf_to_gguf

    folder = tmp_path_factory.mktemp("readme")
    convert_hf_to_gguf(BUNDLED, folder / "model.gguf")
    (folder / "prompt.txt").write_text("It is a truth universally acknowledged, that", encoding="utf-8")
    return folder


def producer(line: str) -> tuple[str, str] | None:
    """(the README line that writes the file ``line`` reads, that file): ``--kl-divergence`` scores
    against the ``--kl-divergence-base`` file that the same command without it saves."""
    argv = shlex.split(line)
    if "--kl-divergence" not in argv:
        return None
    base = argv[argv.index("--kl-divergence-base") + 1]
    return next(c for c in KVSLIM if "--kl-divergence" not in shlex.split(c)
                and f"--kl-divergence-base {base}" in c), base


def run_readme_line(line: str, capsys) -> None:
    argv = smoke(shlex.split(line)[1:])
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"kvslim {shlex.join(argv)} failed: {err[-2000:]}"
    assert out.strip() and "error" not in err.lower()


@pytest.mark.parametrize("line", KVSLIM)
def test_readme_command_runs(line, scratch, capsys, monkeypatch):
    """Each line alone (in any order, or on its own test worker): a line that reads another's
    file runs that one first when the file is not there yet."""
    monkeypatch.chdir(scratch)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n/exit\n"))      # what -cnv reads: one turn
    needs = producer(line)
    if needs is not None and not (scratch / needs[1]).exists():
        run_readme_line(needs[0], capsys)
    run_readme_line(line, capsys)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("line", [c for c in COMMANDS if c.startswith("kvslim serve")])
def test_readme_serve_answers_the_readme_client(line, tmp_path):
    from openai import OpenAI

    port = free_port()
    argv = smoke(shlex.split(line)[1:])
    argv[argv.index("--port") + 1] = str(port)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "kvslim", *argv], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(port, server)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        r = client.chat.completions.create(model="tiny-qwen35", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=4)
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"kvslim serve exited: {server.stdout.read()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail("kvslim serve did not become healthy")


def test_snippets_run_from_the_folder_holding_the_clone(tmp_path):
    """``cd .. && kvslim/.venv/bin/python -c "import kvslim; kvslim.load"`` imports the package.

    From there the clone itself (a folder named kvslim, no ``__init__.py``) is on sys.path as
    the working directory. setuptools' default editable install for a flat layout is an import
    hook consulted after sys.path, so the clone won as an empty namespace package; the
    ``package-dir`` in pyproject.toml makes the install a path entry, where a regular package
    beats a namespace folder. A fresh venv gets a real editable install (no dependencies: it
    sees this interpreter's packages through a path entry, whose .pth files are not run).
    """
    pytest.importorskip("setuptools", minversion="77", reason="the [test] extra installs setuptools>=77")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-e", ROOT], check=True, capture_output=True)
    (tmp_path / "kvslim").symlink_to(ROOT)   # the clone, as seen from the folder holding it
    probe = "import kvslim; print(kvslim.__file__, callable(kvslim.load))"
    r = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ROOT / "kvslim" / "__init__.py"), "True"]
