"""llama.cpp as a peer: the engine kvslim is compared with, run in-process.

Two bindings are accepted, tried in this order:

- ``llama-cpp-py-sync`` 0.11739 (``pip install 'kvslim[peer]'``): llama.cpp tag b11739
  as prebuilt CPU libraries with CFFI bindings; installs in seconds. Its libraries are
  linked against glibc 2.38 for four C23 functions only (``__isoc23_strtol``,
  ``__isoc23_strtoul``, ``__isoc23_strtoull``, ``__isoc23_sscanf``). Where the system
  glibc is older (Debian 12: 2.36) they do not load as installed, so at first use
  ``prepare_libraries`` makes a private copy in a cache folder: the copies' need for
  ``GLIBC_2.38`` is marked weak (an ELF flag the dynamic loader honours, so a missing
  version is no longer fatal) and a small shim, compiled with the machine's C compiler,
  defines the four symbols by forwarding to ``strtol``/``strtoul``/``strtoull``/
  ``vsscanf``. The installed package is never modified. (The C23 variants differ from
  the classic ones only in accepting ``0b`` binary literals, which llama.cpp does not
  parse.) The cache folder is ``$KVSLIM_CACHE`` or ``~/.cache/kvslim``.
- ``llama-cpp-python`` (``import llama_cpp``), which builds llama.cpp from source (PyPI
  has no wheel; no extra installs it). ``tests/test_peer.py`` runs this fallback where it
  is installed and is skipped, with that reason, elsewhere.

``open_peer(path, ...)`` returns a ``PeerContext`` with the same narrow interface on
either binding: tokenize, evaluate tokens (logits of the last or of every position),
greedy decoding, state save / restore, reset. ``quantize`` runs llama.cpp's own
quantizer (llama-quantize).
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PY_SYNC = "llama_cpp_py_sync"
PY_SYNC_TAG = "b11739"
C23_SYMBOLS = ("__isoc23_strtol", "__isoc23_strtoul", "__isoc23_strtoull", "__isoc23_sscanf")
NEEDED_GLIBC = (2, 38)
SHIM_NAME = "libkvslim_c23.so"

SHIM_SOURCE = r"""
/* C23 names glibc 2.38 added, forwarded to the classic functions (kvslim.peer). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
long __isoc23_strtol(const char *s, char **end, int base) { return strtol(s, end, base); }
unsigned long __isoc23_strtoul(const char *s, char **end, int base) { return strtoul(s, end, base); }
unsigned long long __isoc23_strtoull(const char *s, char **end, int base) { return strtoull(s, end, base); }
int __isoc23_sscanf(const char *s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsscanf(s, fmt, ap);
    va_end(ap);
    return n;
}
"""
# The shim's symbols carry the version the libraries ask for, so the loader matches them.
SHIM_VERSION_SCRIPT = "GLIBC_2.38 { global: %s; local: *; };\n" % "; ".join(C23_SYMBOLS)


class PeerUnavailable(RuntimeError):
    """No usable llama.cpp binding on this machine; the message says what to install."""


# ----- glibc compatibility of the prebuilt libraries ------------------------------------
def glibc_version() -> tuple[int, int] | None:
    """The running glibc as (major, minor), or None off glibc."""
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def cache_root() -> Path:
    return Path(os.environ.get("KVSLIM_CACHE") or Path.home() / ".cache" / "kvslim")


_SHT_GNU_VERNEED = 0x6FFFFFFE
_VER_FLG_WEAK = 0x2


def weaken_version_need(path: Path, version: str) -> int:
    """Mark every need of symbol ``version`` (e.g. GLIBC_2.38) in an ELF64 library as weak.

    Edits the ``vna_flags`` of the matching Vernaux entries of ``.gnu.version_r`` in place;
    returns how many entries were changed (0: the file never asked for ``version``).
    """
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    changed = 0
    for sec in sections:
        if sec[1] != _SHT_GNU_VERNEED:
            continue
        strtab = sections[sec[6]][4]                         # sh_link -> .dynstr, its sh_offset
        changed += _weaken_in_verneed(data, sec[4], strtab, version.encode())
    if changed:
        path.write_bytes(bytes(data))
    return changed


def _weaken_in_verneed(data: bytearray, offset: int, strtab: int, version: bytes) -> int:
    """Walk Elf64_Verneed (vn_version, vn_cnt, vn_file, vn_aux, vn_next) and their
    Elf64_Vernaux (vna_hash, vna_flags, vna_other, vna_name, vna_next) entries."""
    changed = 0
    while True:
        _, count, _, aux, following = struct.unpack_from("<HHIII", data, offset)
        at = offset + aux
        for _ in range(count):
            _, flags, _, name, step = struct.unpack_from("<IHHII", data, at)
            end = data.index(b"\0", strtab + name)
            if bytes(data[strtab + name:end]) == version:
                struct.pack_into("<H", data, at + 4, flags | _VER_FLG_WEAK)
                changed += 1
            at += step
        if not following:
            return changed
        offset += following


def compile_shim(out: Path) -> Path:
    """Build the C23 forwarding shim with the machine's C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise PeerUnavailable("llama-cpp-py-sync needs glibc 2.38 or a C compiler (cc/gcc) to build its "
                              "four-symbol compatibility shim; install gcc, or use llama-cpp-python")
    src, script = out.with_suffix(".c"), out.with_suffix(".map")
    src.write_text(SHIM_SOURCE)
    script.write_text(SHIM_VERSION_SCRIPT)
    cmd = [cc, "-shared", "-fPIC", "-O2", f"-Wl,--version-script={script}", "-o", str(out), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerUnavailable(f"compiling the glibc shim failed ({' '.join(cmd)}):\n{done.stderr}")
    return out


def prepare_libraries(package_dir: Path, version: str) -> Path:
    """The folder of loadable copies of the package's libraries plus the shim (built once)."""
    target = cache_root() / f"llama-cpp-py-sync-{version}"
    if (target / SHIM_NAME).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    for lib in package_dir.glob("*.so*"):
        shutil.copy2(lib, work / lib.name)
        weaken_version_need(work / lib.name, "GLIBC_%d.%d" % NEEDED_GLIBC)
    compile_shim(work / SHIM_NAME)
    try:
        work.rename(target)                                 # atomic: a concurrent builder may win
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return target


# ----- loading the bindings -------------------------------------------------------------
_BINDING = None


def binding():
    """The llama.cpp binding in use: a ``_PySync`` or ``_LlamaCppPython`` (loaded once)."""
    global _BINDING
    if _BINDING is None:
        _BINDING = _load_binding()
    return _BINDING


def available() -> bool:
    try:
        binding()
        return True
    except PeerUnavailable:
        return False


def _load_binding():
    errors = []
    for loader in (_PySync, _LlamaCppPython):
        try:
            return loader()
        except PeerUnavailable as err:
            errors.append(str(err))
    raise PeerUnavailable("no llama.cpp peer: " + "; ".join(errors))


def describe() -> str:
    """One line naming the binding and llama.cpp build, for benchmark headers."""
    return binding().name


def cache_types() -> list[str]:
    """The K/V cache types llama.cpp b11739 has under kvslim's names: the float types and the
    ggml blocks (rotated, as llama.cpp rotates them by default). TurboQuant, the nl grids and
    the -norot spellings are kvslim's own."""
    from . import formats
    from .formats.ggml import NOROT
    return [s.name for s in formats.TABLE if s.family in ("float", "ggml") and not s.name.endswith(NOROT)]


def check_cache_types(names) -> None:
    """ValueError naming the first of ``names`` (type names, or K/V pairs "k/v") that llama.cpp
    lacks, before a side-by-side spends minutes on kvslim's half."""
    known = cache_types()
    for name in names:
        for t in str(name).split("/"):
            if t not in known:
                raise ValueError(f"llama.cpp has no K/V cache type {t!r} (it has {', '.join(known)}); "
                                 f"kvslim-only types are timed with kvslim bench")


def open_peer(path: str | Path, n_ctx: int = 4096, type_k: str = "f16", type_v: str = "f16",
              n_threads: int = 2, n_batch: int = 512, flash_attn: bool = True,
              all_logits: bool = False) -> "PeerContext":
    """llama.cpp's model and context for a GGUF file.

    Args: ``type_k``/``type_v`` are ggml type names (f16, q8_0, q4_0, ...); ``flash_attn``
    is llama.cpp's -fa (quantized V needs it); ``all_logits`` keeps every position's logits.
    """
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such GGUF file")
    return binding().open(Path(path), n_ctx, type_k, type_v, n_threads, n_batch, flash_attn, all_logits)


def quantize(src: str | Path, dst: str | Path, ftype: str, n_threads: int = 2,
             imatrix: dict[str, np.ndarray] | None = None) -> Path:
    """llama-quantize: ``ftype`` is a llama.cpp file type such as q4_k_m, q6_k, iq2_xxs.
    ``imatrix``: an importance per input column for each tensor name (experts: their columns,
    expert after expert), as llama-imatrix's file holds; llama.cpp refuses IQ1, IQ2 and IQ3_XXS
    without one."""
    return binding().quantize(Path(src), Path(dst), ftype, n_threads, imatrix)


def quantize_types(src: str | Path, ftype: str, imatrix: dict[str, np.ndarray] | None = None) -> dict[str, str]:
    """The type llama-quantize would give each tensor of ``src`` for ``ftype`` (its dry run: the
    same choice of types, nothing quantized or written), as {tensor name: ggml type name}."""
    quantize_types_of = getattr(binding(), "quantize_types", None)
    if quantize_types_of is None:
        raise PeerUnavailable("llama-quantize's dry run needs llama-cpp-py-sync's binding")
    return quantize_types_of(Path(src), ftype, imatrix)


class PeerContext:
    """A llama.cpp context with a position counter; subclasses speak to one binding."""

    n_vocab: int
    n_past: int = 0

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        raise NotImplementedError

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Append ``tokens``; returns logits (n, vocab) for every position with ``all_logits``,
        else (1, vocab) for the last one."""
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def save_state(self) -> tuple[bytes, int]:
        raise NotImplementedError

    def load_state(self, state: tuple[bytes, int]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def greedy(self, prompt: list[int], n: int, stop: set[int] = frozenset()) -> list[int]:
        """Greedy tokens after ``prompt`` (from an empty context), at most ``n``, ending at ``stop``."""
        self.reset()
        logits, out = self.eval(list(prompt)), []
        while len(out) < n:
            tok = int(np.argmax(logits[-1]))
            if tok in stop:
                break
            out.append(tok)
            logits = self.eval([tok])
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----- llama-cpp-py-sync (CFFI, raw C API) -----------------------------------------------
class _PySync:
    def __init__(self):
        try:
            import llama_cpp_py_sync
            from llama_cpp_py_sync import _cffi_bindings as cffi_mod
        except ImportError:
            raise PeerUnavailable("llama-cpp-py-sync is not installed (pip install 'kvslim[peer]')") from None
        libc = glibc_version()
        if libc is not None and libc < NEEDED_GLIBC:
            folder = prepare_libraries(Path(cffi_mod.__file__).parent, llama_cpp_py_sync.__version__)
            ctypes.CDLL(str(folder / SHIM_NAME), mode=ctypes.RTLD_GLOBAL)
            cffi_mod._find_library = lambda: str(folder / "libllama.so")
        try:
            self.lib, self.ffi = cffi_mod.get_lib(), cffi_mod.get_ffi()
        except RuntimeError as err:
            raise PeerUnavailable(f"llama-cpp-py-sync does not load: {err}") from None
        self.name = f"llama.cpp {llama_cpp_py_sync.__llama_cpp_tag__} (llama-cpp-py-sync {llama_cpp_py_sync.__version__})"
        self._quiet = self.ffi.callback("void(enum ggml_log_level, const char *, void *)", _drop_log)
        self.lib.llama_log_set(self._quiet, self.ffi.NULL)
        self.lib.llama_backend_init()

    def open(self, path, n_ctx, type_k, type_v, n_threads, n_batch, flash_attn, all_logits):
        return _PySyncContext(self, path, n_ctx, type_k, type_v, n_threads, n_batch, flash_attn, all_logits)

    def constant(self, prefix: str, name: str) -> int:
        try:
            return getattr(self.lib, f"{prefix}{name.upper()}")
        except AttributeError:
            raise ValueError(f"llama.cpp has no {prefix}{name.upper()}") from None

    def quantize(self, src: Path, dst: Path, ftype: str, n_threads: int, imatrix=None, dry_run=False) -> Path:
        params = self.lib.llama_model_quantize_default_params()
        params.ftype = self.constant("LLAMA_FTYPE_MOSTLY_", ftype)
        params.nthread = n_threads
        params.dry_run = dry_run
        pp = self.ffi.new("struct llama_model_quantize_params *", params)
        keep = []                                # the C strings and arrays live until the call returns
        if imatrix:                              # an array of {name, data, size}, ended by a NULL name
            entries = self.ffi.new("struct llama_model_imatrix_data[]", len(imatrix) + 1)
            for i, (name, values) in enumerate(imatrix.items()):
                values = np.ascontiguousarray(values, dtype=np.float32)
                c_name, c_data = self.ffi.new("char[]", name.encode()), self.ffi.from_buffer("float[]", values)
                keep += [c_name, c_data, values]
                entries[i].name, entries[i].data, entries[i].size = c_name, c_data, values.size
            pp.imatrix = entries
        if self.lib.llama_model_quantize(str(src).encode(), str(dst).encode(), pp) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
        return dst

    def quantize_types(self, src: Path, ftype: str, imatrix=None) -> dict[str, str]:
        """llama-quantize --dry-run: its report of each tensor's type, read from its log."""
        text = []
        log = self.ffi.callback("void(enum ggml_log_level, const char *, void *)",
                                lambda level, chunk, user: text.append(self.ffi.string(chunk).decode(errors="replace")))
        self.lib.llama_log_set(log, self.ffi.NULL)
        try:
            self.quantize(src, src.with_name(src.name + ".dry-run"), ftype, 1, imatrix, dry_run=True)
        finally:
            self.lib.llama_log_set(self._quiet, self.ffi.NULL)
        return _reported_types("".join(text))


# "[  12/ 149]   blk.1.attn_v.weight  - [  256,  128,  1,  1], type =    f32, size =  0.12 MiB ->  0.02 MiB (q4_K)";
# a tensor kept as it is has no "->" part
_REPORT_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\w+),.*?(?:->.*\((\w+)\))?\s*$")


def _reported_types(log: str) -> dict[str, str]:
    """tensor name -> ggml type name (lower case) from llama-quantize's per-tensor lines."""
    types = {}
    for line in log.splitlines():
        if match := _REPORT_LINE.match(line.strip()):
            name, source, target = match.groups()
            types[name] = (target or source).lower()
    if not types:
        raise RuntimeError("llama.cpp's quantizer reported no tensors: its log format is not the one kvslim reads")
    return types


def _drop_log(level, text, user_data):  # llama.cpp's log chatter is not kvslim's output
    return None


class _PySyncContext(PeerContext):
    def __init__(self, b: _PySync, path, n_ctx, type_k, type_v, n_threads, n_batch, flash_attn, all_logits):
        self.b, lib, self.all_logits = b, b.lib, all_logits
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if self.model == b.ffi.NULL:
            raise ValueError(f"llama.cpp could not load {path}")
        p = lib.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, 1
        p.n_threads = p.n_threads_batch = n_threads
        p.type_k, p.type_v = b.constant("GGML_TYPE_", type_k), b.constant("GGML_TYPE_", type_v)
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lib.llama_init_from_model(self.model, p)
        if self.ctx == b.ffi.NULL:
            lib.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not make a context (n_ctx {n_ctx}, K {type_k}, V {type_v})")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab, self.n_batch, self.n_past = lib.llama_vocab_n_tokens(self.vocab), n_batch, 0
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def tokenize(self, text, add_special=False, parse_special=True):
        raw = text.encode()
        cap = len(raw) + 8
        buf = self.b.ffi.new("llama_token[]", cap)
        n = self.b.lib.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        return list(buf[0:n])

    def eval(self, tokens):
        if not tokens:
            raise ValueError("eval needs at least one token")
        rows = [self._decode(tokens[i:i + self.n_batch]) for i in range(0, len(tokens), self.n_batch)]
        return np.concatenate(rows) if self.all_logits else rows[-1][-1:]

    def _decode(self, chunk: list[int]) -> np.ndarray:
        bt, n = self.batch, len(chunk)
        for i, tok in enumerate(chunk):
            bt.token[i], bt.pos[i], bt.n_seq_id[i], bt.seq_id[i][0] = tok, self.n_past + i, 1, 0
            bt.logits[i] = self.all_logits or i == n - 1
        bt.n_tokens = n
        if (rc := self.b.lib.llama_decode(self.ctx, bt)) != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) at position {self.n_past}")
        self.n_past += n
        first = 0 if self.all_logits else n - 1
        out = np.empty((n - first, self.n_vocab), np.float32)
        for row, i in enumerate(range(first, n)):
            ptr = self.b.lib.llama_get_logits_ith(self.ctx, i)
            out[row] = np.frombuffer(self.b.ffi.buffer(ptr, 4 * self.n_vocab), np.float32)
        return out

    def reset(self):
        self.b.lib.llama_memory_clear(self.b.lib.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def save_state(self):
        size = self.b.lib.llama_state_get_size(self.ctx)
        buf = self.b.ffi.new("uint8_t[]", size)
        used = self.b.lib.llama_state_get_data(self.ctx, buf, size)
        return bytes(self.b.ffi.buffer(buf, used)), self.n_past

    def load_state(self, state):
        data, n_past = state
        self.b.lib.llama_state_set_data(self.ctx, self.b.ffi.from_buffer("uint8_t[]", data), len(data))
        self.n_past = n_past

    def close(self):
        if getattr(self, "ctx", None) is not None:
            self.b.lib.llama_batch_free(self.batch)
            self.b.lib.llama_free(self.ctx)
            self.b.lib.llama_model_free(self.model)
            self.ctx = None

    def __del__(self):
        self.close()


# ----- llama-cpp-python (fallback) ---------------------------------------------------------
class _LlamaCppPython:
    def __init__(self):
        try:
            import llama_cpp
        except ImportError:
            raise PeerUnavailable("llama-cpp-python is not installed either") from None
        self.llama_cpp = llama_cpp
        self.name = f"llama.cpp via llama-cpp-python {llama_cpp.__version__}"

    def open(self, path, n_ctx, type_k, type_v, n_threads, n_batch, flash_attn, all_logits):
        return _LlamaCppPythonContext(self.llama_cpp, path, n_ctx, type_k, type_v, n_threads, n_batch,
                                      flash_attn, all_logits)

    def quantize(self, src: Path, dst: Path, ftype: str, n_threads: int, imatrix=None) -> Path:
        if imatrix:
            raise PeerUnavailable("an importance matrix needs llama-cpp-py-sync's binding")
        lc = self.llama_cpp
        params = lc.llama_model_quantize_default_params()
        params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
        params.nthread = n_threads
        if lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype}")
        return dst


class _LlamaCppPythonContext(PeerContext):
    def __init__(self, lc, path, n_ctx, type_k, type_v, n_threads, n_batch, flash_attn, all_logits):
        self.all_logits = all_logits
        self.llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                            n_threads=n_threads, n_threads_batch=n_threads, flash_attn=flash_attn,
                            type_k=getattr(lc, f"GGML_TYPE_{type_k.upper()}"),
                            type_v=getattr(lc, f"GGML_TYPE_{type_v.upper()}"),
                            logits_all=all_logits, verbose=False, seed=0)
        self.n_vocab = self.llm.n_vocab()

    @property
    def n_past(self):
        return self.llm.n_tokens

    def tokenize(self, text, add_special=False, parse_special=True):
        return self.llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def eval(self, tokens):
        start = self.llm.n_tokens
        self.llm.eval(list(tokens))
        scores = np.asarray(self.llm.scores[start:self.llm.n_tokens], np.float32)
        return scores if self.all_logits else np.asarray(self.llm.scores[self.llm.n_tokens - 1:self.llm.n_tokens],
                                                          np.float32)

    def reset(self):
        self.llm.reset()

    def save_state(self):
        return self.llm.save_state(), self.llm.n_tokens

    def load_state(self, state):
        self.llm.load_state(state[0])

    def close(self):
        self.llm.close()
