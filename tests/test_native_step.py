"""The decode step in C (``kvslim/native/decode_step.c``) against the torch model it describes.

The eager torch step (``native=False``) is the reference: logits within float tolerance and
the same greedy tokens, for every architecture the C step accepts and K/V pairs covering each
encoder; its K/V encoders against the formats' own; the cases it must refuse, and the
fallbacks that then run."""
from __future__ import annotations

import pytest
import torch

from kvslim import formats
from kvslim.engine import Engine, EngineConfig, SamplingParams
from kvslim.engine import native_step
from kvslim.native import kv_encode
from kvslim.engine.decode_step import DecodeStep
from kvslim.loading import load_model
from kvslim.models import Batch

pytestmark = pytest.mark.skipif(native_step._library() is None, reason="no C compiler: no native step")

PAIRS = [("f16", "f16"), ("q8_0", "q4_0"), ("turbo4", "turbo3"), ("q4_0-norot", "bf16"), ("turbo2", "q8_0-norot"),
         ("f32", "turbo4"), ("iq4_nl", "q8_0"), ("q8_0", "iq4_nl-norot"), ("q4_1", "q5_0"), ("q5_1", "q5_0-norot")]


def filled(model, type_k, type_v, prompts, n_slots=None, **options):
    cache = model.make_cache(128, n_slots or len(prompts), type_k, type_v, page_size=8, **options)
    with torch.inference_mode():
        logits = torch.cat([model(Batch.build([(s, ids, 0)]), cache) for s, ids in enumerate(prompts)])
    return cache, logits


def run_both(model, type_k, type_v, steps=10, **options):
    """The C step and the eager step from the same prefilled caches: worst logit gap, tokens equal.
    With float activations: the K-quants' default 8-bit ones make the GEMV a step function of its
    input, so the two steps' 1e-6 differences would round an activation apart now and then
    (both steps call the same GEMV: test_k_quant_matrices_take_8_bit_activations_in_both_steps)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSLIM_Q8_ACTIVATIONS", "0")
        return _run_both(model, type_k, type_v, steps, **options)


def _run_both(model, type_k, type_v, steps, **options):
    prompts = [list(range(5, 22)), list(range(30, 39)), list(range(50, 75))]     # lengths cross page edges
    (ca, logits), (cb, _) = (filled(model, type_k, type_v, prompts, **options) for _ in range(2))
    native, eager = DecodeStep(model, ca, compile=False), DecodeStep(model, cb, compile=False, native=False)
    assert native.native is not None, native.why_not_native
    slots = [2, 0, 1]                                                             # not in slot order
    positions, tokens = [len(prompts[s]) for s in slots], [int(logits[s].argmax()) for s in slots]
    worst, same = 0.0, True
    for _ in range(steps):
        got, want = native(slots, tokens, positions), eager(slots, tokens, positions)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        same &= torch.equal(got.argmax(-1), want.argmax(-1))
        tokens, positions = [int(t) for t in want.argmax(-1)], [p + 1 for p in positions]
    assert [ca.offset(s) for s in range(3)] == [cb.offset(s) for s in range(3)]
    for a, b in zip(ca.kv_layers, cb.kv_layers):                                 # the same tokens packed
        assert [a.n_packed(s) for s in range(3)] == [b.n_packed(s) for s in range(3)]
    return worst, same


@pytest.fixture(scope="module")
def hybrid(tiny_folder):
    folder = tiny_folder("qwen3_5")[0]
    return (*load_model(folder, "f32"), folder)


@pytest.mark.parametrize("type_k,type_v", PAIRS)
def test_hybrid_logits_match_the_eager_step(hybrid, type_k, type_v):
    worst, same = run_both(hybrid[0], type_k, type_v)
    assert worst < 1e-4 and same


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "llama31", "gemma"])
def test_dense_architectures_match_the_eager_step(tiny_folder, kind):
    """Plain and q/k-normed attention, biases on q/k/v (qwen2), Llama 3.1's RoPE bands, Gemma's
    GeGLU, (1 + w) norms and sqrt(hidden)-scaled embeddings."""
    model, _, _ = load_model(tiny_folder(kind)[0], "f32")
    worst, same = run_both(model, "q8_0", "turbo4")
    assert worst < 1e-4 and same


@pytest.mark.parametrize("weights", ["f16", "q8_0", "q4_0", "q5_1", "iq4_nl"])
def test_quantized_weights_match_the_eager_step(tiny_folder, weights):
    model, _, _ = load_model(tiny_folder("qwen3_5")[0], "f32", weights=weights)
    worst, same = run_both(model, "q4_0", "q8_0")
    assert worst < 1e-4 and same


MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """``moe_folder(kind)``: a tiny Qwen3.5-MoE or Qwen3-Next whose expert widths are whole
    blocks of 32 (conftest's shared experts are 48 wide: refused below); 8 experts, top 2."""
    from tests.conftest import LINEAR, TINY, saved_random_model
    classes = {"qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
               "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM")}
    return lambda kind: saved_random_model(tmp_path_factory.mktemp(kind), *classes[kind], **TINY, **LINEAR, **MOE)


@pytest.mark.parametrize("kind,weights", [("qwen3_5_moe", None), ("qwen3_5_moe", "q8_0"), ("qwen3_next", None)])
def test_a_mixture_of_experts_matches_the_eager_step(moe_folder, kind, weights):
    """Router softmax and top-k, the routed experts' stacked matrices (dense or blocks), the
    shared expert and its sigmoid gate, summed in the reference's order; Qwen3-Next's DeltaNet
    projections grouped per key head. K/V in the formats
    whose C encoders write the torch encoders' bytes: with turbo4 V one value rounded to the
    other side of a codebook boundary at step 7 (the rotation sums in another order) and the
    logits then differ by 9e-4 of their range."""
    model, _, _ = load_model(moe_folder(kind), "f32", weights=weights)
    worst, same = run_both(model, "q8_0", "q4_0")
    assert worst < 1e-4 and same


@pytest.mark.parametrize("kind,why", [("qwen3_5_moe", "48 input features"), ("qwen3_next", "48 input features")])
def test_what_it_does_not_implement_is_refused_with_the_reason(tiny_folder, kind, why):
    model, _, _ = load_model(tiny_folder(kind)[0], "f32")
    step = DecodeStep(model, model.make_cache(32, 1), compile=False)
    assert step.native is None and why in step.why_not_native and not step.static


def test_refusals_keep_the_torch_step(hybrid):
    model = hybrid[0]
    step = DecodeStep(model, model.make_cache(32, 1, "q8_0", "q8_0", backend="reference"), compile=False)
    assert step.native is None and "attention backend reference" in step.why_not_native
    step = DecodeStep(model, model.make_cache(32, 1, "q8_0", "q8_0", f16_window=5000), compile=False)
    assert step.native is not None                                   # any window: merged in one pass
    step = DecodeStep(model, model.make_cache(32, 1, "turbo4p", "q8_0"), compile=False)
    assert step.native is None and "turbo4p" in step.why_not_native
    step = DecodeStep(model, model.make_cache(32, 1, "q8_0", "q8_0", backend="bf16"), compile=False)
    assert step.native is not None                                   # bf16 prompts, the torch backend's decode


def test_a_bf16_model_decodes_in_float32_on_its_bf16_matrices(hybrid):
    """As llama.cpp does: the logits of the eager step of f32 activations on bf16 matrices, but
    for the norm weights' bf16 rounding (the tiny model is saved in f32). Both caches are
    prefilled by the f32 model: a bf16 prefill rounds every activation."""
    bf16, _, _ = load_model(hybrid[3], "bf16")
    f32_on_bf16, _, _ = load_model(hybrid[3], "f32", weights="bf16")
    prompt = list(range(5, 30))
    (ca, first), (cb, _) = (filled(f32_on_bf16, "q8_0", "q8_0", [prompt]) for _ in range(2))
    native = DecodeStep(bf16, ca, compile=False)
    eager = DecodeStep(f32_on_bf16, cb, compile=False, native=False)
    assert native.native is not None
    token = int(first[0].argmax())
    for pos in range(len(prompt), len(prompt) + 5):
        got, want = native([0], [token], [pos]), eager([0], [token], [pos])
        assert (got - want).abs().max() < 2e-2 * want.abs().max()
        token = int(want.argmax())


def test_more_sequences_than_the_c_step_takes_run_as_calls_of_its_size(hybrid):
    """11 sequences in one step: the C step in calls of 8 and 3, each sequence the same bits as
    when it decodes alone, and the eager step's logits."""
    model = hybrid[0]
    prompts = [list(range(3 + s, 9 + 2 * s)) for s in range(native_step.MAX_BATCH + 3)]
    caches = [filled(model, "q8_0", "turbo4", prompts) for _ in range(3)]
    native, eager = DecodeStep(model, caches[0][0], compile=False), DecodeStep(model, caches[1][0], compile=False, native=False)
    alone = DecodeStep(model, caches[2][0], compile=False)
    assert native.native is not None
    slots = list(range(len(prompts)))
    tokens, positions = [int(t) for t in caches[0][1].argmax(-1)], [len(p) for p in prompts]
    got = native(slots, tokens, positions)
    assert torch.equal(got, torch.cat([alone([s], [t], [p]) for s, t, p in zip(slots, tokens, positions)]))
    want = eager(slots, tokens, positions)
    assert (got - want).abs().max() < 1e-4 * want.abs().max() and torch.equal(got.argmax(-1), want.argmax(-1))
    assert [caches[0][0].offset(s) for s in slots] == [p + 1 for p in positions]


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8_0", "q4_0", "q8_0-norot", "q4_0-norot", "iq4_nl",
                                  "iq4_nl-norot", "q4_1", "q5_0", "q5_1", "q4_1-norot", "q5_1-norot"])
def test_block_and_float_encoders_write_the_formats_bytes(name):
    """The same bytes and overflow flags as the format's torch encoder (the rotation is the
    same butterfly), including rows with NaN, inf and values past the fp16 scale's range."""
    fmt = formats.get(name, role="k")
    x = torch.randn(40, 128) * torch.logspace(-3, 2, 40)[:, None]
    x[3, 7], x[5, 0], x[9, 100] = float("nan"), float("inf"), 1e9
    codes, flags = kv_encode.encode_rows(fmt, x)
    want_codes, want_flags = fmt.encode_flagged(x)
    good = ~want_flags
    assert torch.equal(flags, want_flags) and flags[3] and flags[5]
    assert torch.equal(codes[good], want_codes[good])


@pytest.mark.parametrize("name", ["iq4_nl", "iq4_nl-norot"])
def test_iq4_nl_scale_search_picks_the_references_scale_on_many_blocks(name):
    """iq4_nl's 15-candidate scale search compares sums of products: 16,000 blocks at three
    magnitudes, an all-zero row and a row below ggml's GROUP_MAX_EPS, byte for byte."""
    fmt = formats.get(name, role="v")
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(1000, 128, generator=gen) * s * torch.logspace(-2, 1, 128) for s in (1e-3, 1.0, 300.0)])
    x[7], x[8] = 0.0, 1e-20
    codes, flags = kv_encode.encode_rows(fmt, x)
    want_codes, want_flags = fmt.encode_flagged(x)
    assert not flags.any() and torch.equal(flags, want_flags) and torch.equal(codes, want_codes)


@pytest.mark.parametrize("name", ["turbo4", "turbo3", "turbo2"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_turbo_encoder_matches_the_formats(name, head_dim):
    """The rotation is a matmul in torch and a loop here: a value on a codebook boundary may
    round to the other side, so codes agree but for rare ties and decoded rows stay close."""
    fmt = formats.get(name, role="k")
    x = torch.randn(64, head_dim)
    codes, flags = kv_encode.encode_rows(fmt, x)
    want_codes, want_flags = fmt.encode_flagged(x)
    assert torch.equal(flags, want_flags) and not flags.any()
    got, want = fmt.decode(codes, head_dim), fmt.decode(want_codes, head_dim)
    assert (got - want).abs().max() < 1e-2 * want.abs().max()
    assert (codes != want_codes).float().mean() < 0.01


@pytest.mark.parametrize("name", ["nl4", "nl3", "nl4s", "nl3s"])
@pytest.mark.parametrize("role", ["k", "v"])
def test_grid_encoders_search_as_the_formats_do(name, role):
    """The same scale search on the same float32 tables: the same bytes but for near-ties
    between scale candidates (the sums run in another order; over 200 draws of 64 rows the
    bytes agreed on >= 99.5%), and the same error."""
    fmt = formats.get(name, role=role)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    x[5, 3] = float("nan")
    codes, flags = kv_encode.encode_rows(fmt, x)
    want_codes, want_flags = fmt.encode_flagged(x)
    assert torch.equal(flags, want_flags) and flags[5]
    good = ~flags
    assert (codes[good] == want_codes[good]).float().mean() > 0.99
    got, want = fmt.decode(codes[good], 128), fmt.decode(want_codes[good], 128)
    err = lambda y: float(((y - x[good]) ** 2).mean())                       # noqa: E731
    assert err(got) == pytest.approx(err(want), rel=1e-3)


@pytest.mark.parametrize("type_k,type_v", [("nl4s", "nl3"), ("nl3s", "nl4")])
def test_the_bundled_model_decodes_the_nl_grids_as_the_eager_step(type_k, type_v):
    """The grids need head_dim 64/128 (the tiny models have 32): the bundled model's."""
    worst, same = run_both(load_model(None, "f32")[0], type_k, type_v, steps=6)
    assert worst < 1e-4 and same


def test_engine_decodes_natively_by_default_with_the_same_tokens(hybrid):
    model, tok, eos, _ = hybrid

    def greedy(native: bool):
        config = EngineConfig.build(256, 2, "q8_0", "turbo4", page_size=16, n_ubatch=32, native=native)
        engine = Engine(model, tok, config, eos)
        seqs = [engine.submit(list(range(3, 3 + n)), 24, SamplingParams(temperature=0)) for n in (20, 45)]
        engine.run(seqs)
        return engine, [s.generated for s in seqs]

    engine, native = greedy(True)
    assert engine.decode_step.native is not None
    assert native == greedy(False)[1] and all(len(g) > 1 for g in native)


def test_overflowing_values_flag_the_sequence_as_the_torch_step_does(hybrid):
    """Values past f16's range are flagged on the cache, so the engine ends that request alone
    (the keys are RMS-normed in this model: scaling k_proj would change nothing)."""
    model = hybrid[0]
    attn = next(layer.self_attn for layer in model.model.layers if layer.mixer_name == "self_attn")
    cache, logits = filled(model, "f16", "f16", [list(range(5, 12)), list(range(20, 30))])
    step = DecodeStep(model, cache, compile=False)
    weight = attn.v_proj.weight.detach()
    saved = weight.clone()
    try:
        weight.mul_(1e8)
        step([0], [int(logits[0].argmax())], [7])
    finally:
        weight.copy_(saved)
    assert cache.take_overflow() == [0]


def test_klt3_values_decode_in_the_c_step():
    """klt3 V rows (the bundled model's calibration: each KV head coded in its own basis) are
    encoded, attended and taken back out of their basis by the C step, per head."""
    model, _, _ = load_model(None, "f32")
    assert model.kv_calibration is not None
    for type_k in ("nl4s", "q8_0"):
        worst, same = run_both(model, type_k, "klt3")
        assert worst < 1e-4 and same


@pytest.mark.parametrize("type_k,type_v,window", [("q8_0", "q4_0", 4), ("turbo4", "turbo3", 32), ("f16", "q8_0", 20),
                                                  ("q4_0", "iq4_nl-norot", 1)])
def test_an_f16_window_decodes_in_the_c_step(hybrid, type_k, type_v, window):
    """The newest tokens in f16 (KIVI's residual): a window of 4 is full from the prompts on and
    packs a token every step; one of 32 is larger than two prompts (17 and 9 tokens) and smaller
    than the third (25), so windows fill up, and then pack, during the 10 steps; 20 sits between.
    Window keys are scored in the model domain by the C step, as by the torch step."""
    worst, same = run_both(hybrid[0], type_k, type_v, f16_window=window)
    assert worst < 1e-4 and same


def test_an_f16_window_with_klt3_values_in_the_c_step():
    """klt3's per-head basis: the pages' output leaves it before the window's values join."""
    model, _, _ = load_model(None, "f32")
    worst, same = run_both(model, "nl4s", "klt3", f16_window=16)
    assert worst < 1e-4 and same


def test_an_f16_window_after_a_trim_into_the_pages(tiny_folder):
    """A trim past the window's start empties the window; the C step then refills it from there,
    over pages that end mid-page (a dense model: rewinding a hybrid needs a DeltaNet checkpoint)."""
    model, _, _ = load_model(tiny_folder("llama")[0], "f32")
    prompt = list(range(5, 45))
    (ca, first), (cb, _) = (filled(model, "q8_0", "turbo4", [prompt], f16_window=8) for _ in range(2))
    for c in (ca, cb):
        c.rewind(0, 27)
    native, eager = DecodeStep(model, ca, compile=False), DecodeStep(model, cb, compile=False, native=False)
    assert native.native is not None
    token = 7
    for pos in range(27, 42):
        got, want = native([0], [token], [pos]), eager([0], [token], [pos])
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4
        assert ca.kv_layers[0].window_len(0) == cb.kv_layers[0].window_len(0)
        token = int(want.argmax())


def test_a_quantized_qwen35_gguf_decodes_in_the_c_step(hybrid, tmp_path):
    """llama.cpp's GGUFs of Qwen3.5 order a DeltaNet's value heads their own way, and quantized
    blocks cannot be re-ordered, so those matrices gather their input (``input_index``). The C
    step refused them, and every quantized Qwen3.5 GGUF decoded through the torch step (287
    against 3,178 t/s for llama.cpp on the bundled model's Q4_K_M); it gathers them now."""
    from kvslim.loading import convert_hf_to_gguf
    gguf = convert_hf_to_gguf(hybrid[3], tmp_path / "tiny-q8_0.gguf", "q8_0")
    model, _, _ = load_model(gguf, "f32")
    permuted = [m for m in model.modules() if getattr(m, "input_index", None) is not None]
    assert permuted                                                  # the case this test is about
    worst, same = run_both(model, "q8_0", "turbo4")
    assert worst < 1e-4 and same


@pytest.mark.parametrize("wtype", ["q4_k", "q3_k", "q2_k", "iq4_xs"])
def test_llama_quantize_mixes_decode_in_the_c_step(wtype, tmp_path):
    """The bundled model through llama.cpp's own quantizer (Q4_K_M, Q3_K_M, Q2_K and IQ4_XS
    mixes, read back as llama.cpp wrote them): every matrix stays in its file's type, and the C
    step matches the eager step over them."""
    from kvslim import peer
    from kvslim.loading import default_model
    from kvslim.tools.convert import convert
    from kvslim.weights.modules import _QuantWeight
    try:
        peer.binding()
    except peer.PeerUnavailable as err:
        pytest.skip(f"no llama.cpp to quantize with: {err}")
    gguf = convert(default_model(), tmp_path / f"bundled-{wtype}.gguf", wtype)
    model, _, _ = load_model(gguf, "f32")
    kinds = {m.wtype.name for m in model.modules() if isinstance(m, _QuantWeight)}
    assert wtype in kinds, kinds
    worst, same = run_both(model, "q8_0", "q8_0", steps=6)
    assert worst < 1e-4 and same


# Qwen3.5 text models whose matrices are whole K-quant super-blocks (hidden 256), so that
# llama-quantize's mixes give them K and i-quant types (the tiny test models' rows are too short)
WIDE256 = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
               linear_value_head_dim=64, linear_conv_kernel_dim=4)


@pytest.fixture(scope="module")
def moe256_folder(tmp_path_factory):
    """Qwen3.6-35B-A3B's shape in small: 4 layers, 8 experts of 256, top 2, a shared expert."""
    from .conftest import saved_random_model
    return saved_random_model(tmp_path_factory.mktemp("moe256"), "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                              **WIDE256, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=256, shared_expert_intermediate_size=256)


@pytest.fixture(scope="module")
def hybrid256_f32(tmp_path_factory):
    """A dense Qwen3.5 of the bundled model's width and depth (8 layers: llama.cpp's mixes treat
    the first and last eighth apart) with a vocabulary of 512, as an f32 GGUF."""
    from kvslim.loading import convert_hf_to_gguf

    from .conftest import saved_random_model
    folder = saved_random_model(tmp_path_factory.mktemp("hybrid256"), "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                                **WIDE256, num_hidden_layers=8)
    return convert_hf_to_gguf(folder, folder / "f32.gguf", "f32")


@pytest.mark.parametrize("wtype", ["q4_k", "iq4_xs", "iq3_xxs", "iq2_xxs"])      # iq2_xxs: convert measures an imatrix
def test_a_mixture_gguf_of_k_quant_experts_decodes_in_the_c_step(moe256_folder, wtype, tmp_path, short_imatrix):
    """Qwen3.6-35B-A3B's shape in small: routed experts kept in the file's K types, the shared
    expert and its gate, through the C step against the eager step (an f16 cache: with q8_0 keys,
    a 1-ulp difference can round a key to another code, 1.5e-4 of the logits here)."""
    from kvslim import peer
    from kvslim.tools.convert import convert
    from kvslim.weights.modules import QuantExperts
    try:
        peer.binding()
    except peer.PeerUnavailable as err:
        pytest.skip(f"no llama.cpp to quantize with: {err}")
    model, _, _ = load_model(convert(moe256_folder, tmp_path / f"moe-{wtype}.gguf", wtype), "f32")
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and {e.gate_up_type[0].name for e in experts} == {wtype}
    worst, same = run_both(model, "f16", "f16", steps=6)
    assert worst < 1e-4 and same


def quantized_by_llama_cpp(source, out, ftype):
    """``source`` (an f32 GGUF) through llama.cpp's quantizer as ``ftype``, with an importance
    matrix of ones (llama.cpp refuses IQ1 and IQ2 without one; these tests check decoding, not
    the quantizer's quality)."""
    import gguf as gguf_py
    import numpy as np
    from kvslim import peer
    try:
        peer.binding()
    except peer.PeerUnavailable as err:
        pytest.skip(f"no llama.cpp to quantize with: {err}")
    ones = {t.name: np.ones(int(np.prod(t.shape)) // int(t.shape[1]), np.float32)   # columns x experts
            for t in gguf_py.GGUFReader(source).tensors if len(t.shape) >= 2}
    return peer.quantize(source, out, ftype, 2, ones)


@pytest.fixture(scope="module")
def bundled_f32(tmp_path_factory):
    from kvslim.loading import convert_hf_to_gguf, default_model
    return convert_hf_to_gguf(default_model(), tmp_path_factory.mktemp("bundled") / "f32.gguf", "f32")


def test_k_quant_matrices_take_8_bit_activations_in_both_steps(bundled_f32, tmp_path):
    """Where the GEMV rounds activations to 8 bits (the K-quants, by default) the C step's matrices
    say so too, and one sequence's step gives the eager step's logits; KVSLIM_Q8_ACTIVATIONS=0
    turns it off in both."""
    from kvslim.native import block_linear
    if not block_linear.q8_activations("q4_k"):
        pytest.skip("this build multiplies float activations")
    model, _, _ = load_model(quantized_by_llama_cpp(bundled_f32, tmp_path / "q4_k_m.gguf", "q4_k_m"), "f32")
    logits, flags = {}, {}
    for switch in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVSLIM_Q8_ACTIVATIONS", switch)
            for native in (True, False):
                cache, prompt_logits = filled(model, "q8_0", "q8_0", [list(range(5, 22))])
                step = DecodeStep(model, cache, compile=False, native=native)
                logits[switch, native] = step([0], [int(prompt_logits[0].argmax())], [17])
                if native:
                    d = step.native.description
                    layers = (native_step.Layer * d.n_layers).from_address(d.layers)
                    flags[switch] = {(m.type, m.q8) for layer in layers for m in (layer.gate, layer.up, layer.down)}
    codes = block_linear.TYPE_CODES
    assert {(codes["q4_k"], 1), (codes["q6_k"], 1)} <= flags["1"] and {q8 for _, q8 in flags["0"]} == {0}
    gap = float((logits["1", True] - logits["1", False]).abs().max() / logits["1", False].abs().max())
    moved = float((logits["1", True] - logits["0", True]).abs().max() / logits["0", True].abs().max())
    assert gap < 1e-4 < moved


# llama.cpp's mixes that between them hold every grid i-quant
@pytest.mark.parametrize("ftype,types", [("iq1_s", {"iq1_s", "iq2_xxs"}), ("iq1_m", {"iq1_m"}), ("iq2_xs", {"iq2_xs"}),
                                         ("iq2_m", {"iq2_s", "iq3_s"}), ("iq3_xxs", {"iq3_xxs"})])
def test_i_quant_mixes_decode_in_the_c_step(hybrid256_f32, ftype, types, tmp_path):
    """A hybrid of the bundled model's widths as llama.cpp's IQ1/IQ2/IQ3 files (what fits a 35B
    mixture or an 80B Qwen3-Next in 24-32 GB): every matrix stays in its file's type, and the C
    step matches the eager step over them. (The bundled model's 8,192-token vocabulary took
    two thirds of the quantizer's time and added no type.) An f16 cache: with q8_0 keys, the
    two steps' float32 sums in another order moved one key to the next code under one worker
    thread (1.07e-4 of the logits, IQ2_M), not under two."""
    from kvslim.weights.modules import _QuantWeight
    model, _, _ = load_model(quantized_by_llama_cpp(hybrid256_f32, tmp_path / f"{ftype}.gguf", ftype), "f32")
    kinds = {m.wtype.name for m in model.modules() if isinstance(m, _QuantWeight)}
    assert types <= kinds, kinds
    worst, same = run_both(model, "f16", "f16", steps=6)
    assert worst < 1e-4 and same


def test_mxfp4_experts_decode_in_the_c_step(moe256_folder, tmp_path):
    """llama.cpp's MXFP4_MOE mix (gpt-oss's format, offered for any mixture): the routed experts
    in MXFP4, through the C step against the eager step."""
    from kvslim.loading import convert_hf_to_gguf
    from kvslim.weights.modules import QuantExperts
    source = convert_hf_to_gguf(moe256_folder, tmp_path / "f32.gguf", "f32")
    model, _, _ = load_model(quantized_by_llama_cpp(source, tmp_path / "mxfp4.gguf", "mxfp4_moe"), "f32")
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and {e.gate_up_type[0].name for e in experts} == {"mxfp4"}
    worst, same = run_both(model, "f16", "f16", steps=6)
    assert worst < 1e-4 and same
