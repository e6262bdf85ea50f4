"""The fused block GEMV of ``native.c``: built on first use, called through ctypes.

Decode multiplies one (or a few) activation rows by every weight matrix; dequantizing
W's blocks in torch writes each block out as float32 and reads it back, which is most of
a quantized decode step (docs in ``matmul.py``). ``native.c`` reads each block once and
unpacks it in registers. It is compiled with the machine's C compiler into
``~/.cache/kvslim/native/`` (keyed by the source's hash, so an edit rebuilds it);
``available()`` is False without a compiler or when ``KVSLIM_NATIVE=0``, and callers
then keep the torch path. ctypes rather than a torch extension: a plain C file builds in
a second, where one that includes torch's headers takes a minute.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.c")
TYPE_CODES = {"q8_0": 8, "q4_0": 4}          # the block types native.c implements
MAX_ROWS = 8                                 # more activation rows: torch's matmul over decoded steps wins


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvslim" / "native"


@lru_cache(maxsize=None)
def _library():
    """The loaded shared library, or None (no compiler, a failed build, or KVSLIM_NATIVE=0)."""
    if os.environ.get("KVSLIM_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + compiler.encode()).hexdigest()[:16]
    target = cache_dir() / f"kvslim_native_{digest}.so"
    if not target.exists() and not _build(compiler, target):
        return None
    lib = ctypes.CDLL(str(target))
    lib.kvslim_block_linear.restype = ctypes.c_int
    lib.kvslim_block_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


def _build(compiler: str, target: Path) -> bool:
    """Compile into a temporary file, then rename: concurrent first uses never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", str(partial)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return False
    partial.replace(target)
    return True


def available() -> bool:
    return _library() is not None


def supports(wtype_name: str, x: torch.Tensor) -> bool:
    """Whether ``block_linear`` serves this weight type and activation (float32 CPU, few rows)."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (wtype_name in TYPE_CODES and x.device.type == "cpu" and x.dtype == torch.float32
            and 0 < rows <= MAX_ROWS and available())


def block_linear(x: torch.Tensor, blocks: torch.Tensor, wtype_name: str) -> torch.Tensor:
    """x (m, k) float32 @ W.T for W (n, row_bytes) uint8 blocks of ``wtype_name`` -> (m, n)."""
    x = x.contiguous()
    blocks = blocks.contiguous()
    m, k = x.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    status = _library().kvslim_block_linear(TYPE_CODES[wtype_name], x.data_ptr(), blocks.data_ptr(), y.data_ptr(),
                                            m, n, k, torch.get_num_threads())
    if status:
        raise ValueError(f"native block_linear refused {wtype_name} with {k} input features")
    return y
