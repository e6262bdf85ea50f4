"""Weights kept as ggml blocks: decoders, quantized matmul, loading and the tools.

Oracles: ``gguf.quants`` (dequantize, quantize) for every block type, and the
dequantize-everything path (``read_model`` + ``instantiate``) for whole models.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import kvslim
from kvslim import weights as W
from kvslim.gguf import read_model, tensor_bytes
from kvslim.gguf import writer as gguf_writer
from kvslim.loading import convert_hf_to_gguf, load_model
from kvslim.loading.instantiate import instantiate
from kvslim.models import Batch, config_from_dict
from kvslim.weights import activations, matmul

LOGIT_TOL = 5e-4         # float32, different summation orders through a few layers
MATMUL_TOL = 1e-4        # relative to the output's scale
PROMPT = "The quick brown fox jumps over the lazy dog"
SCALE_FIELDS = ("d", "dmin", "m")


pytestmark = pytest.mark.usefixtures("one_thread")      # tiny tensors: see conftest


@pytest.fixture(autouse=True)
def float_activations(monkeypatch):
    """Float activations in decode's GEMV: this module holds the weights' paths to gguf.quants'
    values at float tolerance. The 8-bit activations (the default for the K-quants, Q4_0 and
    IQ4_NL) have their own reference: test_q8_activations_match_their_reference."""
    monkeypatch.setenv("KVSLIM_Q8_ACTIVATIONS", "0")


# ----- random blocks ---------------------------------------------------------------
def random_blocks(wtype: W.WeightType, n: int, seed: int = 0) -> np.ndarray:
    """(n, block_bytes) random codes with finite fp16 scales (random bytes could be inf/NaN)."""
    rng = np.random.default_rng(seed)
    if wtype.is_float:
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[wtype.name]
        values = torch.from_numpy(rng.normal(0, 1, n).astype(np.float32)).to(dtype)
        return values.view(torch.uint8).reshape(n, -1).numpy()
    raw = rng.integers(0, 256, (n, wtype.block_bytes), dtype=np.uint8)
    at = 0
    for name, size in wtype.fields:
        if name in SCALE_FIELDS:
            raw[:, at:at + 2] = rng.normal(0, 0.02, n).astype(np.float16).view(np.uint8).reshape(n, 2)
        if name == "e":                                   # MXFP4's exponent: 2^(e - 128) near 0.01
            raw[:, at] = rng.integers(118, 124, n)
        if name == "scales" and wtype.name == "iq1_m":    # the fp16 scale is the words' top nibbles
            d = rng.normal(0, 0.02, n).astype(np.float16).view(np.uint16).astype(np.uint16)
            words = raw[:, at:at + 8].copy().view(np.uint16) & 0x0FFF
            for i in range(4):
                words[:, i] |= ((d >> (4 * i)) & 0xF) << 12
            raw[:, at:at + 8] = words.view(np.uint8)
        at += size
    return raw


def random_matrix(wtype: W.WeightType, rows: int, cols: int, seed: int = 0) -> W.QuantTensor:
    raw = random_blocks(wtype, rows * cols // wtype.block_size, seed)
    return W.QuantTensor(torch.from_numpy(raw.reshape(rows, -1).copy()), wtype, cols)


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool((a - b).abs().max() <= tol * max(1.0, float(b.abs().max())))


# ----- the table and the decoders ----------------------------------------------------
def test_table_sizes_match_ggml():
    for t in W.TABLE:
        assert (t.block_size, t.block_bytes) == gguf.GGML_QUANT_SIZES[t.ggml_type], t.name
    assert W.get("Q4_K").bits_per_value == 4.5
    with pytest.raises(ValueError, match="valid: q8_0"):
        W.get("tq1_0")


@pytest.mark.parametrize("name", W.names())
def test_decoder_is_bit_exact(name):
    wtype = W.get(name)
    raw = random_blocks(wtype, 300, seed=1)
    ours = wtype.decode(torch.from_numpy(raw)).numpy().reshape(-1)
    ref = gguf.quants.dequantize(raw, wtype.ggml_type).astype(np.float32).reshape(-1)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", W.encodable_names())
def test_quantize_matches_gguf(name):
    x = torch.randn(6, 96) * 0.1
    ours = W.QuantTensor.quantize(x, W.get(name)).data.numpy()
    if name == "iq4_nl":                                   # gguf.quants has no IQ4_NL quantizer
        assert np.array_equal(gguf.quants.dequantize(ours, W.get(name).ggml_type),
                              W.QuantTensor(torch.from_numpy(ours), W.get(name), 96).dequantize().numpy())
        return
    theirs = gguf.quants.quantize(x.numpy(), W.get(name).ggml_type)     # float types: their own dtype
    assert np.array_equal(ours, np.ascontiguousarray(theirs).view(np.uint8).reshape(ours.shape))


# ----- the matmul against the reference path --------------------------------------------
@pytest.mark.parametrize("name", W.names())
def test_quant_linear_matches_reference(name, monkeypatch):
    wtype = W.get(name)
    cols = 512 if wtype.block_size > 32 else 96
    w = random_matrix(wtype, 40, cols, seed=2)
    bias = torch.randn(40)
    monkeypatch.setattr(matmul, "STEP_BYTES", 4 * cols * 7)           # several steps, a ragged last one
    monkeypatch.setattr(matmul, "STEP_MACS", 1)
    for rows in (5, 20):                                                 # decode's C GEMV (if built); a prompt's steps
        x = torch.randn(rows, cols)
        assert close(W.quant_linear(x, w, bias), W.reference_linear(x, w, bias), MATMUL_TOL), rows
    assert torch.equal(w.dequantize(), w.reference_dequantize())


@pytest.mark.parametrize("name", sorted(W.native.TYPE_CODES))
def test_native_dequantize_rows_gives_gguf_values(name):
    """The prompt GEMM's step decoder: gguf.quants' float32 values bit for bit, in every build."""
    if not W.native.available():
        pytest.skip("no C compiler: the prompt's steps keep the torch decoders")
    cols = 512 if W.get(name).block_size > 32 else 160
    w = random_matrix(W.get(name), 37, cols, seed=7)
    want = w.reference_dequantize().float()
    for variant in (None, "avx2", "portable"):
        assert torch.equal(W.native.dequantize_rows(w.data, name, cols, variant=variant), want), variant
    with pytest.raises(ValueError, match="refused"):
        W.native.dequantize_rows(w.data[:, :-1], name, cols - 1)


@pytest.mark.parametrize("name", sorted(W.native.TYPE_CODES))
def test_native_block_linear_matches_reference(name, monkeypatch):
    from kvslim.native import build as native_build
    if native_build.compiler():                                          # CI has one: the kernel must build
        assert W.native.available()
    if not W.native.available():
        pytest.skip("no C compiler: quant_linear keeps the torch path")
    cols = 512 if W.get(name).block_size > 32 else 160                   # whole super-blocks for the K types
    w = random_matrix(W.get(name), 67, cols, seed=5)                      # odd row count: uneven thread split
    for rows, threads in ((1, 1), (3, 2), (8, 2)):
        torch.set_num_threads(threads)
        x = torch.randn(rows, cols)
        x[0, :32] = 0.0                                                   # a group of zero activations
        want = W.reference_linear(x, w)
        for variant in (None, "avx2", "portable"):                       # 8-wide loops on an AVX-512 CPU; plain C
            assert close(W.native.block_linear(x, w.data, name, variant=variant, q8=False), want, MATMUL_TOL), variant
    assert W.native.supports(name, torch.randn(8, cols)) and not W.native.supports(name, torch.randn(9, cols))
    monkeypatch.setenv("KVSLIM_NATIVE", "0")
    native_build.clear()
    try:
        assert not W.native.supports(name, torch.randn(1, cols))          # the switch turns it off
    finally:
        native_build.clear()


@pytest.mark.parametrize("name", sorted(W.native.TYPE_CODES))
def test_native_block_linear_gives_a_row_the_same_bits_in_any_batch(name):
    """A decode step of one sequence and one of eight run different loops (one activation
    row, several): each row's sums are added in the same order in both, so a sequence's
    logits do not depend on what else the step decodes."""
    if not W.native.available():
        pytest.skip("no C compiler: quant_linear keeps the torch path")
    cols = 512 if W.get(name).block_size > 32 else 160
    w = random_matrix(W.get(name), 33, cols, seed=6)
    x = torch.randn(8, cols)
    for variant in (None, "avx2"):                                       # the 16-wide loops and the 8-wide
        for q8 in (False, True):                                         # float activations, 8-bit ones
            torch.set_num_threads(1)
            alone = torch.cat([W.native.block_linear(x[i:i + 1].contiguous(), w.data, name, variant, q8)
                               for i in range(8)])
            torch.set_num_threads(2)
            for rows in (2, 5, 8):
                assert torch.equal(W.native.block_linear(x[:rows].contiguous(), w.data, name, variant, q8), alone[:rows])


@pytest.mark.parametrize("name", activations.TYPES)
def test_q8_activations_match_their_reference(name, monkeypatch):
    """The GEMV with 8-bit activations (a scale per 32) against its torch reference (same
    activation bytes, exact integer sums): equal but for the float sums' order; within ~1% of the
    float activations' result; zero groups, a row's last partial chunk of 4 groups, a NaN and an
    infinity handled. Where a build has no 8-bit loop for the type (Q8_0 and IQ4_NL need VNNI) the
    default is the float one."""
    if not W.native.available():
        pytest.skip("no C compiler: quant_linear keeps the torch path")
    monkeypatch.setenv("KVSLIM_Q8_ACTIVATIONS", "1")                                 # the default
    wtype = W.get(name)
    cols = 768 if wtype.block_size == 256 else 800                                   # 800: 25 groups
    w = random_matrix(wtype, 67, cols, seed=8)
    builds = [v for v in (None, "avx2") if W.native.q8_activations(name, v)]
    if not builds:
        pytest.skip(f"no 8-bit {name} loop in this machine's builds")
    for rows, threads in ((1, 1), (3, 2), (8, 2)):
        torch.set_num_threads(threads)
        x = torch.randn(rows, cols) * torch.logspace(-2, 1, rows).unsqueeze(1)       # rows of different scales
        x[0, 256:320] = 0.0                                                           # all-zero groups
        want, floats = activations.q8_block_linear_reference(x, w.data, wtype), W.reference_linear(x, w)
        for variant in (None, "avx2"):
            got = W.native.block_linear(x, w.data, name, variant=variant)            # the default
            if variant not in builds:
                assert torch.equal(got, W.native.block_linear(x, w.data, name, variant=variant, q8=False))
                continue
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())), variant
            scale = floats.abs().amax(1, keepdim=True)
            assert ((got - floats).abs() / scale).max() < 0.03, variant
            assert ((got - floats).abs() / scale).max() > 1e-4, variant              # it did round x
    x = torch.randn(2, cols)
    x[0, 300], x[1, 700] = float("nan"), float("inf")
    got = W.native.block_linear(x, w.data, name, variant=builds[0])
    assert got[0].isnan().all() and got[1].isnan().all()
    assert not W.native.q8_activations(name, "portable") and not W.native.q8_activations("q8_0")
    monkeypatch.setenv("KVSLIM_Q8_ACTIVATIONS", "0")
    assert not W.native.q8_activations(name)


def test_q8_reference_rounds_to_127_steps_per_group():
    """quantize_q8: 127 steps of max |x| / 127 per 32 values, half to even, and the values it
    stands for within half a step."""
    x = torch.randn(3, 64)
    x[1, :32] = 0.0
    d, q = activations.quantize_q8(x)
    assert q.dtype == torch.int8 and d.shape == (3, 2) and q.shape == (3, 2, 32)
    assert d[1, 0] == 0 and not q[1, 0].any()
    assert (q.abs().amax(-1)[d > 0] == 127).all()
    err = (d.unsqueeze(-1) * q.float() - x.view(3, 2, 32)).abs()
    assert (err <= d.unsqueeze(-1) / 2 * (1 + 1e-6)).all()


def test_column_reorder_moves_blocks_or_gathers_inputs():
    w = random_matrix(W.get("q8_0"), 8, 128)
    dense = w.dequantize()
    whole_blocks = torch.cat([torch.arange(64, 96), torch.arange(0, 64), torch.arange(96, 128)])
    inside_blocks = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 128)
    for index, gathers in ((whole_blocks, False), (inside_blocks, True)):
        moved = w.index_select(1, index)
        assert (moved.input_index is not None) == gathers
        assert torch.equal(moved.dequantize(), dense.index_select(1, index))
        assert close(W.quant_linear(x, moved), x @ dense.index_select(1, index).T, MATMUL_TOL)


def test_experts_touch_only_routed_blocks():
    """Unrouted experts' scales are NaN: any read of their blocks would poison the output."""
    q8 = W.get("q8_0")
    gate_up, down = random_matrix(q8, 4 * 64, 32).reshape(4, 64, 32), random_matrix(q8, 4 * 32, 32).reshape(4, 32, 32)
    reference = W.QuantExperts(gate_up.dequantize(), down.dequantize())
    for t in (gate_up, down):
        t.data.view(4, -1, q8.block_bytes)[2:, :, :2] = 0xFF                # experts 2, 3: NaN scales
    experts = W.QuantExperts(gate_up, down)
    x, routed = torch.randn(6, 32), torch.tensor([[0, 1]] * 3 + [[1, 0]] * 3)
    weights = torch.rand(6, 2)
    out = experts(x, weights, routed)
    assert torch.isfinite(out).all()
    assert close(out, reference(x, weights, routed), MATMUL_TOL)


def test_embedding_decodes_only_asked_rows():
    q8 = W.get("q8_0")
    table = random_matrix(q8, 10, 64)
    expected = table.dequantize()
    table.data.view(10, -1, q8.block_bytes)[5:, :, :2] = 0xFF
    emb = W.QuantEmbedding(table)
    ids = torch.tensor([[0, 4], [2, 2]])
    assert torch.equal(emb(ids), expected[ids])


# ----- whole models from GGUF -----------------------------------------------------------
def logits_of(model, ids: list[int]) -> torch.Tensor:
    return model(Batch.build([(0, ids, 0)]), model.make_cache(64), all_logits=True)


def dequantized_model(path):
    config, state, *_ = read_model(path)
    return instantiate(config_from_dict(config), state)


@pytest.fixture(scope="module")
def exported(tiny_folder, tmp_path_factory):
    made = {}

    def make(kind: str, out_type: str):
        if (kind, out_type) not in made:
            folder, _ = tiny_folder(kind)
            path = tmp_path_factory.mktemp("gguf") / f"{kind}-{out_type}.gguf"
            made[kind, out_type] = convert_hf_to_gguf(folder, path, out_type)
        return made[kind, out_type]
    return make


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "llama"])
@pytest.mark.parametrize("out_type", ["q8_0", "q4_0"])
def test_gguf_stays_quantized(kind, out_type, exported):
    path = exported(kind, out_type)
    model, _, _ = load_model(path)
    kinds = {type(m) for m in model.modules()}
    assert {W.QuantLinear, W.QuantEmbedding} <= kinds
    assert (W.QuantExperts in kinds) == (kind == "qwen3_5_moe")
    assert abs(W.weight_bytes(model) / tensor_bytes(path) - 1) < 0.10
    ids = list(range(3, 19))
    dense = dequantized_model(path)
    assert close(logits_of(model, ids), logits_of(dense, ids), LOGIT_TOL)
    # llama-bench's params column: values, not uint8 block bytes
    assert W.parameter_count(model) == W.parameter_count(dense)
    assert W.weight_type_label(model) == out_type.upper()
    for layer in (m for m in model.modules() if isinstance(m, W.QuantLinear)):
        x = torch.randn(4, layer.in_features)
        assert close(layer(x), W.reference_linear(x, layer.quant, layer.bias), MATMUL_TOL)
    if Path("/proc/self/maps").exists():                  # matrices no convention moves are the file's pages
        assert mapped_from(path, model.model.layers[3].self_attn.o_proj.weight)


def mapped_from(path, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in a memory map of the file ``path``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if name.strip() == str(Path(path).resolve()) and lo <= t.data_ptr() < hi:
            return True
    return False


def test_tied_head_multiplies_by_embedding_blocks(tiny_folder, tmp_path):
    import shutil
    folder = shutil.copytree(tiny_folder("qwen3_5")[0], tmp_path / "tied")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    path = convert_hf_to_gguf(folder, tmp_path / "tied.gguf", "q4_0")
    model, _, _ = load_model(path)
    assert model.lm_head is None and isinstance(model.model.embed_tokens, W.QuantEmbedding)
    x = torch.randn(4, model.config.hidden_size)
    assert close(model.logits(x), W.reference_linear(x, model.model.embed_tokens.quant), MATMUL_TOL)
    ids = list(range(3, 19))
    assert close(logits_of(model, ids), logits_of(dequantized_model(path), ids), LOGIT_TOL)


def greedy_tokens(path, n: int) -> list[int]:
    return kvslim.load(path, ctx=128, dtype="f32").generate(PROMPT, n, temperature=0).token_ids


def test_greedy_q8_0_matches_f16(exported):
    """Random tiny models have narrow top-1 margins, so Q8_0's rounding can flip a token: on
    this prompt the tiny llama agrees for 48 tokens, qwen3_5 for 26, qwen3_5_moe for 0
    (their logits still match the dequantized path; that is the parity test above)."""
    f16, q8 = (greedy_tokens(exported("llama", t), 32) for t in ("f16", "q8_0"))
    assert len(f16) == 32 and f16 == q8


@pytest.mark.skipif(not (kvslim.loading.BUNDLED / "config.json").is_file(), reason="bundled model not built yet")
def test_bundled_q8_0_picks_f16s_greedy_tokens_except_near_ties(tmp_path):
    """Teacher-forced on the f16 GGUF's 32 greedy tokens, the q8_0 GGUF picks the same token at
    every position where f16's top two logits are more than 0.1 apart. A free-running
    comparison is not stable: on this prompt the current weights have a 0.016-logit tie at
    the 7th token, which q8_0's rounding (logits move by ~0.04) flips, and the texts part."""
    folder = kvslim.loading.BUNDLED
    f16_path, q8_path = (convert_hf_to_gguf(folder, tmp_path / f"{t}.gguf", t) for t in ("f16", "q8_0"))
    llm = kvslim.load(f16_path, ctx=128, dtype="f32")
    prompt = llm.tokenize(PROMPT)
    generated = llm.generate(PROMPT, 32, temperature=0).token_ids
    ids = list(prompt) + generated
    scored = slice(len(prompt) - 1, len(ids) - 1)
    f16 = logits_of(load_model(f16_path)[0], ids)[scored].float()
    q8 = logits_of(load_model(q8_path)[0], ids)[scored].float()
    assert f16.argmax(-1).tolist() == generated        # the teacher-forced path is the greedy one
    top2 = f16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() >= 24                            # most positions are not near-ties
    assert torch.equal(q8.argmax(-1)[clear], f16.argmax(-1)[clear])
    assert (q8 - f16).abs().max() < 0.3


def test_mxfp4_file_loads_packed_and_unknown_types_are_refused(tiny_folder, tmp_path, monkeypatch):
    """gguf.quants writes MXFP4 (the types it cannot write are all in the table now): the file
    loads packed, as its dequantized twin; with MXFP4 taken out of the table the load is refused
    with the tensor and the supported types named, and --allow-dequant expands it."""
    folder, _ = tiny_folder("llama")
    monkeypatch.setitem(gguf_writer.QTYPE, "mxfp4", gguf.GGMLQuantizationType.MXFP4)
    monkeypatch.setitem(gguf_writer.FILE_TYPE, "mxfp4", gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    path = convert_hf_to_gguf(folder, tmp_path / "mxfp4.gguf", "mxfp4")
    packed = load_model(path)[0]
    assert any(isinstance(m, W.QuantLinear) and m.quant.wtype.name == "mxfp4" for m in packed.modules())
    ids = list(range(3, 19))
    monkeypatch.setattr(W.types, "_BY_GGML", {k: v for k, v in W.types._BY_GGML.items() if v.name != "mxfp4"})
    with pytest.raises(ValueError, match=r"blk\.0\..*\(MXFP4\).*supported quantized weight types: Q8_0.*allow-dequant"):
        load_model(path)
    model, _, _ = load_model(path, allow_dequant=True)
    assert not any(isinstance(m, W.QuantLinear) for m in model.modules())
    assert close(logits_of(packed, ids), logits_of(model, ids), LOGIT_TOL)


# ----- quantizing a Hugging Face folder at load -------------------------------------------
def test_hf_folder_quantized_at_load(tiny_folder, exported):
    folder, _ = tiny_folder("llama")
    model, _, _ = load_model(folder, weights="q8_0")
    assert any(isinstance(m, W.QuantLinear) for m in model.modules())
    ids = list(range(3, 19))               # llama's conventions move whole rows: the same blocks as the GGUF
    assert torch.equal(logits_of(model, ids), logits_of(load_model(exported("llama", "q8_0"))[0], ids))
    with pytest.raises(ValueError, match="valid: q8_0"):
        load_model(folder, weights="q3_k")
    with pytest.raises(ValueError, match="keeps its own types"):
        load_model(exported("llama", "q8_0"), weights="q8_0")


def test_run_reports_weights_and_rss(tiny_folder, capsys):
    from kvslim.tools import run
    folder, _ = tiny_folder("qwen3_5_moe")
    assert run.main(["-m", str(folder), "--weights", "q8_0", "-p", "Hello", "-n", "4", "--temp", "0",
                     "-c", "64", "-o", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert 0 < record["weights_bytes"] < record["rss_bytes"]


def test_a_few_tokens_take_larger_steps():
    """A mixture's expert sees a few dozen of a prompt's tokens: its steps grow so that each
    matmul has STEP_MACS of work, where a dense prompt's stay STEP_BYTES."""
    w = random_matrix(W.get("q4_k"), 2048, 2048)
    assert matmul.rows_per_step(w, 512) == matmul.STEP_BYTES // (4 * 2048) == 32
    assert matmul.rows_per_step(w, 32) == 512
