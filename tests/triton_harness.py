"""Shared machinery of the Triton kernel tests (tests/test_triton_*.py).

Triton decides interpreted-or-compiled when a kernel is decorated, and importing kvslim
already imports triton (through torch), so a test process cannot switch its own kernels to
the interpreter: ``run_interpreted`` runs one function of a test module in a child process
started with TRITON_INTERPRET=1 and returns what it saved. ``compile_for_sm90`` lowers a
kernel through Triton's compiler and the ptxas in the triton wheel without a GPU, which
catches what numpy accepts and the GPU compiler refuses.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# fla-core, installed apart from the venv's packages by `make test`'s setup (requirements/fla.txt)
FLA_PATH = Path(sys.prefix) / "fla"


def run_interpreted(module: str, function: str, args, tmp_dir: Path, paths: tuple = ()):
    """``module.function(args, path)`` in an interpreted child with the kernels switched on
    (KVSLIM_TRITON=1); returns ``torch.load(path)``.
    ``args`` must survive ``repr`` (plain tuples, lists, strings and numbers); ``paths``: more
    folders for the child's import path (FLA_PATH)."""
    path = Path(tmp_dir) / f"{function}.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", KVSLIM_TRITON="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, paths), os.environ.get("PYTHONPATH", "")]))
    code = f"import sys; from pathlib import Path; from tests.triton_harness import quick_device_calls; " \
           f"quick_device_calls(); from {module} import {function} as run; run({args!r}, Path(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(path)


def quick_device_calls() -> None:
    """Triton's interpreter re-patches triton.language at every call of a @triton.jit helper,
    though the kernel's launch has patched it already: a third of an interpreted GEMV's time
    (cProfile: 856 helper calls, 1.85 s of 5.8 s for three Q6_K cases). kvslim's helpers reach
    triton.language only through the ``tl`` their kernel's launch patched, so their calls skip
    it. Triton's own helpers (tl.zeros, tl.sum) reach triton.language.core, which the first such
    call patches for good (its patches are never undone): later calls skip it while its builtins
    and the tensor class's (patched by each launch) are patched (11% of the weights child's
    time, 20,000 calls). The values are the same; the weights fixture's child runs in 45 s
    instead of 57, and in 37 instead of 47 once triton.language.core is skipped too. A helper
    reaching an unpatched builtin would fail loudly (a builtin called outside a kernel raises),
    not compute otherwise. Left alone where the interpreter's device call is not the one this
    was written against."""
    import inspect
    from triton.runtime import interpreter
    call = interpreter.InterpretedFunction.__call__
    source = inspect.getsource(call)
    if "_patch_lang(self.fn)" not in source or "self.rewrite()" not in source:
        return
    tl, langs = interpreter.tl, {}

    def patched(fn) -> bool:
        if fn not in langs:
            langs[fn] = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        return not tl.core.is_builtin(tl.core.tensor.__add__) and \
            all(not tl.core.is_builtin(lang.load) for lang in langs[fn])

    def device_call(self, *args, **kwargs):
        if not self.fn.__module__.startswith("kvslim.") and not patched(self.fn):
            return call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
    interpreter.InterpretedFunction.__call__ = device_call


def attention_kernels_only() -> None:
    """In an interpreted child: only the attention and append kernels serve (and the weights'
    and experts', which no float model reaches). The others (SwiGLU and the output gate, the
    DeltaNet conv and decode steps and gated norm, q/k norm-rope, add-norm) round a few float32 ulps from torch,
    which can move a later attention layer's K/V codes off the torch path's, and each of their
    programs costs the interpreter ~6 ms; their own tests hold them to torch, and the mixture
    wiring test runs a whole model with every kernel on."""
    from kvslim.gpu import add_norm, conv_step, delta_step, gated_norm, rope, swiglu
    for module in (swiglu, conv_step, delta_step, gated_norm, rope, add_norm):
        module.runs_on = lambda x: False


def compiled_process() -> None:
    """Skip unless this process's kernels are compiled (not the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process's kernels are interpreted")


def compile_for_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, divisible: tuple = (),
                     capability: int = 90):
    """``kvslim.gpu.compile_sm90`` in a compiled (not interpreted) process; skips where this
    triton has no CUDA backend. A ``num_stages`` among the constexprs (a launch config's) is
    passed as the option it is. ``capability``: another target than sm_90. Returns the compiled kernel."""
    compiled_process()
    from kvslim.gpu import compile_sm90
    constexprs = dict(constexprs)
    options = {"num_warps": num_warps}
    if "num_stages" in constexprs:
        options["num_stages"] = constexprs.pop("num_stages")
    try:
        return compile_sm90(fn, pointers, constexprs, divisible, capability, **options)
    except ImportError:
        pytest.skip("this triton has no CUDA backend")


def resource_usage(compiled) -> dict[str, int]:
    """``kvslim.gpu.resource_usage``: ptxas's registers (REG) and stack (STACK) a thread."""
    from kvslim.gpu import resource_usage as usage
    return usage(compiled)


def spilled_bytes(compiled) -> int:
    """Bytes of stack (register spills) a thread of the compiled kernel takes."""
    return resource_usage(compiled)["STACK"]


def check_state(got, want, live: torch.Tensor) -> None:
    """A kernel's online-softmax state (m, l, acc) against the torch loop's ``_OnlineSoftmax``:
    rows where ``live`` (sequences (S,) or rows (S, R)) see a key match within the C kernel's
    tolerances; the others must be exactly empty (m = -inf, l = 0, acc = 0)."""
    m, l, acc = got
    assert torch.allclose(m[:, live], want.m[:, live], atol=1e-5)
    assert torch.allclose(acc[:, live] / l[:, live], want.result()[:, live], atol=2e-5, rtol=1e-4)
    assert (l[:, ~live] == 0).all() and torch.isinf(m[:, ~live]).all() and (acc[:, ~live] == 0).all()
