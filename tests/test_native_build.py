"""The C build where a compiler lacks what ``build.FLAGS`` asks for (Apple's clang has no
OpenMP; clang 14 on x86 has no _Float16), and half.c's software conversions."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvslim.engine import native_step
from kvslim.loading import load_model
from kvslim.native import build

from .test_native_step import run_both

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")

C_FILES = ["decode_step.c", "paged_attention.c", "kv_encode.c", "block_linear.c", "prefill_attention.c",
           "delta_rule.c"]


def fake_compiler(tmp_path: Path, refuse: str, message: str) -> str:
    """A cc that fails, as a compiler without ``refuse`` does, whenever that flag is given. It
    optimises at -O1 where -O3 is asked: what these tests check is the fallback, not the
    optimiser's code, and decode_step.c builds in 11 s at -O1 against 35 s at -O3 (2 cores)."""
    script = tmp_path / "cc"
    script.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{refuse}" ] && {{ echo "{message}" >&2; exit 1; }}; '
                      f'done\nfor a in "$@"; do shift; [ "$a" = "-O3" ] && a=-O1; set -- "$@" "$a"; done\n'
                      f'exec {build.compiler()} "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.fixture
def own_build(tmp_path, monkeypatch):
    """Builds into a fresh folder; the process's libraries and notes are forgotten before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    build.clear()
    yield tmp_path
    build.clear()


def test_without_openmp_the_step_builds_single_threaded_and_still_matches(own_build, monkeypatch):
    """Apple's clang refuses -fopenmp: the C step builds without it (one thread, with a warning
    that says why) instead of leaving decode to the torch step, and its logits still match."""
    monkeypatch.setenv("CC", fake_compiler(own_build, "-fopenmp",
                                           "clang: error: unsupported option '-fopenmp' for target 'arm64-apple-darwin'"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native_step._library() is not None
    assert "without -fopenmp" in build.NOTES["decode_step.c"] and "unsupported option" in build.NOTES["decode_step.c"]
    assert any("one thread" in str(w.message) for w in caught)
    model, _, _ = load_model(None, "f32")
    worst, same = run_both(model, "q8_0", "turbo4", steps=4)
    assert worst < 1e-4 and same
    build.clear()                                                    # a later process: the note is kept
    assert native_step._library() is not None and "without -fopenmp" in build.NOTES["decode_step.c"]


def test_a_failed_build_says_why(own_build, monkeypatch):
    monkeypatch.setenv("CC", fake_compiler(own_build, "-shared", "ld: error: this linker makes no libraries"))
    assert native_step._library() is None
    step, why = native_step.NativeStep.build(None, None)
    assert step is None and "this linker makes no libraries" in why


def test_software_halves_match_numpy_on_every_value():
    """half.c without _Float16 (the portable build): every half to float, and 8M floats (random
    bit patterns, the subnormal range, the overflow edge, both signs) to half, bit for bit
    (NaN stays NaN)."""
    lib = build.library("paged_attention.c", "portable")
    halves = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    lib.kvslim_half_to_float(ctypes.c_void_p(halves.ctypes.data), ctypes.c_void_p(out.ctypes.data),
                             ctypes.c_int64(65536))
    assert np.array_equal(out.view(np.uint32), halves.view(np.float16).astype(np.float32).view(np.uint32))
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 4_000_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x33000000 - 4096, 0x38900000, 7, dtype=np.uint32),   # subnormal halves
                           np.arange(0x477f0000, 0x47800100, dtype=np.uint32)])           # 65504 .. inf
    x = bits.view(np.float32)
    x = np.concatenate([x, -x])
    got = np.empty(x.size, np.uint16)
    lib.kvslim_float_to_half(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(got.ctypes.data), ctypes.c_int64(x.size))
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan]) and np.isnan(got.view(np.float16)[nan]).all()


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 cross compiler")
@pytest.mark.parametrize("source", C_FILES)
def test_the_c_files_compile_for_arm64(source, tmp_path):
    """Apple silicon and ARM servers: every x86 path is behind its #if, and the rest is C that an
    arm64 compiler takes (compiled only: nothing here runs arm64 code)."""
    folder = Path(build.__file__).parent
    done = subprocess.run(["aarch64-linux-gnu-gcc", *build.VARIANTS["portable"][:1], "-march=armv8.2-a+fp16",
                           "-fopenmp", "-Wall", "-Werror=implicit-function-declaration", "-shared", "-fPIC",
                           f"-I{build.include_dir()}", str(folder / source), "-o", str(tmp_path / "lib.so")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_mac_with_homebrew_libomp_tries_it_before_one_thread(tmp_path, monkeypatch):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "omp.h").write_text("")
    find = build.homebrew_libomp
    monkeypatch.setattr(build.sys, "platform", "darwin")
    assert find(roots=("/nonexistent", str(tmp_path))) == str(tmp_path)
    monkeypatch.setattr(build, "homebrew_libomp", lambda: str(tmp_path))
    tries = build.fallbacks(build.FLAGS)
    assert tries[0] == build.FLAGS and "-lomp" in tries[1] and "-Xpreprocessor" in tries[1]
    assert "-fopenmp" not in tries[-1] and "-march=native" not in tries[-1]
    monkeypatch.setattr(build.sys, "platform", "linux")
    assert find(roots=(str(tmp_path),)) is None
