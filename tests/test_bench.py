"""``kvslim bench`` smoke test: it runs, its JSON parses, and its labels are llama-bench's."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvslim import gpu
from kvslim.bench import FilledCache
from kvslim.bench.runner import time_tg
from kvslim.bench.report import markdown
from kvslim.cli import main as cli_main
from kvslim.loading import load_model
from kvslim.tools.bench import int_list


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark(name: str):
    """benchmarks/<name>.py imported as a module (its folder on the path, for its neighbours)."""
    import importlib.util
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_number_lists_and_ranges_read_like_llama_bench():
    assert int_list("0,4096,16384") == [0, 4096, 16384]
    assert int_list("0-8192+4096") == [0, 4096, 8192]
    assert int_list("512-4096*2") == [512, 1024, 2048, 4096]
    with pytest.raises(ValueError, match="never advances"):
        int_list("1-10*1")


def test_bench_json_and_markdown(tiny_folder, capsys, tmp_path):
    folder = tiny_folder("qwen3_5")[0]
    code = cli_main(["bench", "-m", str(folder), "-p", "32", "-n", "4", "-d", "0,64", "-r", "1", "-ctk", "q8_0",
                     "-ctv", "turbo4", "--dtype", "f32", "-o", "json", "--no-progress",
                     "--plot", str(tmp_path / "b.png")])
    records = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["test"] for r in records] == ["pp32", "tg4", "pp32 @ d64", "tg4 @ d64"]
    assert all(r["avg_ts"] > 0 and r["type_k"] == "q8_0" and r["type_v"] == "turbo4" for r in records)
    assert records[2]["kv_bytes"] > 0 and (tmp_path / "b.png").stat().st_size > 1000
    table = markdown(records)
    assert "| type_k | type_v | test" in table and " ± " in table and "peak RSS |" in table
    assert [r["decode_path"] for r in records] == ["", "native", "", "native"]
    # a CUDA run's records carry the GPU allocator's peak instead of the process's RSS
    gpu_records = [{**r, "peak_rss_bytes": -1, "peak_gpu_bytes": 3 << 30} for r in records]
    assert "peak GPU |" in markdown(gpu_records) and "3.00 GiB |" in markdown(gpu_records)


def test_repetitions_start_from_the_same_filled_state(tiny_folder):
    model, _, _ = load_model(tiny_folder("qwen3_5")[0], "f32")
    fc = FilledCache(model, 256, 1, "f16", "f16", 16)
    fc.grow_to(40)
    snap = [c.state(0) for c in fc.caches]
    time_tg(fc, 5)
    assert all(c.offset(0) == 45 for c in fc.caches)
    fc.restore()
    for cache, before in zip(fc.caches, snap):
        after = cache.state(0)
        assert cache.offset(0) == 40 and all((after[k] == before[k]).all() for k in before)


def test_gpu_model_benchmark_dry_run_holds_what_the_planner_predicts(capsys):
    """benchmarks/gpu_model.py (issue 18's end-to-end run) on the CPU, shrunk: the random
    35B-A3B-shaped model holds the weight bytes `kvslim plan` predicts for a q4_0 file, its
    caches the KV + state bytes, and every test row comes out."""
    gpu_model = _benchmark("gpu_model")
    assert gpu_model.main(["--device", "cpu", "--shrink", "16", "--layers", "4", "-d", "0,128", "-p", "64",
                           "-n", "2", "-np", "1,2", "--pairs", "q8_0/turbo4", "--eager", "--profile", "2"]) == 0
    out = capsys.readouterr().out
    assert "q8_0/turbo4, one slot at depth 0: 3 decode steps profiled" in out and "aten::" in out   # --profile
    assert "q8_0/turbo4: one 64-token prompt chunk profiled" in out
    # where each pair's seconds went: the stages, then the timed steps' share of decode's
    stages = re.findall(r"q8_0/turbo4 -np (\d): ([\d.]+) s \((.*); of decode, ([\d.]+) s timed steps", out)
    assert [s[0] for s in stages] == ["1", "2"], out
    assert [name.split()[0] for name in stages[0][2].split(", ")] == ["cache", "prefill", "fill", "profile", "decode"]
    for _, total, parts, timed in stages:
        seconds = {name: float(v) for name, v in (p.split() for p in parts.split(", "))}
        assert abs(sum(seconds.values()) - float(total)) < 0.2 and float(timed) <= seconds["decode"] + 0.05
    weights = re.search(r"weights held ([\d,]+) MiB, plan ([\d,]+) MiB \(([-+\d.]+)%\)", out)
    assert weights and abs(float(weights.group(3))) < 5, out
    rows = [line for line in out.splitlines() if line.startswith("| q8_0/turbo4")]
    assert [r.split("|")[3].strip() for r in rows[:5]] == ["pp64", "tg2 @ d0", "tg2 @ d128", "tg2 @ d0", "tg2 @ d128"]
    for row in rows[5:]:                                   # the memory table: cache bytes vs the plan's
        assert abs(float(row.split("|")[6].strip().rstrip("%"))) < 10, row
    with pytest.raises(SystemExit):
        gpu_model.main(["--device", "cpu", "--weights", "q4_k_m"])   # a mix, not one block type


def test_gpu_model_benchmark_keeps_going_past_a_failed_pair(capsys, monkeypatch):
    """A pair that fails (here its cache fill, after its prompt was timed) leaves its measured rows
    and a row naming the error, and the next pair still runs: a lease's call is not lost to one."""
    gpu_model = _benchmark("gpu_model")
    fill_to, calls = gpu_model.fill_to, []

    def fails_first(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no kernel for this pair\nmore detail")
        return fill_to(*args, **kw)
    monkeypatch.setattr(gpu_model, "fill_to", fails_first)
    assert gpu_model.main(["--device", "cpu", "--shrink", "16", "--layers", "4", "-d", "0", "-p", "64", "-n", "2",
                           "-np", "1", "--pairs", "q8_0/turbo4,f16/f16", "--eager"]) == 0
    out, err = capsys.readouterr()
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    rows = [r for r in table if r[2].startswith(("pp", "tg", "failed"))]          # the speed table's
    assert [r[:3] for r in rows] == [["q8_0/turbo4", "1", "pp64"], ["q8_0/turbo4", "1", "failed"],
                                     ["f16/f16", "1", "pp64"], ["f16/f16", "1", "tg2 @ d0"]], out
    assert rows[1][-1] == "RuntimeError: no kernel for this pair" and "Traceback" in err


def test_gpu_model_times_each_ab_variant_with_its_switches_on(capsys, monkeypatch):
    """--ab: each pair once per variant a round, the model made once, the variant's launch
    switches on while it runs and as they were after, profiles in the first round only; rows
    named by pair and variant, and a table of each variant's median over the rounds and its ratio
    to the first's; an unknown switch is refused before anything runs."""
    gpu_model = _benchmark("gpu_model")
    seen, tps = [], iter([100, 400, 110, 420, 90, 380, 100, 400, 130, 440, 100, 400])

    def run_pair(model, config, plan_model, pair, n_slots, args, gen, bandwidth, speed, label=None):
        seen.append((label, n_slots, gpu.PDL, gpu.L2_PREFETCH, args.profile))
        speed.append([label, n_slots, "tg2 @ d0", f"{next(tps):.1f}", "", "graphs"])
        return [label, n_slots, 1, "0", "0", "", "0", "0"]
    monkeypatch.setattr(gpu_model, "run_pair", run_pair)
    monkeypatch.setattr(gpu, "PDL", False)
    monkeypatch.setattr(gpu, "L2_PREFETCH", False)
    assert gpu_model.main(["--device", "cpu", "--shrink", "16", "--layers", "4", "-d", "0", "-np", "1,4",
                           "--pairs", "q8_0/turbo4", "--ab", "plain,pdl+l2-prefetch,l2-prefetch", "--rounds", "2",
                           "--profile", "2"]) == 0
    first = [("q8_0/turbo4 plain", 1, False, False, 2), ("q8_0/turbo4 plain", 4, False, False, 2),
             ("q8_0/turbo4 pdl+l2-prefetch", 1, True, True, 2), ("q8_0/turbo4 pdl+l2-prefetch", 4, True, True, 2),
             ("q8_0/turbo4 l2-prefetch", 1, False, True, 2), ("q8_0/turbo4 l2-prefetch", 4, False, True, 2)]
    assert seen == first + [row[:4] + (0,) for row in first]
    assert (gpu.PDL, gpu.L2_PREFETCH) == (False, False)
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    table = [row for row in cells if row[0] == "q8_0/turbo4"]            # the variants' table (medians, ratios)
    assert table == [["q8_0/turbo4", "1", "tg2 @ d0", "100.0 (2)", "120.0 (2)", "95.0 (2)", "1.200", "0.950"],
                     ["q8_0/turbo4", "4", "tg2 @ d0", "400.0 (2)", "430.0 (2)", "390.0 (2)", "1.075", "0.975"]], out
    with pytest.raises(SystemExit):
        gpu_model.parse(["--ab", "plain,pdl+prefetch"])


# The GPU benchmarks' own dry runs (docstrings): every code path of each script on the CPU under
# Triton's interpreter, so that a GPU lease is not spent finding a script that cannot start.
# (script, arguments, table rows expected)
GPU_DRY_RUNS = [
    ("gpu_decode.py", ["-d", "64", "-b", "1", "-r", "1", "-p", "q8_0/turbo4", "--dot", "ieee,f16"], 3),
    # sdpa, then turbo4/turbo4 and q8_0/turbo4 each as a decode step launches it (served), by tiles, by
    # mma and by mma with its loads early
    ("gpu_decode.py", ["-d", "64", "-b", "1", "-r", "1", "-p", "turbo4/turbo4,q8_0/turbo4", "--dot", "f16",
                       "--kernels", "tiles,mma,served", "--no-loop"], 9),
    ("gpu_prefill.py", ["-d", "32", "-n", "16", "-p", "q8_0/turbo4", "-r", "1"], 1),
    ("gpu_weights.py", ["-t", "q4_0", "-s", "64x64", "-m", "32", "-r", "1", "--experts", "8x64x32x2",
                        "--expert-tokens", "1,80"], 6),
    ("gpu_delta_step.py", ["--shape", "2x4x16x16", "-b", "1,2", "--slots", "4", "-r", "1"], 4),
]


def _gpu_script(script: str, args: list[str], interpret: bool) -> subprocess.CompletedProcess:
    if not gpu.available():
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"KVSLIM_TRITON": "0", **({"TRITON_INTERPRET": "1"} if interpret else {})})
    path = BENCHMARKS / script
    return subprocess.run([sys.executable, str(path), "--device", "cpu", *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("script,args,rows", GPU_DRY_RUNS, ids=[f"{r[0]}-{i}" for i, r in enumerate(GPU_DRY_RUNS)])
def test_gpu_benchmark_dry_runs_reach_their_tables(script, args, rows):
    done = _gpu_script(script, args, interpret=True)
    assert done.returncode == 0, done.stderr[-2000:]
    if script == "gpu_weights.py" and not _benchmark("gpu_weights")._interprets_bf16():   # Triton 3.6's interpreter
        assert "has no bf16" in done.stderr
        rows -= 2                                                   # the bf16 GEMV and GEMM rows
    lines = done.stdout.splitlines()
    body = [line for line in lines if line.startswith("| ")]
    separators = [line for line in lines if line.startswith("|-") or line.startswith("|:")]
    assert separators and len(body) - len(separators) == rows, done.stdout     # one header line a table


def test_device_parity_compares_every_module_and_refuses_unknown_types():
    """benchmarks/device_parity.py (a lease's diagnosis of CPU/GPU drift) on the CPU against itself:
    every module's row comes out, all equal, and the logits too. A subprocess: it sets torch's
    float32 precision process-wide at its end."""
    script = [sys.executable, str(BENCHMARKS / "device_parity.py"), "--device", "cpu", "-n", "8"]
    done = subprocess.run([*script, "--rows", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "K/V f16/f16, 8 tokens; the Triton kernels and fla-core off" in out
    rows = [line for line in out.splitlines() if re.match(r"\| model\.layers\.\d+ \|", line)]
    assert len(rows) == 8 and all("| 0.0e+00 |" in row for row in rows), out       # the bundled model's 8 layers
    assert "first above" not in out and "logits: max |diff| 0.000e+00" in out
    bad = subprocess.run([*script, "-ctk", "q8_O"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "-ctk/-ctv q8_O/f16" in bad.stderr and "Traceback" not in bad.stderr


def test_the_decode_sweep_compiles_in_processes_and_writes_its_choices(tmp_path):
    """gpu_decode.py --sweep --jobs 2 --tuned-out: two processes run its launches first (Triton's
    disk cache on a GPU: 5 VARIANTS of these products, the first read per value, the float32 one
    of STRIDED), then the sweep times them all and writes a file ``gpu.tuned`` loads,
    with the float32 backend's default timed (so its choice is made, whichever it is) and not
    the bf16 backend's (so none is)."""
    from kvslim.gpu import tuned
    out = tmp_path / "tuned.json"
    done = _gpu_script("gpu_decode.py", ["--sweep", "-d", "16", "-b", "1", "-r", "1", "-p", "q8_0/turbo4", "--dot",
                                         "ieee,fma", "--kernels", "tiles", "--jobs", "2", "--tuned-out", str(out)],
                       interpret=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| q8_0/turbo4 | 16 | 1 |")]
    assert len(rows) == 7 and all(re.search(r"\| [\d.]+e-\d+ \|$", row) for row in rows), done.stdout
    assert [row.split("|")[9].strip() for row in rows] == ["units"] * 5 + ["per-value", "strided"], done.stdout
    assert "warmed 7 launches in 2 processes" in done.stderr and "exit codes [0]" in done.stderr, done.stderr
    assert "tuned q8_0/turbo4 (bf16 backend): its default launch was not timed" in done.stderr
    chose = r"the default launch is the fastest|\{.*\}, \d+ keys a split: 16x1 [\d.]+ ms against 16x1 [\d.]+$"
    assert re.search(rf"tuned q8_0/turbo4 \(f32 backend\): ({chose})", done.stderr, re.M), done.stderr
    assert all(e.backend == "f32" and tuned.float32_products(e.tune) for e in tuned.load(out).values())
    assert f"tuned launches: {out}" in done.stdout


def test_gpu_benchmarks_refuse_the_cpu_without_the_interpreter():
    done = _gpu_script("gpu_weights.py", [], interpret=False)
    assert done.returncode != 0 and "TRITON_INTERPRET=1" in done.stderr


def test_the_launch_count_says_what_torch_it_needs():
    """benchmarks/decode_launches.py makes fake CUDA tensors, which a CPU-only torch cannot: it
    says so in one line (with a CUDA build it counts; docs/gpu.md)."""
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA built in: the script would count")
    path = BENCHMARKS / "decode_launches.py"
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no CUDA support built in" in done.stderr and "Traceback" not in done.stderr


def test_the_launch_count_reads_each_grid_as_programs():
    """decode_launches.py's programs column: a grid tuple's sizes multiplied, a grid function
    called with the launch's constexprs; kernels' shapes as ranges where their launches differ."""
    from collections import Counter
    launches = _benchmark("decode_launches")
    assert launches.programs((2, 3, 4), {}) == 24 and launches.programs((7,), {}) == 7
    assert launches.programs(lambda meta: (meta["N"] // meta["BLOCK"], 2), {"N": 256, "BLOCK": 16}) == 32
    assert launches.spread(Counter({(1, 4): 10, (1, 8): 10})) == ("1", "4-8")
    assert launches.spread(Counter({(1024, 4): 1, (31040, 4): 1})) == ("1,024-31,040", "4")
    assert launches.spread(None) == ("", "")


def test_the_compile_count_keys_launches_as_the_jit_specializes_them():
    """decode_launches.py --compile: a launch's key holds what Triton's JIT compiles for (constexprs
    and ints equal to 1 by value, other ints by multiple of 16 or not, pointers by type and 16-byte
    start, the options), so launches the JIT would share a compile for share a key; each key then
    compiles for sm_90."""
    if not gpu.available():
        pytest.skip("triton is not installed")
    launches = _benchmark("decode_launches")
    fn = gpu.kernels("_swiglu_kernel").act_mul
    wide = torch.zeros(4, 2, 96)                       # gate and up: halves of one fused projection's rows
    out = torch.empty(4, 2, 48, dtype=torch.bfloat16)
    options = {"ACT": "silu", "BLOCK": 64, "num_warps": 4, "enable_fp_fusion": True}

    def key(gate, up, heads, width):
        return launches.specialization(fn, (gate, up, out, heads, width, 192, 96, 192, 96), options)
    (name, spec, opts), constexprs = key(wide[..., :48], wide[..., 48:], 1, 48)
    kinds = {n: (kind, v) for n, kind, v in spec}
    assert name == "act_mul" and opts == (("enable_fp_fusion", True), ("num_warps", 4))
    assert constexprs == {"H": 1, "ACT": "silu", "BLOCK": 64, "PDL": False}
    assert kinds["H"] == ("constexpr", "1") and kinds["D"] == ("d16", None) and kinds["gate_rows"] == ("d16", None)
    assert kinds["gate_ptr"] == ("*fp32", True) and kinds["out_ptr"] == ("*bf16", True)
    assert key(wide[..., :40], wide[..., 40:88], 1, 40)[0] == key(wide[..., :56], wide[..., 40:96], 1, 56)[0]
    assert key(wide[..., :40], wide[..., 47:87], 1, 40)[0][1] != key(wide[..., :40], wide[..., 40:80], 1, 40)[0][1]
    assert key(wide[..., :48], wide[..., 48:], 2, 48)[0] != key(wide[..., :48], wide[..., 48:], 1, 48)[0]
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    try:
        timed = launches.compile_all({(name, spec, opts): (fn, constexprs)})
    except ImportError:
        pytest.skip("this triton has no CUDA backend")
    assert [n for n, _ in timed] == ["act_mul"] and timed[0][1] > 0
    assert os.environ.get("TRITON_CACHE_DIR") == cache_dir              # the worker's own cache again


def test_the_profiles_busy_line_sums_the_device_events_a_step():
    """gpu_model.py's line under a decode profile: the device events' time (kernels, copies) a
    step against the step's wall time; the host's events are not counted."""
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    gpu_model = _benchmark("gpu_model")
    events = [SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=3000.0, count=400),   # us
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=1000.0, count=200),
              SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=9000.0, count=900)]
    line = gpu_model.device_busy(events, steps=2, wall_ms=4.0)
    assert line == "kernels: 2.000 ms a step of 4.000 ms wall (50% busy), 300 kernels a step, 6.7 us each on average"


def test_a_short_align_list_drops_no_column():
    """gpu_weights.py passed one alignment fewer than its columns, which dropped its last column
    (torch's GB/s) from every table it printed: missing alignments are left-aligned now."""
    from kvslim.tables import markdown_table
    head, rule, row = markdown_table(["type", "ms", "GB/s"], [["q4_0", "0.5", "900"]], ["l", "r"]).splitlines()
    assert [c.strip() for c in head.split("|")[1:-1]] == ["type", "ms", "GB/s"]
    assert [c.strip() for c in row.split("|")[1:-1]] == ["q4_0", "0.5", "900"] and rule.count("|") == 4


def test_tf32_rounding_of_the_delta_rule_benchmark(capsys):
    """benchmarks/tf32_delta_rule.py: operands rounded to 10 mantissa bits, to nearest even, as
    tensor cores take tf32; and its run prints the bundled model's difference."""
    bench = _benchmark("tf32_delta_rule")
    ulp = 2.0 ** -10
    x = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 4, -(1 + 3 * ulp / 4), 3.0, float("inf"), float("nan")])
    got = bench.tf32(x)
    assert got[:5].tolist() == [1.0, 1 + 2 * ulp, 1.0, -(1 + ulp), 3.0]          # ties to even, else nearest
    assert got[5] == float("inf") and got[6].isnan()
    bench.main(["-n", "16"])
    out = capsys.readouterr().out
    assert "16-token prompt" in out and "largest logit difference" in out


# ----- bad inputs: one line, exit 2, before the model loads ----------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["-p", "-5", "-n", "2"], "-p takes counts of 0 or more, got -5"),      # was dropped: tg ran alone, exit 0
    (["-p", "16", "-n", "-3"], "-n takes counts of 0 or more, got -3"),
    (["-p", "16", "-d", "-64"], "-d takes counts of 0 or more, got -64"),
    (["-p", "16", "-ctk", ","], "-ctk and -ctv need at least one cache type each"),   # was an empty table, exit 0
    (["-p", "16", "--plot", "/nonexistent/b.png"], "--plot /nonexistent/b.png: its folder does not exist"),
    (["-p", "16", "--plot", "/"], "--plot /: it is a folder; give the output file's name"),
])
def test_bench_bad_inputs_give_one_clear_line(capsys, monkeypatch, argv, message):
    import kvslim.tools.bench as B

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the arguments were checked")
    monkeypatch.setattr(B, "load_model", no_model)
    code = cli_main(["bench", *argv, "-r", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == f"kvslim bench: error: {message}\n"


# ----- kvslim quant -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["-t", ","], "-t needs at least one KV type"),                     # was an IndexError traceback
    (["-t", "q4_0", "--head-dim", "-8"], "--head-dim and -r must be at least 1"),   # was a RuntimeError
    (["-t", "q4_0,nl4", "--head-dim", "32"], "nl4: head_dim 32 must be a multiple of 64"),
])
def test_quant_bad_inputs_give_one_clear_line_before_measuring(capsys, monkeypatch, argv, message):
    import kvslim.tools.quant as Q

    measured = []
    monkeypatch.setattr(Q, "measure", lambda f, *a: measured.append(f.name))
    code = cli_main(["quant", *argv, "--n", "16", "-r", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
    assert measured == []                   # q4_0 is not measured before nl4 is found unable to store 32


def test_quant_default_types_are_those_that_store_the_head_dim(capsys):
    from kvslim import formats

    code = cli_main(["quant", "--head-dim", "32", "--n", "16", "--queries", "4", "-r", "1", "-o", "json",
                     "--no-progress"])
    names = [r["type"] for r in json.loads(capsys.readouterr().out)]
    assert code == 0 and {"q8_0", "q4_0", "turbo3"} <= set(names) and "nl4" not in names
    for name in names:
        formats.get(name).check_head_dim(32)


# ----- llama-bench's -pg ----------------------------------------------------------------------------
def test_pg_runs_a_prompt_then_its_reply_labelled_and_counted_as_llama_bench(tiny_folder, capsys, monkeypatch):
    import kvslim.bench.runner as R

    folder = tiny_folder("qwen3_5")[0]
    code = cli_main(["bench", "-m", str(folder), "-p", "0", "-n", "0", "-pg", "8,2", "-pg", "0,2", "-pg", "0,0",
                     "-d", "0,16", "-r", "1", "--dtype", "f32", "-o", "json", "--no-progress"])
    records = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["test"] for r in records] == ["pp8+tg2", "tg2", "pp8+tg2 @ d16", "tg2 @ d16"]
    assert [(r["n_prompt"], r["n_gen"], r["n_depth"]) for r in records] == [(8, 2, 0), (0, 2, 0), (8, 2, 16),
                                                                             (0, 2, 16)]
    assert all(r["avg_ts"] > 0 for r in records) and records[0]["decode_path"] == "native"
    # t/s counts the prompt's and the reply's tokens over the time of both
    monkeypatch.setattr(R, "time_pg", lambda fc, n_prompt, n_gen: 2.0)
    fc = R.FilledCache(load_model(str(folder), dtype="f32")[0], 32, 1, "f16", "f16", 8)
    assert R.measure(fc, R.Test("pg", 8, 0, 2), 1)["avg_ts"] == pytest.approx(5.0)


@pytest.mark.parametrize("value", ["16", "16,-4", "a,b", "1,2,3"])
def test_pg_takes_two_counts(capsys, value):
    code = cli_main(["bench", "-pg", value, "--no-progress"])
    assert code == 2 and f"-pg takes two counts of 0 or more, PP,TG, got '{value}'" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:No artists with labels")
def test_the_plot_keeps_pg_runs_off_the_pp_and_tg_lines(tmp_path, monkeypatch):
    import kvslim.bench.report as report

    base = {"type_k": "f16", "type_v": "f16", "avg_ts": 1.0, "stddev_ts": 0.0, "model_type": "m"}
    rows = [{**base, "n_prompt": 8, "n_gen": 0, "n_depth": 0, "test": "pp8"},
            {**base, "n_prompt": 0, "n_gen": 2, "n_depth": 0, "test": "tg2"},
            {**base, "n_prompt": 8, "n_gen": 2, "n_depth": 16, "test": "pp8+tg2 @ d16"}]
    import matplotlib.axes
    drawn = []
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", lambda self, d, *a, **k: drawn.append(list(d)))
    report.plot(rows, tmp_path / "p.png")
    assert drawn == [[0], [0]]              # the pp8+tg2 point at depth 16 is on neither line
