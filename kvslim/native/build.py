"""Compile a C file of this package into a shared library once, and load it.

ctypes rather than a torch extension: a plain C file builds in a second, where one that
includes torch's headers takes a minute. The library is keyed by a hash of the source
(and of the files it includes: every C file here) and the compiler, so an edit rebuilds it, and is written to a temporary name first, so
concurrent first uses never load half a file.
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

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
VARIANTS = {                  # the tests hold every build the machine can run to the same results
    "native": FLAGS,
    "avx2": FLAGS + ["-mno-avx512f"],                      # the AVX2 paths where the machine has AVX-512
    "portable": ["-O2", "-fopenmp", "-shared", "-fPIC"],   # no AVX paths: the plain C loops
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvslim" / "native"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def enabled() -> bool:
    return os.environ.get("KVSLIM_NATIVE", "1") != "0"


def default_variant() -> str:
    """``KVSLIM_NATIVE_BUILD`` (a key of VARIANTS) or "native": the AVX2 or plain loops can be
    timed on a machine that has AVX-512, as a user without it would run them."""
    name = os.environ.get("KVSLIM_NATIVE_BUILD", "native")
    if name not in VARIANTS:
        raise ValueError(f"KVSLIM_NATIVE_BUILD={name!r}: expected one of {', '.join(VARIANTS)}")
    return name


@lru_cache(maxsize=None)
def library(source_name: str, variant: str | None = None) -> ctypes.CDLL | None:
    """The loaded library built from ``source_name`` (a .c file beside this module), or None
    (``KVSLIM_NATIVE=0``, no compiler, or a failed build). ``variant``: a key of VARIANTS
    (default: ``default_variant()``); the tests build "avx2" and "portable" too, so every path
    of the C files is checked."""
    cc = compiler()
    if not enabled() or cc is None:
        return None
    flags = VARIANTS[variant or default_variant()]
    source = Path(__file__).with_name(source_name)
    text = b"".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.c"))])  # includes too
    digest = hashlib.sha256(text + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"kvslim_{source.stem}_{digest}.so"
    if not target.exists() and not _build(cc, flags, source, target):
        return None
    return ctypes.CDLL(str(target))


def _build(cc: str, flags: list[str], source: Path, target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    done = subprocess.run([cc, *flags, str(source), "-o", str(partial)], capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return False
    partial.replace(target)
    return True


def clear() -> None:
    """Forget loaded libraries (tests flip ``KVSLIM_NATIVE``)."""
    library.cache_clear()
