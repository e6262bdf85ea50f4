"""kvslim's model files against transformers' own implementations (the oracle).

Tiny random models for every supported architecture are built and saved by
transformers; kvslim loads the folder and must give the same logits over a
prefill and 32 cached decode steps (f32 KV cache, so the cache adds no error).
"""
from __future__ import annotations

import pytest
import torch

from kvslim.cache import KVCache
from kvslim.loading.hf import read_config, read_state_dict
from kvslim.loading.instantiate import instantiate
from kvslim.models import Batch, build, config_from_dict
from kvslim.models.delta_rule import chunk_gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule

from .conftest import TINY_TYPES, assert_devices_agree

TOL = 1e-4


def load_tiny(folder):
    return instantiate(config_from_dict(read_config(folder)), read_state_dict(folder), torch.float32)


def hf_stepwise(model, prompt: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """transformers' logits for the prompt, then one cached step per token of ``steps``."""
    with torch.no_grad():
        out = model(prompt[None], use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for tok in steps:
            out = model(tok.view(1, 1), past_key_values=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    return torch.cat(rows)


def kvslim_stepwise(model, prompt, steps, type_k="f32", type_v="f32", slot=0, caches=None,
                    device="cpu") -> torch.Tensor:
    caches = caches or model.make_cache(256, 1, type_k, type_v, device=device)
    rows = [model(Batch.build([(slot, prompt, 0)], device=device), caches, all_logits=True)]
    for i, tok in enumerate(steps):
        rows.append(model(Batch.build([(slot, [int(tok)], len(prompt) + i)], device=device), caches, all_logits=True))
    return torch.cat(rows)


def random_tokens(n: int, seed: int, vocab: int = 320) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", TINY_TYPES)
def test_prefill_and_32_decode_steps_match_transformers(tiny_folder, kind):
    folder, hf = tiny_folder(kind)
    model = load_tiny(folder)
    prompt, steps = random_tokens(70, 1), random_tokens(32, 2)   # 70: two DeltaNet chunks, one partial
    want = hf_stepwise(hf, prompt, steps)
    got = kvslim_stepwise(model, prompt, steps)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL
    assert want.std() > 0.1                                        # logits carry signal, not all zeros


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3"])
def test_chunked_prefill_equals_one_shot(tiny_folder, kind):
    model = load_tiny(tiny_folder(kind)[0])
    prompt = random_tokens(90, 3)
    one = model(Batch.build([(0, prompt, 0)]), model.make_cache(128, 1, "f32", "f32"), all_logits=True)
    caches = model.make_cache(128, 1, "f32", "f32")
    parts = [model(Batch.build([(0, prompt[s:s + 13], s)]), caches, all_logits=True) for s in range(0, 90, 13)]
    assert (torch.cat(parts) - one).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "llama"])
def test_batch_of_different_lengths_equals_each_alone(tiny_folder, kind):
    model = load_tiny(tiny_folder(kind)[0])
    prompts = [random_tokens(n, 10 + n) for n in (5, 17, 30)]
    steps = [random_tokens(6, 20 + i) for i in range(3)]
    alone = [kvslim_stepwise(model, p, s) for p, s in zip(prompts, steps)]
    caches = model.make_cache(128, 3, "f32", "f32")
    rows = [[] for _ in prompts]
    out = model(Batch.build([(i, p, 0) for i, p in enumerate(prompts)]), caches, all_logits=True)
    begin = 0
    for i, p in enumerate(prompts):
        rows[i].append(out[begin:begin + len(p)])
        begin += len(p)
    for t in range(6):                                             # all three decode in one forward
        batch = Batch.build([(i, [int(steps[i][t])], len(prompts[i]) + t) for i in range(3)])
        out = model(batch, caches)
        for i in range(3):
            rows[i].append(out[i:i + 1])
    for i in range(3):
        assert (torch.cat(rows[i]) - alone[i]).abs().max().item() <= TOL


def test_sequence_in_another_slot_is_unaffected(tiny_folder):
    model = load_tiny(tiny_folder("qwen3_5")[0])
    prompt, steps = random_tokens(20, 5), random_tokens(4, 6)
    caches = model.make_cache(64, 2, "f32", "f32")
    model(Batch.build([(0, random_tokens(33, 7), 0)]), caches)     # slot 0 busy with something else
    got = kvslim_stepwise(model, prompt, steps, slot=1, caches=caches)
    assert (got - kvslim_stepwise(model, prompt, steps)).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_fused_projections_follow_the_model_to_a_dtype_or_device(tiny_folder, kind):
    """``.to()`` converts each linear on its own; the fused matmuls must read the converted weights
    (a fused tensor left behind on the old device broke every CUDA test of a model moved by .to)."""
    folder, _ = tiny_folder(kind)
    model = load_tiny(folder)
    fused = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    assert fused
    prompt, steps = random_tokens(20, 3), random_tokens(4, 4)
    want = kvslim_stepwise(model, prompt, steps)
    model.to(torch.float64)
    for m in fused:
        linears = [c for c in m.children() if isinstance(c, torch.nn.Linear)]
        assert len(m.fused.groups) == 1 and all(c.weight.dtype == torch.float64 for c in linears)
        assert max(_sharing(linears)) == len(m.fused.sizes)                # views of one tensor again
    got = kvslim_stepwise(model, prompt, steps)
    assert (got - want).abs().max().item() < 1e-4


def _sharing(linears) -> list[int]:
    """How many of the linears' weights view each storage."""
    counts: dict = {}
    for c in linears:
        ptr = c.weight.untyped_storage().data_ptr()
        counts[ptr] = counts.get(ptr, 0) + 1
    return list(counts.values())


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_quantized_projections_fuse_by_block_type(tiny_folder, kind):
    """Quantized linears on one input are one matmul a block type (``Fused``, ``QuantLinear.fusion_key``):
    a 35B-A3B decode step on a GPU makes 161 GEMVs instead of 311. With one projection of each
    fused set in another type (as a GGUF mix has a Q6_K v_proj beside Q4_K q and k), the rest
    still fuse; each one's blocks are views of its group's, and the logits are the unfused ones'."""
    from kvslim import weights as W
    from kvslim.loading.instantiate import quantizable
    from kvslim.models import build_on_meta
    folder, _ = tiny_folder(kind)
    config, state = config_from_dict(read_config(folder)), read_state_dict(folder)
    odd = ("in_proj_b", "v_proj", "up_proj")                       # the other type in each set
    state = {k: W.QuantTensor.quantize(v, W.get("q4_0" if any(o in k for o in odd) else "q8_0"))
             if k in quantizable(build_on_meta(config)) else v for k, v in state.items()}
    model = instantiate(config, state, torch.float32)
    fused = [m for m in model.modules() if getattr(m, "fused", None) is not None]
    assert fused
    for m in fused:
        sizes = sorted(len(members) for members, _ in m.fused.groups)
        assert sizes[0] == 1 and sizes[-1] >= 2                     # the odd one alone, the others together
        shared = _sharing([c for c in m.children() if isinstance(c, W.QuantLinear)])
        assert sorted(n for n in shared if n > 1) == [n for n in sizes if n > 1]   # each group's blocks: one tensor
    prompt, steps = random_tokens(20, 3), random_tokens(4, 4)
    want = kvslim_stepwise(model, prompt, steps)
    for m in fused:
        m.fused = None
    got = kvslim_stepwise(model, prompt, steps)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", TINY_TYPES)
@pytest.mark.parametrize("type_k,type_v", [("f32", "f32"), ("q8_0", "turbo4")])
def test_cuda_logits_match_cpu(tiny_folder, kind, type_k, type_v):
    """Every architecture on the GPU (torch backend, the Triton kernels and fla-core where they
    serve) against the same model on the CPU: a prefill and 8 cached decode steps."""
    path, _ = tiny_folder(kind)
    prompt, steps = random_tokens(40, 5), random_tokens(8, 6)
    rows = {device: kvslim_stepwise(load_tiny(path).to(device), prompt, steps, type_k, type_v, device=device).cpu()
            for device in ("cpu", "cuda")}
    unquantized = None if type_k == "f32" else kvslim_stepwise(load_tiny(path), prompt, steps)
    assert_devices_agree(rows["cuda"], rows["cpu"], unquantized)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_fla_prompts_of_a_bf16_model_stay_within_its_own_rounding(tiny_folder, kind, monkeypatch):
    """fla-core's chunked kernel (tf32 products) serves the DeltaNet prompts of half models only.
    A bf16 model on the GPU with the kernels on, its prompts through fla-core against the same
    model with the torch chunked form (float32 products): the two differ by less than the bf16
    model differs from its float32 self (bf16's own rounding). 70 tokens: two 64-token chunks."""
    from kvslim import gpu
    from kvslim.gpu import delta_rule as fla
    if fla._fla() is None:
        pytest.skip("fla-core is not installed")
    monkeypatch.setattr(gpu, "TRITON", True)
    path, _ = tiny_folder(kind)
    prompt, steps = random_tokens(70, 7), random_tokens(4, 8)
    model = instantiate(config_from_dict(read_config(path)), read_state_dict(path), torch.bfloat16).to("cuda")
    assert fla.serves(torch.device("cuda"), torch.bfloat16)
    with_fla = kvslim_stepwise(model, prompt, steps, device="cuda").float().cpu()
    monkeypatch.setattr(fla, "serves", lambda device, dtype=None: False)
    torch_form = kvslim_stepwise(model, prompt, steps, device="cuda").float().cpu()
    own = (torch_form - kvslim_stepwise(load_tiny(path).to("cuda"), prompt, steps, device="cuda").cpu()).abs().max()
    assert (with_fla - torch_form).abs().max() <= own, ((with_fla - torch_form).abs().max(), own)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_rms_norm_cuda_takes_is_the_model_s_norm(zero_centered, dtype):
    """On CUDA, RMSNorm and the DeltaNet output norm take torch's fused RMSNorm (one kernel);
    here (F.rms_norm's composite on the CPU) it must be the norms' own forms: the same weight
    (1 + w when zero-centred) and eps, float32 to 1e-6, bf16 to one rounding."""
    from kvslim.models.layers import RMSNorm
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(256, 1e-6, zero_centered=zero_centered).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen) * 0.3)
    x = (torch.randn(5, 4, 256, generator=gen) * torch.logspace(-4, 1, 5)[:, None, None]).to(dtype)   # eps matters
    want, got = norm(x), norm.fused_norm(x)
    assert got.dtype == want.dtype == dtype
    ulp = 1e-6 if dtype == torch.float32 else 2.0 ** -7             # bf16: 8 significant bits
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs().clamp(min=1e-3)).all()


def test_the_zero_centred_norm_keeps_1_plus_w_until_its_weight_changes():
    """``shifted_weight`` (the fused norm's 1 + w, cached so a CUDA decode step does not launch
    an add per norm) is computed again whenever the weight changes: written in place, moved to
    another dtype, or replaced by a load; an inference tensor's is never cached."""
    from kvslim.models.layers import RMSNorm
    norm = RMSNorm(8, 1e-6, zero_centered=True)
    first = norm.shifted_weight()
    assert first is norm.shifted_weight() and torch.equal(first, torch.ones(8))       # cached
    with torch.no_grad():
        norm.weight.add_(0.5)                                        # in place: its version moves
    assert torch.equal(norm.shifted_weight(), torch.full((8,), 1.5))
    norm.to(torch.float64)
    assert norm.shifted_weight().dtype == torch.float64 and torch.equal(norm.shifted_weight(), torch.full((8,), 1.5,
                                                                                              dtype=torch.float64))
    norm.load_state_dict({"weight": torch.full((8,), -0.25, dtype=torch.float64)}, assign=True)
    assert torch.equal(norm.shifted_weight(), torch.full((8,), 0.75, dtype=torch.float64))
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.allclose(norm.fused_norm(x), norm(x))
    with torch.inference_mode():
        frozen = RMSNorm(8, 1e-6, zero_centered=True)
        assert frozen.shifted_weight() is not frozen.shifted_weight()


@pytest.mark.parametrize("t", [1, 5, 64, 100])
def test_chunked_delta_rule_matches_recurrent_reference(t):
    g = torch.Generator().manual_seed(t)
    b, h, dk, dv = 2, 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.rand(b, t, h, generator=g) * 2
    beta = torch.rand(b, t, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    o, s = chunk_gated_delta_rule(q, k, v, decay, beta, state, chunk=16)
    assert (o - o_ref).abs().max() < 1e-4 and (s - s_ref).abs().max() < 1e-4
    s_step = state.clone()                                          # the in-place decode step, token by token
    o_step = torch.stack([gated_delta_step(q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i], s_step)
                          for i in range(t)], dim=1)
    assert (o_step - o_ref).abs().max() < 1e-4 and (s_step - s_ref).abs().max() < 1e-4


def test_quantized_kv_stays_close_and_turbo_uses_its_bytes(tiny_folder):
    model = load_tiny(tiny_folder("qwen3_5")[0])
    prompt = random_tokens(200, 8)
    ref = torch.log_softmax(kvslim_stepwise(model, prompt, []), -1)
    q8 = torch.log_softmax(kvslim_stepwise(model, prompt, [], "q8_0", "q8_0"), -1)
    kld = (ref.exp() * (ref - q8)).sum(-1)
    assert kld.max().item() < 1e-3
    caches = model.make_cache(512, 1, "f16", "turbo3")
    model(Batch.build([(0, prompt, 0)]), caches)
    kv = [c for c in caches if isinstance(c, KVCache)]
    # one attention layer: 2 KV heads, head_dim 32 -> f16 K 64 B, turbo3 V (32 values, one block) 14 B per head
    assert kv[0].nbytes == 256 * 2 * (64 + kv[0].spec.v_row_bytes)   # one 256-token page
    assert kv[0].spec.v_row_bytes == 14


def test_unknown_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'gpt_bigcode' is not supported"):
        config_from_dict({"model_type": "gpt_bigcode"})


def test_plan_only_and_incomplete_configs_are_refused_clearly():
    d = {"model_type": "qwen3_moe", "vocab_size": 160, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    config = config_from_dict(d)                                   # the planner reads it
    assert not config.runnable and config.num_key_value_heads == 4 and config.head_dim == 16
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' can be planned but not run"):
        build(config)
    with pytest.raises(ValueError, match="config is missing the field 'num_experts'"):
        config_from_dict({k: v for k, v in d.items() if k != "num_experts"})
    with pytest.raises(ValueError, match="config is missing the field 'intermediate_size'"):
        config_from_dict({**d, "model_type": "llama"})


def test_missing_weight_is_named(tiny_folder):
    folder, _ = tiny_folder("llama")
    sd = read_state_dict(folder)
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        instantiate(config_from_dict(read_config(folder)), sd)


def test_multimodal_checkpoint_loads_its_language_model_fused_or_per_expert(tmp_path):
    """Qwen3.5/3.6 ship as ...ForConditionalGeneration with fused experts; transformers'
    re-saves store experts one by one. Both load, and match the text-only forward."""
    tf = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from .conftest import LINEAR, MOE, TINY, randomize

    vision = tf.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                    out_hidden_size=TINY["hidden_size"], patch_size=4, temporal_patch_size=1,
                                    spatial_merge_size=1)
    hf = tf.Qwen3_5MoeForConditionalGeneration(
        tf.Qwen3_5MoeConfig(text_config=dict(**TINY, **LINEAR, **MOE), vision_config=vision.to_dict())).eval()
    randomize(hf)
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    hf.save_pretrained(per_expert)
    fused.mkdir()
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    ids = random_tokens(40, 9)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
    for folder in (per_expert, fused):
        got = kvslim_stepwise(load_tiny(folder), ids, [])
        assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop_over_chosen_experts(dtype):
    """The GPU decode form of a mixture (the chosen experts' matrices gathered by id on the
    device, batched products; no host sync) against the loop over chosen experts, run here on
    the CPU: the same sums, in float32 where the loop adds in the activations' dtype."""
    from kvslim.models.layers import Experts
    gen = torch.Generator().manual_seed(0)
    experts = Experts(6, 32, 16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 32, 32, generator=gen) * 0.2)
        experts.down_proj.copy_(torch.randn(6, 32, 16, generator=gen) * 0.2)
    experts = experts.to(dtype)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    chosen = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(5)])
    weights = torch.rand(5, 3, generator=gen).softmax(-1)
    with torch.no_grad():
        got, want = experts.grouped(x, weights, chosen), experts.loop(x, weights, chosen)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert got.dtype == dtype and experts(x, weights, chosen).equal(want)    # the CPU keeps the loop
