"""GPU kernels (Triton, and fla-core's for DeltaNet), beside the torch paths and C kernels they mirror.

``paged_prefill`` / ``paged_decode``: attention on the packed pages (one kernel); ``kv_append``:
new K/V rows encoded into the pool; ``quant_matmul``: GGUF weights' GEMV/GEMM; ``delta_rule``:
fla-core's chunked gated delta rule (prompts) and gated norm; ``delta_step``: the DeltaNet
decode step on the cache's states in place; ``conv_step``: the DeltaNet conv's decode step;
``swiglu``: silu(gate) * up and the attention's output gate; ``moe``: a mixture's routing and
its outputs' sum; ``rope``: an attention layer's q/k norm and rotation; ``add_norm``: a residual
add and the norm after it; ``rotation``: the K/V formats' row rotations, q into a rotated K's
code domain and the output out of a rotated V's. The last seven fold a decode step's small
torch launches into one each. Nothing here imports triton until a kernel runs, so kvslim imports without it; each
kernel module says whether it can serve a call (``supports`` or ``runs_on``) and has a torch
reference it is tested against (tests/test_triton_*.py and tests/test_gpu_*.py, under Triton's
CPU interpreter; docs/gpu.md).
"""
import importlib
import os
import re
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

# Whether the kernels (these and fla-core's) serve where they can. Off by default: session 30's
# GPU runs (docs/gpu.md) held the attention kernel to the torch loop, but it decodes 5-28x slower
# than f16 SDPA, and the other kernels' CUDA parity is not yet shown whole; KVSLIM_TRITON=1 turns
# them on. Benchmarks flip it in-process to time both paths.
TRITON = os.environ.get("KVSLIM_TRITON", "0") == "1"

# Programmatic dependent launch (Hopper and later; vLLM's and TensorRT-LLM's decode use it): each
# decode kernel waits for the launch before it (``_codecs.after_previous``, its first statement)
# and lets the next one launch at once, so a launch's setup and its programs' start overlap the
# previous kernel's tail, where a stream (and a CUDA graph's chain) starts a kernel only once the
# one before has finished. Off until a lease times it: KVSLIM_GPU_PDL=1, or gpu_model.py --pdl.
PDL = os.environ.get("KVSLIM_GPU_PDL", "0") == "1"

# The decode GEMVs' weights asked of L2 when a program starts (``_codecs.prefetch_rows``): a
# program's loop reads its chunks one round trip each, and at a decode step's few programs an SM
# that left DRAM idle between them; with the whole tile requested at once, the loop's reads wait on
# L2. With PDL, before the wait: the weights are read-only, so their fetch overlaps the previous
# kernel. Off until a lease times it: KVSLIM_GPU_L2_PREFETCH=1, or gpu_model.py --l2-prefetch.
L2_PREFETCH = os.environ.get("KVSLIM_GPU_L2_PREFETCH", "0") == "1"

# Triton fuses a * b + c into one FMA unless a launch says otherwise, and Triton 3.9 warns that
# 3.10 will stop doing so by default (TRITON_DEFAULT_FP_FUSION). The kernels' parity and their
# sm_90 figures were taken with fusion, so every launch asks for it by name (the append kernel,
# which must round as torch does, asks for none) instead of inheriting the installed default.
FP_FUSION = {"enable_fp_fusion": True}


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether triton imports (it is not a dependency of kvslim)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=None)
def kernels(name: str):
    """The kernel module ``kvslim.gpu.<name>``, imported when a kernel first runs (it imports triton)."""
    return importlib.import_module(f"{__name__}.{name}")


def serves(name: str, device: torch.device) -> bool:
    """Whether the kernels of ``kvslim.gpu.<name>`` run on ``device`` here: triton imports and
    the module's kernels were decorated for that device (``runs_on``)."""
    return available() and runs_on(kernels(name), device)


def pdl(device: torch.device) -> dict:
    """A launch's programmatic-dependent-launch options under ``PDL`` on a CUDA device of compute
    capability 9 or more: the kernel's PDL constexpr (its wait for the launch before) and Triton's
    launch_pdl; else none (the kernels' PDL defaults to False, which the interpreter, running no
    PTX, needs)."""
    if not PDL or device.type != "cuda" or _capability(device.index) < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


def l2_prefetch(device: torch.device) -> dict:
    """A GEMV launch's L2_PREFETCH constexpr under ``L2_PREFETCH`` on a CUDA device (PTX's
    prefetch.global.L2, any compute capability); else none (the interpreter runs no PTX)."""
    return {"L2_PREFETCH": True} if L2_PREFETCH and device.type == "cuda" else {}


@lru_cache(maxsize=None)
def _capability(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): Triton's block shapes."""
    return 1 << max(0, n - 1).bit_length()


def counters(n: int, device) -> torch.Tensor:
    """int32 counters (at least n, all 0) by which the programs of a launch find the last of a
    group to finish (the GEMVs' split sums and combine, the DeltaNet step's norm), each set
    back to 0 by that last program: one set per device and power of two, shared by the
    launches of one stream, which run one after another."""
    from ..formats.base import cached_on          # at use: kvslim.gpu imports nothing of kvslim at load
    size = pow2(max(n, 1024))
    return cached_on(device, ("kernel counters", size), lambda: torch.zeros(size, dtype=torch.int32))


def runs_on(kernel_module, device: torch.device) -> bool:
    """Whether a kernel module's kernels run on ``device`` here: compiled ones on CUDA tensors,
    interpreted ones (TRITON_INTERPRET=1, numpy) on CPU tensors. Triton fixes which when a
    kernel is decorated: the module's ``INTERPRETED``; ``RUNNABLE`` says whether triton.language's
    own functions (decorated when triton was first imported) agree with it."""
    return kernel_module.RUNNABLE and device.type == ("cpu" if kernel_module.INTERPRETED else "cuda")


def compile_sm90(fn, pointers: dict[str, str], constexprs: dict, divisible: tuple = (), capability: int = 90,
                 **options):
    """Compile the @triton.jit ``fn`` for an H100/H200 (sm_90) without a GPU, through Triton's
    compiler and the ptxas in its wheel: arguments named in ``pointers`` take those types
    ("*u8", "*fp32", ...; "fp32" for a float scalar), those in ``constexprs`` their values, the
    rest are i32; ``options`` as a launch's (num_warps, num_stages; FMA fusion on unless one says
    otherwise). As a launch specialises them, the pointers are known
    16-byte aligned (torch's allocations are) and the ints named in ``divisible`` multiples of
    16 (a launch marks every int argument that is one): without that, the compiler cannot prove
    runs of bytes aligned and vectorises no load. Constexprs left out take their defaults, as
    in a launch (else they would compile as runtime ints). ImportError where triton has no CUDA backend.
    The kernel tests use it to catch what the interpreter accepts and the compiler refuses;
    benchmarks/gpu_resources.py to read a launch's registers and shared memory. ``capability``:
    another target, such as the RTX cards' 86 (3090), 89 (4090) or 120 (5090)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (ImportError without it)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if pointers.get(name, "").startswith("*") or name in divisible}
    source = triton.compiler.ASTSource
    if getattr(fn, "is_gluon", lambda: False)():                     # a Gluon kernel (_decode_mma_kernel)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", capability, 32),
                          options={**FP_FUSION, **options})


def cuobjdump(compiled, flag: str) -> str:
    """What ``cuobjdump <flag>`` (from Triton's wheel) prints for a ``compile_sm90`` result's
    cubin: ``-res-usage`` for ptxas's registers and stack, ``-sass`` for its instructions."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled) -> dict[str, int]:
    """ptxas's figures for a ``compile_sm90`` result's threads: REG (registers) and STACK
    (bytes of register spills, which PTX does not show), the largest over its functions."""
    usage = cuobjdump(compiled, "-res-usage")
    return {key: max(int(n) for n in re.findall(rf"\b{key}:(\d+)", usage)) for key in ("REG", "STACK")}


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")


def _loop(sass: str) -> list[tuple[str, str]]:
    """(opcode, operands) of the longest loop in cuobjdump's SASS: the addresses from a backward
    branch's target to the branch."""
    code = [(int(a, 16), op, rest) for a, op, rest in _SASS_LINE.findall(sass)]
    loops = [(int(t, 16), int(a, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA[^;]*?0x([0-9a-f]+)", sass)
             if int(t, 16) < int(a, 16)]
    if not loops:
        return []
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return [(op, rest) for at, op, rest in code if first <= at <= last]


def loop_ops(sass: str) -> list[str]:
    """The opcodes of the longest loop in cuobjdump's SASS (``cuobjdump(compiled, "-sass")``).
    What a kernel's step costs (benchmarks/gpu_resources.py) and what it must not hold (the
    tests: no barrier in a step)."""
    return [op for op, _ in _loop(sass)]


def load_leads(sass: str) -> list[int]:
    """For each global load (LDG) in the longest loop of cuobjdump's SASS, how many instructions
    come before the first that reads a register it wrote (around the loop's back edge for a load
    the next step uses). A load's wait is hidden only where its lead outlasts memory's latency
    (several hundred cycles), or other warps issue meanwhile: the few-warp decode kernels' loads
    need long leads. Read from the registers named, so a rough measure: predicates and register
    pairs named by their first half (R4.64) are taken as they read."""
    body = _loop(sass)
    leads = []
    for i, (op, rest) in enumerate(body):
        wrote = _loaded(op, rest)
        if not wrote:                                           # not a load, or one to RZ: nothing waits on it
            continue
        for lead, (_, later) in enumerate(body[i + 1:] + body[:i + 1], 1):
            if _reads(later, wrote):
                leads.append(lead)
                break
    return leads


def load_waves(sass: str) -> int:
    """How many times a loop-free kernel (cuobjdump's SASS, in order) stops on memory: walking its
    instructions, each that reads a register a global load wrote, while loads are outstanding,
    ends a wave (all outstanding loads taken as arrived). A kernel whose loads all go out before
    the first is read waits one round trip; one that loads, uses, loads again waits one per wave.
    Rough, as ``load_leads``."""
    waves, pending = 0, []
    for _, op, rest in _SASS_LINE.findall(sass):
        if pending and _reads(rest, pending):
            waves, pending = waves + 1, []
        pending += _loaded(op, rest)
    return waves


def _loaded(op: str, rest: str) -> list[str]:
    """The registers a global load (LDG) writes, R4 .. R7 for a 128-bit one; [] for anything else."""
    dest = re.match(r"\s*R(\d+)", rest) if op.startswith("LDG") else None
    width = 4 if ".128" in op else 2 if ".64" in op else 1
    return [f"R{int(dest.group(1)) + j}" for j in range(width)] if dest else []


def _reads(operands: str, registers: list[str]) -> bool:
    """Whether an instruction's operands read any of ``registers``: its sources, or the address of
    its first operand (a store's)."""
    named = re.compile(r"\b(" + "|".join(registers) + r")\b")
    return bool(named.search(operands.partition(",")[2]) or named.search(operands.partition(",")[0].partition("[")[2]))
