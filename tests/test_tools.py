"""What a newcomer hits first in the tools (issue 20): default text, context limits, flag names in
errors, Ctrl-C, and a run that stops because its context filled."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvslim import cli
from kvslim.data import DOC_SEPARATOR, HELDOUT_FILES
from kvslim.tools import eval as eval_tool
from kvslim.tools.common import context_warnings
from kvslim.tools.conversation import converse

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----- eval's default text ships with the package ----------------------------------------------------
def test_eval_reads_the_shipped_heldout_text_without_f():
    docs = eval_tool.read_documents([])
    shipped = [d for f in HELDOUT_FILES for d in f.read_text(encoding="utf-8").split(DOC_SEPARATOR) if d.strip()]
    assert [f.name for f in HELDOUT_FILES] == ["austen-heldout.txt", "classics-heldout.txt", "bible-heldout.txt"]
    assert len(docs) == len(shipped) == 12 and docs[0].startswith("CHAPTER XIII") and "Samuel" in docs[-1][:40]
    assert sum(len(d) for d in docs) > 250_000                  # 17 chunks of 4,096 tokens, as the README's table


def test_eval_defaults_to_f32_compute():
    args = eval_tool.build_parser().parse_args(["kld"])
    assert args.dtype == "f32" and eval_tool.build_parser().parse_args(["ppl", "--dtype", "bf16"]).dtype == "bf16"


# ----- contexts past the model's limit -----------------------------------------------------------------
def test_context_warnings_name_the_limit_and_the_trained_length():
    assert context_warnings(None, 4096) == []
    assert "trained on sequences of at most 4096" in context_warnings(None, 8192)[0]
    assert "past the model's context limit of 32768" in context_warnings(None, 100_000)[0]
    assert "past the model's context limit of 32768" in context_warnings(str(ROOT / "kvslim/data/tiny-qwen35"),
                                                                         40_000)[0]
    assert context_warnings("/nonexistent/model", 100_000) == []          # the loader reports a bad path


def test_a_cache_larger_than_the_free_memory_is_refused_before_allocating(capsys, monkeypatch):
    """-c far past the machine's memory: the preallocated caches would not fit, so the run stops
    with the bytes needed and free, not with torch's allocator failing mid-load."""
    from kvslim.cache import config as cache_config
    monkeypatch.setattr(cache_config, "available_memory", lambda device: 64 << 20)     # a 64 MiB machine
    code, out, err = run_cli(capsys, "run", "-p", "hi", "-n", 1, "-c", 1_000_000, "--temp", 0)
    assert code == 2 and "need 1.91 GiB, more than the 0.06 GiB cpu has free" in err, err
    assert "lower -c or -np" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "run", "-p", "hi", "-n", 1, "-c", 4096, "--temp", 0)   # 8 MiB of KV: fits
    assert code == 0, err


def test_run_warns_past_the_limit_and_says_when_the_context_filled(capsys):
    code, out, err = run_cli(capsys, "run", "-p", "hi", "-n", 2, "-c", 100_000, "--temp", 0)
    assert code == 0 and err.startswith("warning: -c 100000 per sequence is past the model's context limit")
    prompt = "It is a truth universally acknowledged, that a single man"
    code, out, err = run_cli(capsys, "run", "-p", prompt, "-n", 40, "-c", 16, "--temp", 0, "-o", "json")
    assert code == 0 and "note: stopped after" in err and "of -n 40 tokens: -c 16 is full" in err
    code, out, err = run_cli(capsys, "run", "-p", "Once", "-n", -1, "-c", 8, "--temp", 0, "-o", "json")
    record = json.loads(out)
    assert code == 0 and record["prompt_tokens"] + record["completion_tokens"] == 8 and "note:" not in err  # -1: fill


@pytest.mark.parametrize("argv, message", [
    (["-n", "0"], "-n must be at least 1, or -1 to generate until the context is full; got 0"),
    (["-n", "-5"], "-n must be at least 1"),
    (["-c", "1"], "-c must be at least 2 tokens"),
])
def test_run_names_its_flags(capsys, argv, message):
    code, out, err = run_cli(capsys, "run", "-p", "hi", *argv)
    assert code == 2 and err.startswith(f"kvslim run: error: {message}") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [
    ["run", "-p", "hi"], ["serve"], ["bench"], ["demo"], ["calibrate", "-f", "text.txt"], ["eval", "ppl"], ["imatrix", "model.gguf"],
])
def test_every_tool_that_loads_a_model_takes_threads_and_refuses_zero(capsys, argv):
    # llama.cpp's -t on every tool that runs a model; refused before anything loads or listens
    code, out, err = run_cli(capsys, *argv, "-t", 0)
    assert code == 2 and err == f"kvslim {argv[0]}: error: -t must be at least 1, got 0\n"


def test_threads_set_the_count_every_kernel_reads(capsys):
    import torch
    torch.set_num_threads(2)                                 # put back after the test (conftest)
    code, out, err = run_cli(capsys, "run", "-p", "hi", "-n", 1, "--temp", 0, "-t", 1, "-o", "json")
    assert code == 0 and torch.get_num_threads() == 1       # the C kernels read torch's count


def test_a_prompt_file_that_is_not_utf8_is_named(capsys, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    code, out, err = run_cli(capsys, "run", "-f", bad, "-n", 1)
    assert code == 2 and err == f"kvslim run: error: prompt file {bad} is not UTF-8 text: byte 3 (0xe9) invalid continuation byte\n"


# ----- Ctrl-C ---------------------------------------------------------------------------------------
def interrupt_after(argv: list[str], wait_for: str, stream: str, times: int = 1) -> subprocess.CompletedProcess:
    """Start ``python -m kvslim argv``, send SIGINT once ``wait_for`` showed ``times`` times on ``stream``,
    collect the rest."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    # SIGINT back to its default in the child: a suite started in the background (`make test &`)
    # ignores SIGINT, children inherit that, and Python keeps an inherited SIG_IGN.
    proc = subprocess.Popen([sys.executable, "-m", "kvslim", *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watched, seen = (proc.stdout if stream == "stdout" else proc.stderr), ""
    while seen.count(wait_for) < times:
        char = watched.read(1)
        assert char, f"exited before {wait_for!r}: {seen}"
        seen += char
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, seen + out if stream == "stdout" else out,
                                       seen + err if stream == "stderr" else err)


def test_ctrl_c_in_run_prints_timings_not_a_traceback():
    done = interrupt_after(["run", "-p", "Once upon a time", "-n", "2000", "-c", "4096", "--temp", "0"], " ", "stdout",
                           times=4)
    assert done.returncode == 130 and "Traceback" not in done.stderr
    assert re.search(r"\n\ninterrupted: prompt 4 tok in [0-9.]+ s \| gen [0-9]+ tok [0-9.]+ tok/s", done.stdout)


def test_ctrl_c_in_demo_is_one_line():
    # -c 2048: long enough that the demo cannot finish between the marker and the signal on a busy machine
    done = interrupt_after(["demo", "-c", "2048"], "[demo] generating", "stderr")
    assert done.returncode == 130 and "Traceback" not in done.stderr
    assert done.stderr.rstrip().endswith("kvslim demo: interrupted")


def test_serve_refuses_a_model_that_cannot_load_before_it_listens(capsys, tmp_path):
    """A bad -m is named before the port is bound (llama-server refuses it the same way), not
    reported by a background load after "listening"."""
    code, out, err = run_cli(capsys, "serve", "-m", tmp_path / "missing", "--port", 18123)
    assert code == 2 and "missing: no such file or folder" in err and "listening" not in out + err
    (tmp_path / "config.json").write_text("{bad")
    code, out, err = run_cli(capsys, "serve", "-m", tmp_path, "--port", 18123)
    assert code == 2 and "config.json: not valid JSON" in err and "listening" not in out + err


# ----- kvslim run -cnv ------------------------------------------------------------------------------
def script(lines: list[str]):
    """A stand-in for input(): the lines in turn, then end of input."""
    feed = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    return read


def conversation_args(*argv):
    from kvslim.tools import run
    args = run.build_parser().parse_args(["-cnv", "--temp", "0", *map(str, argv)])
    run.check_args(args)
    return args


@pytest.fixture(scope="module")
def talker():
    import kvslim
    return kvslim.load(ctx=512, prefix_cache=True)


def test_a_conversation_reuses_earlier_turns_and_replies_as_a_fresh_prompt_would(talker):
    import io
    import kvslim
    args = conversation_args("-n", 12, "-c", 512, "-sys", "Be brief.")
    out, err = io.StringIO(), io.StringIO()
    history = converse(talker, args, script(["Hello there", "Tell me \\", "more", "/exit"]), out, err)
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[3]["content"] == "Tell me \nmore"                         # a backslash goes on
    first, second = [line for line in err.getvalue().splitlines() if line.startswith("prompt ")]
    reused = int(re.search(r"\((\d+) reused", second).group(1))
    n_first = int(re.match(r"prompt (\d+) tok", first).group(1))
    assert "(0 reused" in first and reused >= n_first                       # the whole first prompt, at least
    fresh = kvslim.load(ctx=512)                                              # no prefix cache: read it all
    ids = fresh.tokenize(fresh.tokenizer.apply_chat_template(history[:4]), add_special=False)
    assert fresh.generate(ids, 12, temperature=0).text == history[4]["content"]
    assert history[2]["content"] in out.getvalue() and history[4]["content"] in out.getvalue()


def test_clear_a_full_context_and_ctrl_c_keep_the_conversation_going(talker):
    import io

    class StopAtThird(io.StringIO):                                          # Ctrl-C in the middle of a reply
        writes = 0

        def write(self, text):
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return super().write(text)

    args = conversation_args("-n", 8, "-c", 512)
    out, err = StopAtThird(), io.StringIO()
    history = converse(talker, args, script(["one", "/clear", "word " * 600, "two"]), out, err)
    assert "[stopped after" in out.getvalue() and "(history cleared)" in err.getvalue()
    assert "the conversation fills -c 512" in err.getvalue()                 # the long turn was left out
    # "one" and its stopped reply went with /clear; "two" ran in the slot the stopped reply freed
    assert [m["content"] for m in history if m["role"] == "user"] == ["two"] and history[-1]["content"]


def test_run_cnv_reads_turns_from_stdin_and_refuses_what_does_not_fit_it(capsys, monkeypatch):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n/exit\n"))
    code, out, err = run_cli(capsys, "run", "-cnv", "-n", 4, "--temp", 0)
    assert code == 0 and "reply 4 tok" in err
    code, out, err = run_cli(capsys, "run", "-cnv", "-o", "json")
    assert code == 2 and "-o json reports one completion" in err
    code, out, err = run_cli(capsys, "run", "-p", "hi", "-sys", "Be brief.")
    assert code == 2 and "-sys goes with --chat or -cnv" in err


def test_run_takes_llama_cpps_penalty_and_ignore_eos_flags(capsys):
    from kvslim.engine import SamplingParams
    from kvslim.tools import run
    from kvslim.tools.common import sampling_kwargs
    args = run.build_parser().parse_args(["--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--ignore-eos"])
    params = SamplingParams(**sampling_kwargs(args))
    assert (params.presence_penalty, params.frequency_penalty, params.ignore_eos) == (1.5, 0.5, True)
    texts = []
    for extra in ([], ["--frequency-penalty", 2]):                  # greedy: only the penalty can change the text
        code, out, err = run_cli(capsys, "run", "-p", "It is a truth", "-n", 24, "--temp", 0, "-o", "json", *extra)
        texts.append(json.loads(out)["text"])
    assert code == 0 and texts[0] != texts[1]
