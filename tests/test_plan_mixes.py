"""The planner's llama.cpp mixes (``plan.catalog.WEIGHT_QUANTS``) against llama-quantize's own
files, tensor by tensor: for each mix and model shape, the type ``plan.tensor_types`` predicts
for every tensor is the type llama.cpp wrote. The shapes cover its rules' conditions: GQA of 4
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
    import torch
    tf = pytest.importorskip("transformers")
    from kvslim.loading import convert_hf_to_gguf

    from .conftest import randomize, write_tiny_tokenizer
    made = {}

    def get(shape: str):
        if shape not in made:
            config_class, model_class, extra = SHAPES[shape]
            torch.manual_seed(0)
            model = getattr(tf, model_class)(getattr(tf, config_class)(**WIDE, **extra)).eval()
            folder = tmp_path_factory.mktemp(shape)
            randomize(model).save_pretrained(folder)
            write_tiny_tokenizer(folder, WIDE["vocab_size"])
            made[shape] = folder, convert_hf_to_gguf(folder, folder / "f32.gguf", "f32")
        return made[shape]
    return get


@pytest.mark.parametrize("shape", SHAPES)
def test_the_planner_predicts_llama_quantize_s_type_for_every_tensor(exported, shape, tmp_path):
    import gguf
    folder, source = exported(shape)
    ones = {t.name: np.ones(int(np.prod(t.shape)) // int(t.shape[1]), np.float32)
            for t in gguf.GGUFReader(source).tensors if len(t.shape) >= 2}
    model = plan.resolve_model(str(folder))
    wrong = {}
    for mix in ALL_MIXES if shape == "qwen35_moe4" else FAMILIES:
        out = peer.quantize(source, tmp_path / f"{mix}.gguf", mix, 2, ones)
        written = {t.name.removesuffix(".weight"): t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors}
        predicted = dict(zip((t.name for t in model.tensors),
                             tensor_types(model.tensors, catalog.WEIGHT_QUANTS[mix], *model_facts(model.config))))
        assert predicted.keys() == written.keys(), mix
        wrong[mix] = {n: (predicted[n], k) for n, k in written.items() if predicted[n] != k}
    assert not any(wrong.values()), {m: w for m, w in wrong.items() if w}
