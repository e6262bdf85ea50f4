"""Compile a C file of this package into a shared library once, and load it.

ctypes rather than a torch extension: a plain C file builds in a second, where one that
includes torch's headers takes a minute. The library is keyed by a hash of the source, of the
files it includes (every C file here, and the headers made at build time from data the
dependencies hold: the i-quants' grids) and of the compiler, so an edit rebuilds it; it is
written to a temporary name first, so concurrent first uses never load half a file.

Where the compiler lacks what FLAGS asks (Apple's clang has no OpenMP; some compilers refuse
-march=native), ``fallbacks`` builds with less, says so once, and keeps the reason beside the
library (``NOTES``); a build that fails every way leaves its reason in ``why_not``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
VARIANTS = {                  # the tests hold every build the machine can run to the same results
    "native": FLAGS,
    "avx2": FLAGS + ["-mno-avx512f", "-mno-avxvnni"],      # the AVX2 paths (no VNNI) where the machine has more
    # no AVX paths and no _Float16: the plain C loops and half.c's software conversions, as an
    # older compiler (clang 14 on x86) builds them
    "portable": ["-O2", "-fopenmp", "-DKVSLIM_SOFT_HALF", "-shared", "-fPIC"],
}


def traced_as_constant(fn):
    """What ``torch._dynamo.assume_constant_result`` does (a traced call of ``fn`` is made once
    and its result kept as a constant: no graph break at a ctypes call), without importing
    torch._dynamo, which every kvslim process's start paid (import kvslim.loading: 3.4-3.9 s to
    2.8-3.4 s wall, medians of 5 on 2 busy cores; tests/test_imports.py
    holds the two to the same mark)."""
    fn._dynamo_marked_constant = True
    return fn


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
    (``KVSLIM_NATIVE=0``, no compiler, or a failed build: ``why_not(source_name)`` says which).
    ``variant``: a key of VARIANTS (default: ``default_variant()``); the tests build "avx2" and
    "portable" too, so every path of the C files is checked."""
    cc = compiler()
    if not enabled() or cc is None:
        NOTES[source_name] = "KVSLIM_NATIVE=0" if not enabled() else "no C compiler (cc, gcc or clang; or set CC)"
        return None
    flags = VARIANTS[variant or default_variant()]
    source = Path(__file__).with_name(source_name)
    text = b"".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.c"))])  # includes too
    include = include_dir()
    text += include.name.encode()                        # the generated headers' digest
    digest = hashlib.sha256(text + cc.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"kvslim_{source.stem}_{digest}.so"
    note = target.with_suffix(".note")                  # a fallback's reason, kept beside its library
    if not target.exists() and not _build(cc, flags, source, target, note, source_name, include):
        return None
    if note.exists() and source_name not in NOTES:
        NOTES[source_name] = note.read_text()
    return ctypes.CDLL(str(target))


# Why a library was built with fewer flags than asked, or not at all, by source name.
NOTES: dict[str, str] = {}
_WARNED: set[str] = set()


def why_not(source_name: str) -> str:
    """Why ``library(source_name)`` returned None (after it did)."""
    return NOTES.get(source_name, "the C build failed")


def fallbacks(flags: list[str]) -> list[list[str]]:
    """The flag sets tried in turn. Apple's clang refuses -fopenmp (OpenMP needs Homebrew's
    libomp there): the kernels then build single-threaded (the pragmas are ignored; the C code
    calls no omp_* function) rather than leaving the CPU to the torch steps, 5-10x slower.
    A compiler that refuses -march=native drops it too."""
    tries = [flags]
    omp = homebrew_libomp()
    if omp is not None and "-fopenmp" in flags:         # Apple's clang takes OpenMP this way
        tries.append([f for f in flags if f != "-fopenmp"]
                     + ["-Xpreprocessor", "-fopenmp", f"-I{omp}/include", f"-L{omp}/lib", "-lomp"])
    for dropped in ({"-march=native"}, {"-fopenmp"}, {"-march=native", "-fopenmp"}):
        fewer = [f for f in flags if f not in dropped]
        if fewer not in tries:
            tries.append(fewer)
    return tries


def homebrew_libomp(roots=("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp")) -> str | None:
    """Homebrew's libomp on a Mac (``brew install libomp``; Apple silicon's prefix, then Intel's),
    or None."""
    if sys.platform != "darwin":
        return None
    return next((root for root in roots if Path(root, "include", "omp.h").exists()), None)


@lru_cache(maxsize=None)                                 # 7 ms of text, the same for every library
def generated_headers() -> dict[str, str]:
    """Headers made at build time from data kvslim's dependencies hold, by file name: the
    i-quants' lattices (thousands of entries) come from gguf.quants, as the torch decoders'
    do, instead of a second copy kept in this folder."""
    from . import lattices                                # imports gguf: only when a library builds
    return {"iq_grids.h": lattices.c_header()}


def include_dir() -> Path:
    """The folder of ``generated_headers()`` (an -I of every build), named by their digest and
    written once through temporary names."""
    headers = generated_headers()
    digest = hashlib.sha256("".join(name + text for name, text in sorted(headers.items())).encode()).hexdigest()[:16]
    folder = cache_dir() / f"include_{digest}"
    for name, text in headers.items():
        path = folder / name
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
                tmp.write(text)
            Path(tmp.name).replace(path)
    return folder


def _build(cc: str, flags: list[str], source: Path, target: Path, note: Path, source_name: str,
           include: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for attempt in fallbacks(flags):
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        done = subprocess.run([cc, *attempt, f"-I{include}", str(source), "-o", str(partial)], capture_output=True,
                              text=True)
        if done.returncode == 0:
            if errors:
                dropped = " ".join(f for f in flags if f not in attempt)
                text = f"built without {dropped} ({errors[0]})" + \
                    ("; one thread: install an OpenMP runtime (libomp) for more" if "-fopenmp" in dropped else "")
                note.write_text(text)
                NOTES[source_name] = text
                if text not in _WARNED:                     # once a process, not once per C file
                    _WARNED.add(text)
                    warnings.warn(f"kvslim: the C kernels were {text}", stacklevel=3)
            partial.replace(target)
            return True
        partial.unlink(missing_ok=True)
        errors.append(_first_error(done.stderr) or f"{cc} exited {done.returncode}")
    NOTES[source_name] = f"the C build failed: {errors[0]}"
    return False


def _first_error(stderr: str) -> str:
    """The compiler's or linker's first complaint (what a user can act on): "unsupported option
    '-fopenmp'", "cannot find -lomp"."""
    marks = ("error", "cannot find", "unsupported", "not supported")
    lines = [line.strip() for line in stderr.splitlines() if any(m in line.lower() for m in marks)]
    return (lines or [""])[0][:200]


def clear() -> None:
    """Forget loaded libraries and their notes (tests flip ``KVSLIM_NATIVE``)."""
    library.cache_clear()
    NOTES.clear()
