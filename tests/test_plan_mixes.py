"""The planner's llama.cpp mixes (``plan.catalog.WEIGHT_QUANTS``) against llama-quantize's own
files, tensor by tensor: for each mix and model shape, the type ``plan.tensor_types`` predicts
for every tensor is the type llama.cpp gives it (its quantizer's dry run, held to the files it
writes). The shapes cover its rules' conditions: GQA of 4
and of 2, tied embeddings, DeltaNet layers (attn_qkv counted as attn_v), routed and shared
experts (>= 4 experts). (A dense Qwen3.5 with GQA 4 also matched every mix when the rules were
written; it adds no condition the three here lack.) The files are made with an importance matrix (of ones), as the
i-quant files people download are."""
from __future__ import annotations

import numpy as np
import pytest

from kvslim import peer, plan
from kvslim.plan import catalog
from kvslim.plan.weight_size import model_facts, tensor_types

pytestmark = pytest.mark.skipif(not peer.available(), reason="no llama.cpp binding (pip install 'kvslim[peer]')")

WIDE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=8)   # rows of whole 256-value blocks
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_conv_kernel_dim=4)
SHAPES = {
    "qwen35_moe4": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                         shared_expert_intermediate_size=256, **LINEAR)),
    "llama_gqa4": ("LlamaConfig", "LlamaForCausalLM",
                   dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=256)),
    "llama_gqa2_tied": ("LlamaConfig", "LlamaForCausalLM",
                        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                             tie_word_embeddings=True)),
}
# every mix on the mixture (the most rules apply there); on the other shapes one of each family
ALL_MIXES = [m for m in catalog.WEIGHT_QUANTS if m not in ("f32", "f16", "bf16", "q8_0", "q6_k", "q4_0")]
FAMILIES = ["q3_k_m", "iq4_xs", "iq3_xxs", "q2_k", "iq2_xxs"]          # where GQA, ties and DeltaNet matter


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """shape -> (folder, its f32 GGUF), made once."""
    from kvslim.loading import convert_hf_to_gguf

    from .conftest import saved_random_model
    made = {}

    def get(shape: str):
        if shape not in made:
            config_class, model_class, extra = SHAPES[shape]
            folder = saved_random_model(tmp_path_factory.mktemp(shape), config_class, model_class, **WIDE, **extra)
            made[shape] = folder, convert_hf_to_gguf(folder, folder / "f32.gguf", "f32")
        return made[shape]
    return get


@pytest.mark.parametrize("shape", SHAPES)
def test_the_planner_predicts_llama_quantize_s_type_for_every_tensor(exported, shape):
    """Every mix through llama-quantize's dry run (its choice of types, nothing quantized: the
    i-quants' searches took 78 s of this test's 90 when it quantized them all)."""
    folder, source = exported(shape)
    model = plan.resolve_model(str(folder))
    wrong, ones = {}, _ones(source)
    for mix in ALL_MIXES if shape == "qwen35_moe4" else FAMILIES:
        reported = {name.removesuffix(".weight"): kind for name, kind in peer.quantize_types(source, mix, ones).items()}
        predicted = dict(zip((t.name for t in model.tensors),
                             tensor_types(model.tensors, catalog.WEIGHT_QUANTS[mix], *model_facts(model.config))))
        assert predicted.keys() == reported.keys(), mix
        wrong[mix] = {n: (predicted[n], k) for n, k in reported.items() if predicted[n] != k}
    assert not any(wrong.values()), {m: w for m, w in wrong.items() if w}


@pytest.mark.parametrize("shape,mix", [("qwen35_moe4", "q3_k_m"), ("llama_gqa4", "iq2_xxs")])
def test_the_dry_run_reports_the_types_llama_quantize_writes(exported, shape, mix, tmp_path):
    """The dry run above stands for the files: its report is, tensor for tensor, what a real
    quantization writes (a k-quant mix over experts and DeltaNet, an i-quant one with its
    importance matrix over GQA 4; the i-quants' first use builds their grids, 2-9 s each)."""
    import gguf
    _, source = exported(shape)
    out = peer.quantize(source, tmp_path / f"{mix}.gguf", mix, 2, _ones(source))
    written = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors}
    assert peer.quantize_types(source, mix, _ones(source)) == written
    assert len(set(written.values())) >= 3                   # a mix, not one type throughout


def test_a_log_without_tensor_lines_is_refused():
    """A llama.cpp whose report kvslim cannot read says so instead of predicting nothing."""
    assert peer._reported_types("[  1/  2]  blk.0.ffn_up.weight  - [  256,  256,  1,  1], type =    f32, "
                                "size =  0.25 MiB ->  0.04 MiB (q4_K)\n") == {"blk.0.ffn_up.weight": "q4_k"}
    with pytest.raises(RuntimeError, match="reported no tensors"):
        peer._reported_types("llama_model_quantize_impl: model size = 39.15 MiB\n")


def _ones(source) -> dict[str, np.ndarray]:
    """An importance matrix of ones for every matrix of ``source`` (llama.cpp refuses IQ1 and IQ2 without one)."""
    import gguf
    return {t.name: np.ones(int(np.prod(t.shape)) // int(t.shape[1]), np.float32)
            for t in gguf.GGUFReader(source).tensors if len(t.shape) >= 2}
