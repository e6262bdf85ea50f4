"""Programmatic dependent launch (``kvslim.gpu.PDL``, ``pdl``, ``_codecs.after_previous``), checked
without a GPU: when a launch asks for it, and that a kernel compiled with it waits for the launch
before its own before touching memory.

Under PDL a kernel may start while the one before it is still running, so every global load,
store and atomic must come after its griddepcontrol.wait: the kernels call ``after_previous`` as
their first statement. The interpreter runs no PTX, so the kernels' PDL defaults to False and the
launchers ask for it only on a CUDA device of compute capability 9 or more.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import kvslim.gpu
from kvslim import formats, weights
from kvslim.gpu import kv_append, paged_prefill, quant_matmul

from .triton_harness import compile_for_sm90

GPU = Path(kvslim.gpu.__file__).parent
needs_triton = pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed")


def test_pdl_options_only_when_on_and_on_hopper(monkeypatch):
    monkeypatch.setattr(kvslim.gpu, "_capability", lambda index: 9)
    monkeypatch.setattr(kvslim.gpu, "PDL", False)
    assert kvslim.gpu.pdl(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(kvslim.gpu, "PDL", True)
    assert kvslim.gpu.pdl(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert kvslim.gpu.pdl(torch.device("cpu")) == {}                     # the interpreter's tensors
    monkeypatch.setattr(kvslim.gpu, "_capability", lambda index: 8)      # an RTX 3090 / A100: no griddepcontrol
    assert kvslim.gpu.pdl(torch.device("cuda", 0)) == {}


def _launches():
    """Every kernel launch in kvslim/gpu's launchers (``_kernel().<name>[grid](...)`` or
    ``kernel[grid](...)``): (file, line, source)."""
    for path in sorted(GPU.glob("[!_]*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                by_name = (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Call)
                           and getattr(target.value.func, "id", "") == "_kernel")
                if by_name or getattr(target, "id", "") == "kernel":
                    yield path.name, node.lineno, ast.unparse(node)


def test_every_kernel_launch_passes_its_pdl_options():
    """A launch without them would start only after the kernel before it had finished: correct,
    but outside the overlap; and a kernel given launch_pdl without its PDL constexpr would touch
    memory before the launch before it had finished."""
    launches = list(_launches())
    assert len(launches) >= 20
    missing = [(name, line) for name, line, src in launches if "pdl(" not in src]
    assert not missing, missing


def _kernels():
    """Every @triton.jit function of kvslim/gpu's kernel modules that takes a PDL parameter:
    (module, function node)."""
    for path in sorted(GPU.glob("_*_kernel.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                yield path.stem, node


# What a kernel may call before its wait: its program's indices, and the L2 prefetch of weights no
# launch writes (``_prefetch_tile``: the dense GEMV's, session 50). Nothing that reads or writes memory.
BEFORE_WAIT = {"tl.program_id", "tl.arange", "tl.minimum", "tl.cdiv", "_prefetch_tile"}


def test_every_pdl_kernel_waits_first():
    """Each kernel's statements before ``after_previous(PDL)`` (its first, but for index
    arithmetic and a weights prefetch) call nothing else; and it waits once."""
    kernels = list(_kernels())
    assert len(kernels) >= 20
    for module, node in kernels:
        body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body        # past the docstring
        waits = [i for i, stmt in enumerate(body) if ast.unparse(stmt) == "after_previous(PDL)"]
        assert len(waits) == 1, (module, node.name)
        calls = {ast.unparse(call.func) for stmt in body[:waits[0]] for call in ast.walk(stmt)
                 if isinstance(call, ast.Call)}
        assert calls <= BEFORE_WAIT, (module, node.name, calls - BEFORE_WAIT)


def _memory_before_wait(ptx: str) -> list[str]:
    """The global memory instructions of a PTX listing that come before its griddepcontrol.wait."""
    wait = ptx.index("griddepcontrol.wait")
    return re.findall(r"\b(?:ld|st|atom|red|cp\.async)\.global[\w.]*", ptx[:wait])


def _cases():
    """(kernel module, function, pointers, constexprs, warps) of a decode step's launches, from their
    compile tests."""
    from . import test_gpu_delta_step, test_triton_append, test_triton_prefill, test_triton_weights
    q4_0 = weights.get("q4_0").ggml_type
    gemv = quant_matmul.gemv_config(1, q4_0)
    fmt_k, fmt_v = formats.get("turbo4", role="k"), formats.get("turbo4", role="v")
    attend = paged_prefill._launch_config(fmt_k, fmt_v, 8, 256)
    fmt = formats.get("turbo4", role="v")
    append = kv_append.kernel_config(kv_append._launch_config(fmt.kernel_encoder(256), 256, fmt.row_bytes(256)), 2, 16)
    gemv_pointers = dict(test_triton_weights.POINTERS, x_ptr="*bf16", y_ptr="*bf16", parts_ptr="*fp32",
                         count_ptr="*i32")
    return [
        ("_delta_step_kernel", "delta_step", test_gpu_delta_step.POINTERS,
         {**test_gpu_delta_step.STEP, **test_gpu_delta_step.NORM, **test_gpu_delta_step.CONV}, 1),
        ("_quant_matmul_kernel", "quant_gemv", gemv_pointers,
         {**{k: v for k, v in gemv.items() if k != "num_warps"}, "TYPE": int(q4_0), "LAST_SUMS": True}, 4),
        ("_paged_prefill_kernel", "paged_prefill_tile", test_triton_prefill.POINTERS,
         {k: v for k, v in attend.items() if k != "num_warps"}, attend["num_warps"]),
        ("_kv_append_kernel", "kv_append_rows", test_triton_append.POINTERS,
         {k: v for k, v in append.items() if k != "num_warps"}, append["num_warps"]),
    ]


@needs_triton
@pytest.mark.parametrize("case", range(4), ids=["delta_step", "quant_gemv", "paged_prefill_tile", "kv_append_rows"])
def test_a_pdl_kernel_touches_no_memory_before_its_wait(case):
    """Compiled for sm_90 with PDL, a decode step's kernels (the DeltaNet step with its conv and
    norm, the split GEMV with its last program's sums, the attention tile kernel, the turbo
    append) issue griddepcontrol.wait before any global load, store or atomic, and let the next
    launch start; without PDL, neither instruction."""
    module, name, pointers, constexprs, warps = _cases()[case]
    kernel = getattr(kvslim.gpu.kernels(module), name)
    ptx = compile_for_sm90(kernel, pointers, {**constexprs, "PDL": True}, warps).asm["ptx"]
    assert "griddepcontrol.launch_dependents" in ptx
    assert _memory_before_wait(ptx) == []
    plain = compile_for_sm90(kernel, pointers, constexprs, warps).asm["ptx"]
    assert "griddepcontrol" not in plain
