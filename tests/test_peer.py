"""llama.cpp (b11739) as the peer: the glibc shim that makes the prebuilt libraries load,
and llama.cpp reading kvslim's GGUF exports of every supported architecture.

The ELF and shim tests need only a C compiler; the peer tests are skipped when no
llama.cpp binding is installed (``pip install 'kvslim[peer]'``).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvslim import peer
from kvslim.engine import load

from .test_gguf import KINDS, bundled_gguf, mixed_text, save_tokenizer, tiny_model  # noqa: F401 (fixture)

needs_cc = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("readelf") is None,
                              reason="needs a C compiler and readelf")
needs_peer = pytest.mark.skipif(not peer.available(), reason="no llama.cpp binding (pip install 'kvslim[peer]')")

PROMPT = [5, 77, 140, 9, 250, 31, 200, 64]
GREEDY = 16


pytestmark = pytest.mark.usefixtures("one_thread")      # tiny tensors: see conftest


# ----- the shim and the ELF edit ----------------------------------------------------------
@needs_cc
def test_shim_forwards_the_c23_functions(tmp_path):
    shim = ctypes.CDLL(str(peer.compile_shim(tmp_path / peer.SHIM_NAME)))
    shim.__isoc23_strtol.restype = ctypes.c_long
    shim.__isoc23_strtoull.restype = ctypes.c_ulonglong
    assert shim.__isoc23_strtol(b"-0x1f", None, 16) == -31
    assert shim.__isoc23_strtoull(b"18446744073709551615", None, 10) == 2**64 - 1
    a, b = ctypes.c_int(), ctypes.c_float()
    assert shim.__isoc23_sscanf(b"42 2.5", b"%d %f", ctypes.byref(a), ctypes.byref(b)) == 2
    assert (a.value, b.value) == (42, 2.5)


@needs_cc
def test_shim_symbols_carry_the_glibc_2_38_version(tmp_path):
    out = subprocess.run(["readelf", "--dyn-syms", "-W", str(peer.compile_shim(tmp_path / peer.SHIM_NAME))],
                         capture_output=True, text=True).stdout
    for name in peer.C23_SYMBOLS:
        assert f"{name}@@GLIBC_2.38" in out


@needs_cc
def test_version_need_is_marked_weak(tmp_path):
    """A library that needs strtol@GLIBC_2.2.5: only that Vernaux entry gains the WEAK flag."""
    src = tmp_path / "uses.c"
    src.write_text("#include <stdlib.h>\nlong f(const char *s) { return strtol(s, 0, 10); }\n")
    lib = tmp_path / "libuses.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    versions = lambda: subprocess.run(["readelf", "-V", "-W", str(lib)], capture_output=True, text=True).stdout
    line = next(s for s in versions().splitlines() if "Name: GLIBC_2.2.5" in s)
    assert "WEAK" not in line
    assert peer.weaken_version_need(lib, "GLIBC_2.2.5") == 1
    line = next(s for s in versions().splitlines() if "Name: GLIBC_2.2.5" in s)
    assert "WEAK" in line
    assert peer.weaken_version_need(lib, "GLIBC_9.99") == 0
    ctypes.CDLL(str(lib))                                            # still a loadable library


def test_weaken_refuses_a_non_elf_file(tmp_path):
    path = tmp_path / "x.so"
    path.write_bytes(b"not an elf file at all" * 4)
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        peer.weaken_version_need(path, "GLIBC_2.38")


# ----- llama.cpp reads kvslim's exports ----------------------------------------------------
@pytest.fixture(scope="module")
def exported_f32(tmp_path_factory):
    from kvslim.loading import convert_hf_to_gguf

    def get(kind: str):
        folder = tmp_path_factory.mktemp(f"peer_{kind}")
        tiny_model(kind).save_pretrained(folder)
        save_tokenizer(folder, kind)
        return convert_hf_to_gguf(folder, folder / "model-f32.gguf", "f32")
    return get


def kvslim_greedy(path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray, set[int]]:
    """kvslim's greedy tokens, its logits over the prompt and its end-of-generation ids
    (f16 K/V, as the peer's)."""
    llm = load(path, ctx=64, dtype="f32")
    tokens = llm.generate(prompt, max_tokens=n, temperature=0).token_ids
    return tokens, llm.logits(prompt).numpy(), llm.tokenizer.eog_ids()


def peer_greedy(path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    with peer.open_peer(path, n_ctx=64, n_threads=1, all_logits=True) as ctx:
        first = ctx.eval(prompt)
        return ctx.greedy(prompt, n), first


@needs_peer
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_agrees_on_kvslim_exports(exported_f32, kind):
    path = exported_f32(kind)
    ours, our_logits, eog = kvslim_greedy(path, PROMPT, GREEDY)
    theirs, their_logits = peer_greedy(path, PROMPT, GREEDY)
    assert their_logits.shape == our_logits.shape
    # llama.cpp rounds Q to f16 against f16 K and accumulates V in f16: ~1e-3 on logits of
    # size ~1; a wrong layout convention shows as differences of order 0.1-1.
    assert np.abs(their_logits - our_logits).max() < 5e-3
    assert theirs[:len(ours)] == ours
    if len(ours) < GREEDY:                                           # kvslim stopped at an end token
        assert theirs[len(ours)] in eog


@needs_peer
def test_llama_cpp_loads_kvslim_split_files(tmp_path):
    """A model kvslim writes split in several files is one llama.cpp opens from its first
    part, with the single file's logits."""
    from kvslim.loading import convert_hf_to_gguf, default_model
    single = convert_hf_to_gguf(default_model(), tmp_path / "one.gguf", "q8_0")
    first = convert_hf_to_gguf(default_model(), tmp_path / "split.gguf", "q8_0", split_max_tensors=25)
    assert first.name.startswith("split-00001-of-") and len(list(tmp_path.glob("split-*"))) > 2
    prompt = list(range(10, 40))
    _, want = peer_greedy(single, prompt, 1)
    _, got = peer_greedy(first, prompt, 1)
    assert np.array_equal(got, want)


@needs_peer
def test_state_save_and_restore_repeat_the_logits(exported_f32):
    with peer.open_peer(exported_f32("qwen3_5"), n_ctx=64, n_threads=1) as ctx:
        ctx.eval(PROMPT)
        state = ctx.save_state()
        a = ctx.eval([7, 8, 9])
        ctx.load_state(state)
        assert ctx.n_past == len(PROMPT)
        assert np.array_equal(ctx.eval([7, 8, 9]), a)


@needs_peer
def test_bad_cache_type_and_missing_file_are_refused(exported_f32, tmp_path):
    with pytest.raises(ValueError, match="no such GGUF"):
        peer.open_peer(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="GGML_TYPE_Q3_X"):
        peer.open_peer(exported_f32("llama"), type_k="q3_x")


@needs_peer
def test_cache_types_are_the_ones_llama_cpp_opens(exported_f32):
    """Every type cache_types() promises is a GGML_TYPE_ constant of the peer, and a context opens
    with it; kvslim's own types are refused by name before any work."""
    assert {"f16", "q8_0", "q4_0", "iq4_nl"} <= set(peer.cache_types())
    for name in peer.cache_types():
        with peer.open_peer(exported_f32("llama"), n_ctx=64, type_k=name, type_v=name) as llm:
            assert np.isfinite(llm.eval(llm.tokenize("hello"))).all(), name
    peer.check_cache_types(["f16", "q8_0/q4_0"])
    for bad in ("turbo4", "q8_0/nl4", "q4_0-norot"):
        with pytest.raises(ValueError, match="llama.cpp has no K/V cache type"):
            peer.check_cache_types([bad])


# ----- tokenization -------------------------------------------------------------------------
@needs_peer
def test_llama_cpp_tokenizes_the_bundled_export_as_kvslim(bundled_gguf):
    """Digits split one by one before GPT-2's regex ("starcoder"): e.g. "parts:\\n\\n1." keeps
    its "\\n\\n" token, which llama.cpp split in two under the old "gpt-2" pre-type."""
    from kvslim.loading import default_model
    from kvslim.tokenizer import Tokenizer
    text = mixed_text()
    ours = Tokenizer.from_folder(default_model()).encode(text, add_special=False)
    with peer.open_peer(bundled_gguf, n_ctx=64, n_threads=1) as ctx:
        theirs = ctx.tokenize(text, add_special=False, parse_special=False)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert (len(theirs), first) == (len(ours), len(ours)), f"first difference at token {first}"


@needs_peer
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "llama"])       # the qwen35, qwen2, llama-bpe regexes
def test_llama_cpp_tokenizes_tiny_exports_as_kvslim(exported_f32, kind):
    from kvslim.tokenizer import Tokenizer
    path = exported_f32(kind)
    text = mixed_text(1)
    with peer.open_peer(path, n_ctx=64, n_threads=1) as ctx:
        theirs = ctx.tokenize(text, add_special=False, parse_special=False)
    assert theirs == Tokenizer.from_folder(path.parent).encode(text, add_special=False)


# ----- kvslim convert -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """Tiny models with their matrices (not embeddings) at a quarter of test_gguf's scale.

    At full scale the random 4-layer models amplify any rounding: q8_0 weights alone move
    their logits by ~0.3 (std 0.68), and llama.cpp also rounds activations to q8_0 in its
    q8_0 dot products, so greedy tokens part at near-ties. At a quarter, kvslim and
    llama.cpp differ by ~0.02 on q8_0 files, below the top-1 margins. (The layout
    conventions are checked at full scale on f32 files above.)
    """
    made = {}

    def get(kind: str):
        if kind not in made:
            model = tiny_model(kind)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name:
                        p.mul_(0.25)
            made[kind] = tmp_path_factory.mktemp(f"convert_{kind}")
            model.save_pretrained(made[kind])
            save_tokenizer(made[kind], kind)
        return made[kind]
    return get


@needs_peer
@pytest.mark.parametrize("out_type", ["f16", "q8_0"])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "llama"])
def test_converted_files_give_the_same_greedy_tokens(hf_folder, tmp_path, kind, out_type):
    from kvslim.cli import main
    out = tmp_path / f"{kind}-{out_type}.gguf"
    assert main(["convert", str(hf_folder(kind)), "-o", str(out), "--type", out_type]) == 0
    ours, our_logits, eog = kvslim_greedy(out, PROMPT, GREEDY)
    theirs, their_logits = peer_greedy(out, PROMPT, GREEDY)
    assert np.abs(their_logits - our_logits).max() < {"f16": 5e-3, "q8_0": 0.05}[out_type]
    assert theirs[:len(ours)] == ours
    if len(ours) < GREEDY:
        assert theirs[len(ours)] in eog


@needs_peer
def test_k_quants_come_from_llama_cpp_s_quantizer(hf_folder, tmp_path):
    import gguf
    from kvslim.cli import main
    out = tmp_path / "q6_k.gguf"
    assert main(["convert", str(hf_folder("llama")), "-o", str(out), "--type", "q6_k"]) == 0
    reader = gguf.GGUFReader(str(out))
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_Q6_K
    assert {t.tensor_type for t in reader.tensors} >= {gguf.GGMLQuantizationType.F32}
    assert len(kvslim_greedy(out, PROMPT, 4)[0]) > 0                 # kvslim loads llama.cpp's file


# ----- the fallback binding: llama-cpp-python -------------------------------------------------
@pytest.fixture
def llama_cpp_python(monkeypatch):
    """kvslim.peer with its llama-cpp-python binding in use, whatever else is installed.

    PyPI has llama-cpp-python only as source (a ~25-minute build on two cores), so it is not in
    any extra and this is skipped unless it was installed by hand; llama-cpp-py-sync is the peer
    the suite runs."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (source-only on PyPI: "
                                            "the fallback binding is exercised only where it was built)")
    monkeypatch.setattr(peer, "_BINDING", peer._LlamaCppPython())


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_llama_cpp_python_fallback_agrees_on_kvslim_exports(llama_cpp_python, exported_f32, kind):
    assert "llama-cpp-python" in peer.describe()
    path = exported_f32(kind)
    ours, our_logits, eog = kvslim_greedy(path, PROMPT, GREEDY)
    theirs, their_logits = peer_greedy(path, PROMPT, GREEDY)
    assert np.abs(their_logits - our_logits).max() < 5e-3
    assert theirs[:len(ours)] == ours
    with peer.open_peer(path, n_ctx=64, n_threads=1) as ctx:
        ctx.eval(PROMPT)
        state = ctx.save_state()
        a = ctx.eval([7, 8, 9])
        ctx.load_state(state)
        assert np.array_equal(ctx.eval([7, 8, 9]), a)
