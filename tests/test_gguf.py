"""GGUF export and import against transformers (the oracle) and the original tokenizer.

Tiny random models of every supported architecture, all parameters randomised
(norms, A_log, dt_bias too, value heads > key heads) so that every llama.cpp
convention shows in the logits, are saved by transformers with a small trained
byte-level BPE tokenizer; ``convert_hf_to_gguf`` exports them, ``read_model`` brings them
back into kvslim, and the logits, config and tokenizer must match the originals.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json

import gguf
import numpy as np
import pytest
import torch

import kvslim
from kvslim.gguf import file_type, read_config, read_model, tensor_bytes, weight_types, writer
from kvslim.gguf import names as N
from kvslim.loading import convert_hf_to_gguf
from kvslim.loading.hf import read_config as read_hf_config
from kvslim.loading.instantiate import instantiate
from kvslim.models import Batch, config_from_dict

from .conftest import LINEAR, MOE, TINY

tf = pytest.importorskip("transformers")
tk = pytest.importorskip("tokenizers")

VOCAB = 320                                 # 256 byte symbols + specials + merges (+ [PAD] rows)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS = "<|begin_of_text|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. It's 2024, they'll say 12345 times!",
          "def tokenize(text):\n    return text.split()  # whitespace   runs\n\n",
          "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский текст.",
          "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"] * 4
SAMPLES = ["Hello world", "  leading and   inner   spaces\t\ttabs\n\n\nnewlines  ", "digits 1234567 and 3.14159",
           "unicode: héllo wörld 日本語 🙂 e\u0301", "<|im_start|>user\nhi<|im_end|>\n<|im_end|>",
           "don't they'll WE'RE", "", "<|endoftext|>tail"]
KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "llama", "llama31", "qwen3", "qwen2", "gemma")
REGEX = {"qwen3_5": N.QWEN35_REGEX, "qwen3_5_moe": N.QWEN35_REGEX, "qwen3_next": N.QWEN2_REGEX,
         "qwen3": N.QWEN2_REGEX, "qwen2": N.QWEN2_REGEX, "llama": N.LLAMA3_REGEX, "llama31": N.LLAMA3_REGEX,
         "gemma": N.QWEN2_REGEX}
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}   # all three bands occur
F32_TOL = 1e-4


def mixed_text(repeat: int = 6) -> str:
    """About 100 KB of prose, code, digits, whitespace runs and Unicode: Python's own
    sources (code with English docstrings) and the cases that split tokenizers apart."""
    import inspect
    import json as json_module
    import textwrap
    special = ("The parts:\n\n1. first\n\n\n2. second\r\n\r\n  3.\tthird  \n"
               "Pi is 3.14159265, 1,000,000 or 1e-9; call 555-0100 x42 at 09:30 on 2026-11-23.\n"
               "    indented    runs\t\t\tof   whitespace   \n\n\n\n\n"
               "naïve café, Ünïcödé, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский, e\u0301, ١٢٣ ٤٥\n"
               "don't they'll WE'RE I'M it's\n")
    code = inspect.getsource(textwrap) + inspect.getsource(json_module.decoder)
    return (special + code) * repeat


@pytest.fixture(scope="module")
def bundled_gguf(tmp_path_factory):
    """The bundled model exported once (f16)."""
    from kvslim.loading import default_model
    return convert_hf_to_gguf(default_model(), tmp_path_factory.mktemp("bundled") / "bundled-f16.gguf", "f16")


# ----- fixtures -----------------------------------------------------------------
def tiny_model(kind: str, seed: int = 0):
    tiny = {**TINY, "vocab_size": VOCAB}
    configs = {
        "qwen3_5": lambda: (tf.Qwen3_5TextConfig(**tiny, **LINEAR), tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": lambda: (tf.Qwen3_5MoeTextConfig(**tiny, **LINEAR, **MOE), tf.Qwen3_5MoeForCausalLM),
        "qwen3_next": lambda: (tf.Qwen3NextConfig(**tiny, **LINEAR, **MOE), tf.Qwen3NextForCausalLM),
        "llama": lambda: (tf.LlamaConfig(**tiny, bos_token_id=3, eos_token_id=2), tf.LlamaForCausalLM),
        "llama31": lambda: (tf.LlamaConfig(**tiny, rope_parameters=LLAMA31_ROPE, bos_token_id=3, eos_token_id=2),
                            tf.LlamaForCausalLM),
        "qwen3": lambda: (tf.Qwen3Config(**tiny), tf.Qwen3ForCausalLM),
        # q/k/v biases; head_dim = hidden / heads, the only shape llama.cpp's qwen2 loader accepts
        "qwen2": lambda: (tf.Qwen2Config(**{**tiny, "head_dim": 16}), tf.Qwen2ForCausalLM),
        # tied head, 1 + w norms; no token ids, as the qwen tokenizer saved here has none of gemma's
        "gemma": lambda: (tf.GemmaConfig(**tiny, bos_token_id=None, eos_token_id=None, pad_token_id=None),
                          tf.GemmaForCausalLM),
    }
    config, cls = configs[kind]()
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.normal_(0.0, 0.08)
    return model


def save_tokenizer(folder, kind: str) -> None:
    """A byte-level BPE trained here, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    llama = kind.startswith("llama")
    tok = Tokenizer(models.BPE(ignore_merges=llama))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(REGEX[kind]), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=SPECIALS + ([BOS] if llama else []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if llama:
        bos = (BOS, tok.token_to_id(BOS))
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                                           special_tokens=[bos])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": BOS if llama else None, "add_bos_token": llama}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(kind, out_type)`` -> (HF folder, GGUF path, transformers model), cached."""
    models, files = {}, {}

    def get(kind: str, out_type: str = "f32"):
        if kind not in models:
            folder = tmp_path_factory.mktemp(f"hf_{kind}")
            models[kind] = (folder, tiny_model(kind))
            models[kind][1].save_pretrained(folder)
            save_tokenizer(folder, kind)
        folder, model = models[kind]
        if (kind, out_type) not in files:
            files[kind, out_type] = convert_hf_to_gguf(folder, folder / f"model-{out_type}.gguf", out_type)
        return folder, files[kind, out_type], model
    return get


# ----- helpers ------------------------------------------------------------------
TOKENS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5))


@functools.lru_cache(maxsize=None)                                # modules hash by identity
def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS[None]).logits[0].float()


def gguf_logits(path) -> torch.Tensor:
    config, state, _, _ = read_model(path, dtype=torch.float32)
    model = instantiate(config_from_dict(config), state, torch.float32)
    return model(Batch.build([(0, TOKENS, 0)]), model.make_cache(64, 1, "f32", "f32"), all_logits=True)


def rounded(model, dtype: torch.dtype):
    """The transformers model with every tensor the GGUF stores as F16 / BF16 rounded to
    ``dtype`` (all >= 2-d weights except router, shared-expert gate and conv1d: F32)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight")):
                p.copy_(p.to(dtype).float())
    return out


# ----- logits -------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_f32_export_gives_transformers_logits(exported, kind):
    _, path, model = exported(kind, "f32")
    want, got = hf_logits(model), gguf_logits(path)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= F32_TOL
    assert want.std() > 0.1


@pytest.mark.parametrize("kind,out_type", [(k, "f16") for k in KINDS] + [("qwen3_5", "bf16"), ("llama", "bf16")])
def test_half_export_equals_rounded_weights(exported, kind, out_type):
    """F16 / BF16 storage changes nothing but the rounding of the tensors stored that way:
    against transformers run with exactly those tensors rounded, the logits agree to f32
    precision. Against the unrounded model the f16 error is that rounding (relative 2^-12
    RMS per weight) carried through 4 random layers: measured 2e-3 (attention-only) to
    1.2e-2 (qwen3_5) on logits of std ~0.7; bound 5e-2. MoE models are left out of that
    bound: a rounded router can pick another expert."""
    _, path, model = exported(kind, out_type)
    got = gguf_logits(path)
    dtype = torch.float16 if out_type == "f16" else torch.bfloat16
    assert (got - hf_logits(rounded(model, dtype))).abs().max().item() <= F32_TOL
    if out_type == "f16" and "moe" not in kind and "next" not in kind:
        assert (got - hf_logits(model)).abs().max().item() <= 5e-2


def test_q8_0_file_holds_the_quantized_tensors(exported):
    """Every tensor of the q8_0 export is the f32 export's, quantized by gguf.quants where the
    converter would: Q8_0 for 2-d weights, F16 for rows of 48 values (shared-expert down, not a
    multiple of the 32-value block), F32 for norms, router, shared-expert gate and conv1d."""
    f32 = {t.name: t for t in gguf.GGUFReader(str(exported("qwen3_5_moe", "f32")[1])).tensors}
    q8 = {t.name: t for t in gguf.GGUFReader(str(exported("qwen3_5_moe", "q8_0")[1])).tensors}
    kinds = {t.name: t.tensor_type.name for t in q8.values()}
    assert kinds["blk.0.ffn_down_shexp.weight"] == "F16" and kinds["blk.0.attn_qkv.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["token_embd.weight"] == "Q8_0"
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp_shexp.weight",
                 "blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.3.attn_q_norm.weight"):
        assert kinds[name] == "F32", name
    assert set(q8) == set(f32)
    for name, t in q8.items():
        want = gguf.quants.quantize(np.asarray(f32[name].data), t.tensor_type)
        assert np.array_equal(np.asarray(t.data), want), name


@pytest.mark.parametrize("out_type", ["q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_other_block_types_hold_the_quantized_tensors(exported, out_type):
    """The newer --type values: gguf.quants' encoder (IQ4_NL, which it cannot encode: kvslim's,
    checked by gguf.quants' decoder against the float tensor's error bound), same F32/F16 rules."""
    f32 = {t.name: t for t in gguf.GGUFReader(str(exported("qwen3_5", "f32")[1])).tensors}
    reader = gguf.GGUFReader(str(exported("qwen3_5", out_type)[1]))
    assert reader.get_field("general.file_type").contents() == writer.FILE_TYPE[out_type]
    quantized = {t.name: t for t in reader.tensors}
    assert quantized["blk.0.attn_qkv.weight"].tensor_type == writer.QTYPE[out_type]
    for name, t in quantized.items():
        data, want = np.asarray(t.data), np.asarray(f32[name].data)
        if t.tensor_type != gguf.GGMLQuantizationType.IQ4_NL:
            assert np.array_equal(data, gguf.quants.quantize(want, t.tensor_type)), name
            continue
        got = gguf.quants.dequantize(data, t.tensor_type).reshape(want.shape)
        scale = np.abs(want.reshape(-1, 32)).max(-1, keepdims=True)          # per 32-value block
        assert (np.abs(got - want).reshape(-1, 32) <= scale / 8).all(), name  # grid steps are <= 1/4 of max


def test_unknown_out_type_is_refused(tmp_path):
    from kvslim.loading import default_model
    with pytest.raises(ValueError, match="out_type 'q3_k' is not supported; choose from f32, f16"):
        convert_hf_to_gguf(default_model(), tmp_path / "x.gguf", "q3_k")


def test_convert_refuses_types_it_cannot_make(tmp_path, monkeypatch, capsys):
    from kvslim import peer
    from kvslim.cli import main
    from kvslim.loading import default_model
    assert main(["convert", str(default_model()), "-o", str(tmp_path / "x.gguf"), "--type", "tq1_0"]) == 2
    assert "--type 'tq1_0' cannot be written; supported: f32, f16, bf16, q8_0" in capsys.readouterr().err
    monkeypatch.setattr(peer, "binding", lambda: (_ for _ in ()).throw(peer.PeerUnavailable("none here")))
    assert main(["convert", str(default_model()), "-o", str(tmp_path / "x.gguf"), "--type", "q4_k"]) == 2
    assert "made by llama.cpp's quantizer, which is not available (none here)" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing"), "--type", "f16"]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


def test_convert_writes_a_file_kvslim_loads(exported, tmp_path, capsys):
    from kvslim.cli import main
    folder, _, model = exported("llama", "f32")
    out = tmp_path / "llama-bf16.gguf"
    assert main(["convert", str(folder), "-o", str(out), "--type", "bf16"]) == 0
    assert f"wrote {out} (bf16," in capsys.readouterr().out
    assert torch.allclose(gguf_logits(out), hf_logits(rounded(model, torch.bfloat16)), atol=2e-3)


def test_q8_0_logits_stay_close(exported, capsys):
    """q8_0's per-weight error (relative RMS ~0.5%) is ~35x f16's; this random tiny hybrid
    amplifies f16's to 0.3% relative RMS in the logits (the f16 test pins that down exactly),
    so q8_0 lands near 6%: bound 10%."""
    _, path, model = exported("qwen3_5", "q8_0")
    want, got = hf_logits(model), gguf_logits(path)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 0.1, (f"q8_0 qwen3_5: max |logit diff| {(got - want).abs().max():.3f}, relative RMS {rel:.3f}, "
                        f"logit std {want.std():.2f}")


# ----- metadata -----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_read_config_round_trips(exported, kind):
    folder, path, _ = exported(kind, "f32")
    want = config_from_dict(read_hf_config(folder))
    got = config_from_dict(read_config(path))
    skip = {"bos_token_id", "eos_token_id"}                        # carried by the tokenizer, tested there
    if kind == "llama31":
        skip.add("rope_scaling")                                   # a tensor (rope_freqs): read_model's job
        assert config_from_dict(read_model(path)[0]).rope_scaling["rope_type"] == "llama3"
    for field in dataclasses.fields(want):
        if field.name not in skip:
            assert getattr(got, field.name) == getattr(want, field.name), field.name


def test_sizes_for_the_planner(exported):
    folder, path, model = exported("qwen3_5", "f32")
    n = sum(p.numel() for p in model.parameters())
    assert tensor_bytes(path) == 4 * n                             # every tensor F32, none tied
    assert weight_types(path) == {"F32": {"tensors": len(model.state_dict()), "bytes": 4 * n}}
    assert file_type(path) == "ALL_F32"
    f16 = exported("qwen3_5", "f16")[1]
    assert tensor_bytes(f16) < 0.6 * tensor_bytes(path)


def test_llama_q_k_permutation_is_llama_cpp_s(exported):
    """GGUF row 2j+s of a head is HF row s*d/2 + j (LlamaModel.permute); qwen3 is not permuted."""
    folder, path, model = exported("llama", "f32")
    reader = gguf.GGUFReader(str(path))
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    hf_q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    d = TINY["head_dim"]
    assert np.array_equal(q[1], hf_q[d // 2]) and np.array_equal(q[2], hf_q[1])
    _, path, model = exported("qwen3", "f32")
    q = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight").data
    assert np.array_equal(q, model.model.layers[0].self_attn.q_proj.weight.detach().numpy())


def test_qwen35_value_heads_are_tiled(exported):
    """Value head h of the GGUF reads key head h % Hk: with 2 key and 4 value heads, tiled
    head 1 is grouped head 2 (conversion/qwen.py _LinearAttentionVReorderBase)."""
    _, path, model = exported("qwen3_5", "f32")
    reader = gguf.GGUFReader(str(path))
    a = next(t for t in reader.tensors if t.name == "blk.0.ssm_a").data
    a_log = model.model.layers[0].linear_attn.A_log.detach()
    assert np.allclose(a, -torch.exp(a_log[[0, 2, 1, 3]]).numpy())


# ----- tokenizer ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_round_trips(exported, kind):
    from tokenizers import Tokenizer
    folder, path, _ = exported(kind, "f32")
    original = Tokenizer.from_file(str(folder / "tokenizer.json"))
    _, _, tokenizer, tok_config = read_model(path)
    for text in SAMPLES:
        want = original.encode(text).ids
        assert tokenizer.encode(text).ids == want, text
        assert tokenizer.decode(want, skip_special_tokens=False) == original.decode(want, skip_special_tokens=False)
        assert tokenizer.decode(want) == original.decode(want)
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["pad_token"] == "<|endoftext|>"
    assert tok_config["add_bos_token"] == kind.startswith("llama")
    assert tok_config["bos_token"] == (BOS if kind.startswith("llama") else None)


def test_pre_tokenizer_steps_pick_llama_cpp_s_pre_type():
    from kvslim.gguf.writer import pre_tokenizer_name
    from kvslim.loading import default_model
    bundled = json.loads((default_model() / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre_tokenizer_name(bundled) == "starcoder"                 # Digits(individual) + ByteLevel
    assert pre_tokenizer_name({"type": "ByteLevel", "use_regex": True}) == "gpt-2"
    split = {"type": "Split", "pattern": {"Regex": N.QWEN35_REGEX}, "behavior": "Isolated"}
    assert pre_tokenizer_name({"type": "Sequence", "pretokenizers": [
        split, {"type": "ByteLevel", "use_regex": False}]}) == "qwen35"
    runs = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False},
                                                   {"type": "ByteLevel", "use_regex": True}]}
    with pytest.raises(ValueError, match="no llama.cpp pre-type known here"):
        pre_tokenizer_name(runs)


def test_bundled_tokenizer_survives_the_gguf(bundled_gguf):
    """The bundled model's digit-splitting pre-tokenizer, written as "starcoder" and read
    back, tokenizes a long mixed text exactly as the original tokenizer.json."""
    from kvslim.gguf.reader import open_gguf, read_tokenizer
    from kvslim.loading import default_model
    from kvslim.tokenizer import Tokenizer
    reader = open_gguf(bundled_gguf)
    assert reader.get_field("tokenizer.ggml.pre").contents() == "starcoder"
    text = mixed_text()
    want = Tokenizer.from_folder(default_model()).encode(text, add_special=False)
    assert read_tokenizer(reader)[0].encode(text, add_special_tokens=False).ids == want


def test_gpt2_pre_tokenizer_files_still_read(tiny_folder, tmp_path):
    """Files written before the "starcoder" export (plain ByteLevel -> "gpt-2") read as before."""
    from tokenizers import Tokenizer
    folder, _ = tiny_folder("llama")
    path = convert_hf_to_gguf(folder, tmp_path / "gpt2-pre.gguf", "f16")
    _, _, tokenizer, _ = read_model(path)
    text = mixed_text(1)
    assert tokenizer.encode(text).ids == Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


# ----- bad input ----------------------------------------------------------------
def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_config(path)
    with pytest.raises(ValueError, match="no such file"):
        read_model(tmp_path / "missing.gguf")


def test_unsupported_model_type_is_not_exported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(ValueError, match="model_type 'gpt2' cannot be exported"):
        convert_hf_to_gguf(tmp_path, tmp_path / "out.gguf")


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_config(path)
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_model(path)


def with_mtp_block(src, dst) -> int:
    """A copy of the GGUF ``src`` with one multi-token-prediction block appended, as
    Qwen3.5 files carry (block_count counts it, nextn_predict_layers says so); its bytes."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    n_layer = 0
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == f"{arch}.block_count":
            n_layer = value
            value += 1
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    mtp = np.ones((8, 16), dtype=np.float32)
    writer.add_tensor(f"blk.{n_layer}.nextn.eh_proj.weight", mtp)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return mtp.nbytes


def test_mtp_block_is_neither_loaded_nor_counted(exported, tmp_path):
    _, path, _ = exported("qwen3_5", "f32")
    mtp_path = tmp_path / "with-mtp.gguf"
    mtp_bytes = with_mtp_block(path, mtp_path)
    assert sum(int(t.n_bytes) for t in gguf.GGUFReader(str(mtp_path)).tensors) == tensor_bytes(path) + mtp_bytes
    assert tensor_bytes(mtp_path) == tensor_bytes(path)            # the planner's weight bytes
    assert read_config(mtp_path)["num_hidden_layers"] == read_config(path)["num_hidden_layers"]
    assert torch.equal(gguf_logits(mtp_path), gguf_logits(path))


# ----- split files -----------------------------------------------------------------
def test_a_split_model_loads_from_any_part_as_one_file(exported, tmp_path, capsys):
    """llama.cpp's split layout (``<stem>-0000i-of-0000N.gguf``, metadata in the first part):
    written by ``kvslim convert --split-max-tensors``, read from any part with the one file's
    logits, sizes and types; the quantized matrices stay memory-mapped from their own part."""
    from kvslim.cli import main
    folder, single, _ = exported("qwen3_5_moe", "q8_0")
    assert main(["convert", str(folder), "-o", str(tmp_path / "m.gguf"), "--type", "q8_0",
                 "--split-max-tensors", "12"]) == 0
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) >= 3 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf"
    assert f"and {len(parts) - 1} more parts" in capsys.readouterr().out
    ids = list(range(3, 30))
    want = kvslim.load(single, ctx=64, dtype="f32").logits(ids)
    for part in (parts[0], parts[-1]):
        assert torch.equal(kvslim.load(part, ctx=64, dtype="f32").logits(ids), want)
    assert tensor_bytes(parts[1]) == tensor_bytes(single)
    assert weight_types(parts[0]) == weight_types(single)
    assert file_type(parts[0]) == file_type(single) == "MOSTLY_Q8_0"
    assert read_config(parts[2]) == read_config(single)


def test_a_split_model_with_a_part_missing_or_renamed_is_refused_by_name(exported, tmp_path):
    folder, _, _ = exported("qwen3_5", "f32")
    first = convert_hf_to_gguf(folder, tmp_path / "m.gguf", "f32", split_max_tensors=10)
    parts = sorted(tmp_path.glob("m-*.gguf"))
    parts[1].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(ValueError, match=rf"{parts[1].name}: missing; the model is split in {len(parts)} files"):
        kvslim.load(first)
    (tmp_path / "elsewhere.gguf").rename(tmp_path / "renamed.gguf")
    with pytest.raises(ValueError, match="not named <prefix>-NNNNN-of-.*cannot be found"):
        read_config(tmp_path / "renamed.gguf")
    parts[2].rename(parts[1])                                               # parts 2 and 3 swapped
    (tmp_path / "renamed.gguf").rename(parts[2])
    with pytest.raises(ValueError, match=f"{parts[1].name}: its split.no/split.count metadata say it is not part 2"):
        read_config(first)


def test_split_is_refused_for_llama_quantize_types(tmp_path, capsys):
    from kvslim.cli import main
    from kvslim.loading import default_model
    assert main(["convert", str(default_model()), "-o", str(tmp_path / "m.gguf"), "--type", "q4_k",
                 "--split-max-tensors", "10"]) == 2
    assert "--split-max-tensors applies to the types kvslim writes itself" in capsys.readouterr().err
