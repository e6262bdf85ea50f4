"""The memory planner: the published KV/state figures exactly, the allocator's own bytes,
weight sizes near real GGUF files, searches consistent with totals, and a CLI that
refuses bad input with a clear message."""
from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch

import kvslim
from kvslim import cli, formats, models, plan
from kvslim.cache import KVCache
from kvslim.loading import convert_hf_to_gguf
from kvslim.plan import catalog
from kvslim.tools import plan as plan_tool
from kvslim.weights import weight_bytes

MIB, GIB = 1 << 20, 1 << 30
TINY = dict(vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, intermediate_size=96)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def config(name: str):
    return plan.resolve_model(name).config


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ----- the published figures (shared/FACTS.md, issue 6) --------------------------------------------

@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b", "qwen3.5-35b-a3b"])
def test_35b_a3b_kv_and_state(name):
    c = config(name)
    assert plan.kv_bytes(c, 1, 1, "f16", "f16", 1) == 20_480
    assert plan.kv_bytes(c, 32_768, 1, "f16", "f16") == 671_088_640 == 640 * MIB
    assert plan.kv_bytes(c, 4096, 1, "f16", "f16") == 80 * MIB
    assert plan.state_bytes(c, 1) == 62.8125 * MIB
    assert plan.state_bytes(c, 4) == 251.25 * MIB
    # the conv state is in: 30 DeltaNet layers x 3 columns of conv_dim (2 x 2048 + 4096) in f32
    recurrent_only = 30 * 32 * 128 * 128 * 4
    assert plan.state_bytes(c, 1) - recurrent_only == 30 * 3 * 8192 * 4


def test_issue_figures_with_four_slots():
    """-c 32768 -np 4: the context is shared (8192 per slot) as llama-server shares it."""
    model = plan.resolve_model("qwen3.5-35b-a3b")
    mem = plan.breakdown(model, plan.Request(32_768, 4))
    assert mem.kv == 671_088_640
    assert mem.state == 251.25 * MIB


@pytest.mark.parametrize("name", ["qwen3.6-27b", "qwen3.5-27b"])
def test_27b_kv_and_state(name):
    c = config(name)
    assert plan.kv_bytes(c, 1, 1, "f16", "f16", 1) == 65_536
    assert round(plan.state_bytes(c, 1) / MIB, 1) == 149.6


def test_llama_8b_is_all_kv():
    c = config("llama-3.1-8b")
    assert plan.kv_bytes(c, 1, 1, "f16", "f16", 1) == 128 * 1024
    assert plan.state_bytes(c, 4) == 0


@pytest.mark.parametrize("type_k,type_v,expected", [
    ("q8_0", "q8_0", 10_880), ("turbo4", "turbo4", 5_280), ("turbo3", "turbo3", 4_000), ("q8_0", "turbo3", 7_440),
    ("turbo2", "turbo2", 2_720),
])
def test_compressed_kv_sizes_come_from_the_format_table(type_k, type_v, expected):
    c = config("qwen3.6-35b-a3b")                           # 10 attention layers x 2 KV heads x head_dim 256
    rows = formats.get(type_k).row_bytes(256) + formats.get(type_v).row_bytes(256)
    assert plan.kv_bytes(c, 1, 1, type_k, type_v, 1) == 10 * 2 * rows == expected


def test_the_48_gb_claim_is_refuted():
    """A guide claims 35B-A3B needs 1.5 GB of q8_0 KV at 8K and 48 GB at 262K (dense arithmetic)."""
    c = config("qwen3.6-35b-a3b")
    assert plan.kv_bytes(c, 262_144, 1, "f16", "f16") == 5 * GIB
    assert 48e9 / plan.kv_bytes(c, 262_144, 1, "f16", "f16") > 8
    assert plan.kv_bytes(c, 8192, 1, "q8_0", "q8_0") == 85 * MIB


# ----- one source of truth: the allocator's own bytes --------------------------------------------

@pytest.mark.parametrize("model_type,extra", [("qwen3_5_text", LINEAR), ("qwen3_5_moe_text", {**LINEAR, **MOE}),
                                              ("llama", {})])
@pytest.mark.parametrize("type_k,type_v,window", [("f16", "f16", 0), ("q8_0", "turbo3", 0), ("q8_0", "turbo3", 16)])
def test_planned_bytes_equal_what_the_cache_allocates(model_type, extra, type_k, type_v, window):
    d = dict(model_type=model_type, **TINY, **extra)
    model = plan.Model("tiny", models.config_from_dict(d), "hf")
    req = plan.Request(ctx=600, n_slots=2, type_k=type_k, type_v=type_v, f16_window=window)   # 300 a slot: 2 pages
    caches = models.build(model.config).make_cache(req.ctx_per_slot, req.n_slots, type_k, type_v, f16_window=window)
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        if isinstance(cache, KVCache):
            for slot in range(req.n_slots):
                k, v = (torch.randn(req.ctx_per_slot, 2, 64, generator=gen) for _ in range(2))
                cache.append(slot, k, v)
    mem = plan.breakdown(model, req)
    assert mem.kv == sum(c.nbytes for c in caches if isinstance(c, KVCache))
    assert mem.state == sum(c.nbytes for c in caches if not isinstance(c, KVCache))


@pytest.mark.parametrize("model_type,extra", [("qwen3_5_text", LINEAR), ("qwen3_5_moe_text", {**LINEAR, **MOE}),
                                              ("qwen3_next", {**LINEAR, **MOE}), ("llama", {}), ("qwen3", {}),
                                              ("qwen2", {})])
def test_parameter_count_equals_kvslims_own_modules(model_type, extra):
    c = models.config_from_dict(dict(model_type=model_type, **TINY, **extra))
    assert plan.parameter_counts(c)[0] == sum(p.numel() for p in models.build(c).parameters())


# ----- weights and parameters ---------------------------------------------------------------------

@pytest.mark.parametrize("name,total_b,active_b", [
    ("qwen3.6-35b-a3b", 35, 3), ("qwen3.6-27b", 27, 27), ("qwen3.5-397b-a17b", 397, 17),
    ("qwen3-next-80b-a3b", 80, 3), ("llama-3.1-8b", 8, 8), ("qwen3-32b", 32.8, 32.8), ("qwen3-30b-a3b", 30.5, 3.3),
])
def test_parameter_counts_match_the_names(name, total_b, active_b):
    """Derived from the configs; within 3% of the published total (hybrid names also count a vision
    tower and an MTP head the planner leaves out) and within 1B of the active count, embeddings included."""
    total, active = plan.parameter_counts(config(name))
    assert total / 1e9 == pytest.approx(total_b, rel=0.03)
    assert abs(active / 1e9 - active_b) < 1.0


@pytest.mark.parametrize("name,quant,low_gb,high_gb", [
    ("qwen3.6-35b-a3b", "q4_k_m", 20.5, 21.5),   # FACTS: about 21 GB
    ("qwen3.6-27b", "q4_k_m", 16.0, 17.0),       # FACTS: 16-17 GB
    ("qwen3.6-35b-a3b", "q8_0", 36.5, 37.5),     # FACTS: about 37 GB
    ("llama-3.1-8b", "q4_k_m", 4.85, 5.0),       # the common Q4_K_M file: 4.92 GB
    ("llama-3.1-8b", "q8_0", 8.45, 8.6),         # 8.54 GB
])
def test_weight_sizes_near_real_files(name, quant, low_gb, high_gb):
    size = plan.weight_size(plan.resolve_model(name), quant).total / 1e9
    assert low_gb <= size <= high_gb


def test_weight_mixes_shrink_in_order():
    model = plan.resolve_model("qwen3.6-35b-a3b")
    sizes = [plan.weight_size(model, q).total for q in catalog.WEIGHT_QUANTS if q != "bf16"]
    assert sizes == sorted(sizes, reverse=True)


def test_q4_k_m_gives_half_the_ffn_down_and_attn_v_six_bits():
    """llama.cpp's use_more_bits picks 16 of 32 layers for attn_v and ffn_down in Llama-3.1-8B."""
    tensors = plan.resolve_model("llama-3.1-8b").tensors
    kinds = plan.tensor_types(tensors, catalog.WEIGHT_QUANTS["q4_k_m"])
    by_role = {}
    for t, k in zip(tensors, kinds):
        by_role.setdefault(t.role, []).append(k)
    assert by_role["attn_v"].count("q6_k") == 16 and by_role["ffn_down"].count("q6_k") == 16
    assert by_role["output"] == ["q6_k"] and by_role["token_embd"] == ["q4_k"]
    assert set(by_role["attn_norm"]) == {"f32"}


# ----- totals, searches, suggestions ----------------------------------------------------------------

def test_total_is_the_sum_and_fit_follows_it():
    model, target = plan.resolve_model("qwen3.6-35b-a3b"), plan.gpu_target("rtx4090")
    p = plan.plan(model, plan.Request(262_144, type_k="q8_0", type_v="turbo3"), target)
    m = p.memory
    assert m.total == m.weights + m.kv + m.state + m.compute
    assert p.headroom == target.memory - m.total and p.fits == (p.headroom >= 0)


@pytest.mark.parametrize("name,n_slots,types,target", [
    ("qwen3.6-35b-a3b", 1, ("f16", "f16"), "rtx4090"), ("qwen3.6-27b", 4, ("q8_0", "turbo3"), "rtx4090"),
    ("llama-3.1-8b", 2, ("f16", "f16"), "rtx4060ti-16gb"), ("qwen3-32b", 1, ("turbo4", "turbo3"), "rtx5090"),
])
def test_largest_context_is_consistent_with_the_totals(name, n_slots, types, target):
    model, tgt = plan.resolve_model(name), plan.gpu_target(target)
    req = plan.Request(4096 * n_slots, n_slots, *types)
    ctx = plan.largest_context(model, req, tgt)
    step = n_slots * req.page_size
    assert ctx > 0 and ctx % step == 0
    assert plan.breakdown(model, dataclasses.replace(req, ctx=ctx)).total <= tgt.memory
    capped = ctx // n_slots >= plan.max_context_per_slot(model.config)
    assert capped or plan.breakdown(model, dataclasses.replace(req, ctx=ctx + step)).total > tgt.memory


def test_nothing_fits_when_the_weights_do_not():
    model, target = plan.resolve_model("qwen3.5-397b-a17b"), plan.gpu_target("rtx4090")
    req = plan.Request(4096)
    assert plan.largest_context(model, req, target) == 0
    assert not plan.plan(model, req, target).fits


def test_suggestions_each_fit():
    model, target = plan.resolve_model("qwen3.6-35b-a3b"), plan.gpu_target("rtx4090")
    req = plan.Request(262_144, 2)
    found = plan.suggestions(model, req, target)
    assert {s.change for s in found} == {"kv_types", "slots", "context", "weights", "tp"}
    assert all(s.total <= target.memory for s in found)
    kv = next(s for s in found if s.change == "kv_types")
    assert kv.flags == "-ctk q8_0 -ctv q8_0"               # the least compressed pair that fits
    assert plan.suggestions(model, dataclasses.replace(req, ctx=4096), target) == []


def test_small_machine_gets_a_combined_suggestion():
    model, target = plan.resolve_model("qwen3.6-27b"), plan.gpu_target("m4pro-24gb")
    req = plan.Request(131_072)
    (only,) = plan.suggestions(model, req, target)
    assert only.change == "weights_and_context" and only.total <= target.memory
    quant, ctx = only.flags.split()[1], int(only.flags.split()[3])
    assert ctx >= 4096 and plan.fits(model, dataclasses.replace(req, weight_quant=quant, ctx=ctx), target)
    huge = plan.resolve_model("qwen3.5-397b-a17b")
    assert plan.suggestions(huge, req, target) == []


def test_decode_ceiling_is_bandwidth_over_bytes_read():
    model, target = plan.resolve_model("llama-3.1-8b"), plan.gpu_target("rtx4090")
    req = plan.Request(8192, depth=0)
    read = plan.weight_size(model, "q4_k_m").read_per_token
    assert plan.decode_ceiling(model, req, target) == pytest.approx(1008e9 / read)
    deep = dataclasses.replace(req, depth=8192)
    assert plan.decode_ceiling(model, deep, target) == pytest.approx(1008e9 / (read + 8192 * 128 * 1024))
    moe = plan.resolve_model("qwen3.6-35b-a3b")
    assert plan.weight_size(moe, "q4_k_m").read_per_token < plan.weight_size(moe, "q4_k_m").total / 8


def test_tensor_parallel_splits_heads_and_replicates_too_few_kv_heads():
    model = plan.resolve_model("qwen3.6-35b-a3b")
    one, two, four = (plan.breakdown(model, plan.Request(32_768, tp=n)) for n in (1, 2, 4))
    assert two.kv == one.kv // 2 and four.kv == two.kv          # 2 KV heads: the 4 GPUs hold one each
    assert two.state == one.state // 2 and four.state == one.state // 4
    assert one.weights / 4 < four.weights < one.weights / 4 * 1.02     # norms and f32 routers replicated
    launch = plan.launch_commands(model, plan.Request(32_768, 2, "q8_0", "turbo3", tp=4))
    assert "--tensor-parallel-size 4" in launch["vllm"] and "--max-model-len 16384" in launch["vllm"]
    assert "--kv-cache-dtype fp8" in launch["vllm"]
    assert "-ctk q8_0 -ctv q4_0" in launch["llama_server"] and "-c 32768 -np 2" in launch["llama_server"]
    assert any("no turbo3" in n for n in launch["notes"])
    assert launch["kvslim"].endswith("-c 32768 -np 2 -ctk q8_0 -ctv turbo3")          # its own types, as planned
    assert any("kvslim serve runs on one device" in n for n in launch["notes"])
    same = plan.launch_commands(model, plan.Request(32_768, 1, "nl4s", "nl4s"))
    assert "-ctk q4_0 -ctv q4_0" in same["llama_server"]
    assert sum("no nl4s" in n for n in same["notes"]) == 2                # llama-server's and vLLM's, once each


# ----- inputs: HF folder, GGUF ----------------------------------------------------------------------

def test_hf_folder_reads_config_json_only(tmp_path):
    nested = {"model_type": "qwen3_5_moe", "text_config": catalog.MODELS["qwen3.6-35b-a3b"].config}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    model = plan.resolve_model(str(tmp_path))
    assert model.source == "hf" and plan.kv_bytes(model.config, 32_768, 1, "f16", "f16") == 640 * MIB
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: .*qwen3_moe"):
        plan.resolve_model(str(tmp_path))
    # a broken config names its file, for the planner and the loader alike
    from kvslim.loading import load_model
    for text, problem in (('{"model_type": "qwen3_5_text"}', "missing the field 'vocab_size'"),
                          ("{bad", "not valid JSON"), ("[1, 2]", "expected a JSON object")):
        (tmp_path / "config.json").write_text(text)
        for read in (plan.resolve_model, load_model):
            with pytest.raises(ValueError, match=f"^{tmp_path / 'config.json'}: .*{problem}"):
                read(str(tmp_path))


def tiny_llama_gguf(path) -> None:
    """A small llama GGUF written with the gguf package: metadata and a few tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "context_length": 4096,
                       "attention.head_count": 4, "attention.head_count_kv": 2}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10_000.0)
    w.add_tensor("token_embd.weight", np.zeros((160, 64), dtype=np.float16))
    w.add_tensor("blk.0.attn_v.weight", np.zeros((32, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_weights_are_the_files_tensor_bytes(tmp_path):
    reader = pytest.importorskip("kvslim.gguf.reader")
    path = tmp_path / "tiny.gguf"
    tiny_llama_gguf(path)
    model = plan.resolve_model(str(path))
    assert model.source == "gguf" and model.gguf_bytes == reader.tensor_bytes(path) == 160 * 64 * 2 + 32 * 64 * 4
    mem = plan.breakdown(model, plan.Request(1024, weight_quant="gguf"))
    assert mem.weights == model.gguf_bytes
    assert mem.kv == 2 * 1024 * 2 * 2 * 16 * 2                 # 2 layers x 1024 tokens x K+V x 2 heads x 16 x f16


@pytest.mark.parametrize("model_type,extra", [("qwen3_5_moe_text", {**LINEAR, **MOE}),
                                              ("qwen3_next", {**LINEAR, **MOE}), ("qwen3_5_text", LINEAR),
                                              ("llama", {})])
@pytest.mark.parametrize("quant", ["q8_0", "f16"])
def test_weight_estimate_equals_a_written_gguf(tmp_path, model_type, extra, quant):
    """kvslim's GGUF writer follows llama.cpp's converter (f32 vectors, routers and conv kernels):
    the planner's estimate for the same type must be the file's tensor bytes exactly."""
    pytest.importorskip("kvslim.gguf.writer")
    save_file = pytest.importorskip("safetensors.torch").save_file
    d = dict(model_type=model_type, **TINY, **extra)
    (tmp_path / "config.json").write_text(json.dumps(d))
    state = models.build(models.config_from_dict(d)).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": [],
        "pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}))
    path = convert_hf_to_gguf(tmp_path, tmp_path / "model.gguf", quant)
    assert plan.weight_size(plan.resolve_model(str(tmp_path)), quant).total == plan.resolve_model(str(path)).gguf_bytes


# ----- the CLI ----------------------------------------------------------------------------------------

def test_cli_sweep_markdown_and_json(capsys):
    args = ["-m", "qwen3.6-35b-a3b", "-c", "4k,32k,128k,256k", "-ctk", "f16,q8_0,turbo4", "-ctv", "f16,turbo3",
            "--gpu", "rtx4090"]
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and out.count("| q4_k_m |") == 4 * 6 + 6 and "Largest context that fits" in out
    assert "| 262144 (model max) |" in out and "llama-server -m Qwen3.6-35B-A3B-Q4_K_M.gguf" in out
    code, out, _ = run_cli(capsys, *args, "-o", "json")
    result = json.loads(out)
    assert code == 0 and json.loads(json.dumps(result)) == result
    assert len(result["rows"]) == 24 and len(result["largest_context"]) == 6
    row = next(r for r in result["rows"] if r["ctx"] == 262_144 and r["type_k"] == r["type_v"] == "f16")
    assert row["kv"] == 5 * GIB and not row["fits"] and row["suggestions"]
    assert result["model"]["kv_bytes_per_token_f16"] == 20_480


def test_cli_mem_target_and_tp(capsys):
    code, out, _ = run_cli(capsys, "-m", "qwen3-32b", "-c", "32768", "--mem", "48GiB", "--bw", "1000", "-o", "json")
    assert code == 0 and json.loads(out)["target"]["memory"] == 48 * GIB
    code, out, _ = run_cli(capsys, "-m", "llama-3.1-8b", "-c", "0", "-np", "2", "--gpu", "rtx3090", "-o", "json")
    assert code == 0 and json.loads(out)["rows"][0]["ctx_per_slot"] == 131_072 // 2     # -c 0: the trained context
    code, out, _ = run_cli(capsys, "-m", "qwen3.5-397b-a17b", "-c", "262144", "--gpu", "h200", "--tp", "4")
    assert code == 0 and "tensor parallel over 4" in out and "--tensor-parallel-size 4" in out


@pytest.mark.parametrize("argv,message", [
    (["-m", "gpt-5", "--gpu", "rtx4090"], "unknown model 'gpt-5'; built-in models: qwen3.6-27b, "),
    (["-m", "qwen3-32b", "--gpu", "rtx9090"], "unknown GPU 'rtx9090'; valid names: rtx3090, rtx4090"),
    (["-m", "qwen3-32b", "--gpu", "rtx4090", "-ctk", "q3"], "unknown KV cache type 'q3'; valid types: f32, f16"),
    (["-m", "qwen3-32b", "--gpu", "rtx4090", "-c", "-4096"], "-c must be 0 or more"),
    (["-m", "qwen3-32b", "--gpu", "rtx4090", "-c", "lots"], "-c: 'lots' is not a whole number"),
    (["-m", "qwen3-32b", "--gpu", "rtx4090", "-np", "0"], "-np must be at least 1"),
    (["-m", "qwen3-32b", "--mem", "lots"], "cannot read memory size 'lots'"),
    (["-m", "qwen3-32b", "--mem", "0GiB"], "memory size must be positive"),
    (["-m", "qwen3-32b", "--gpu", "rtx4090", "-wq", "q2_xs"], "unknown weight quantization 'q2_xs'; valid: f32, f16"),
    (["-m", "qwen3.6-35b-a3b", "--gpu", "h100", "--tp", "3"], "--tp 3 does not divide the 16 attention heads"),
    (["-m", "qwen3-32b", "--gpu", "rtx4090", "-c", "4096", "-d", "5000"], "--depth 5000 must be between 0"),
    (["-m", "/nonexistent/model.gguf", "--gpu", "rtx4090"], "no such GGUF file"),
    # klt3 codes V only (KVCache refuses it for K): it was planned as fitting, with a launch line that fails
    (["-m", "qwen3.6-27b", "--gpu", "rtx4090", "-ctk", "q8_0,klt3"], "-ctk klt3: klt3 is a V cache type"),
])
def test_cli_refuses_bad_input_clearly(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("kvslim plan: error: ") and message in err
    assert "Traceback" not in err


def test_parse_memory_units():
    assert plan.parse_memory("24GiB") == plan.parse_memory("24 G") == 24 * GIB
    assert plan.parse_memory("24GB") == 24 * 10**9
    assert plan.parse_memory("16384MiB") == 16 * GIB


# ----- a newcomer's plan (issue 20): ids, 1M, this machine, stored dtype, the context limit ---------------------
def test_catalog_models_answer_to_their_hugging_face_ids(capsys):
    for spec in ("Qwen/Qwen3.6-35B-A3B", "qwen/qwen3.6-35b-a3b", "Qwen3.6-35B-A3B"):
        code, out, _ = run_cli(capsys, "-m", spec, "--gpu", "rtx4090", "-o", "json")
        assert code == 0 and json.loads(out)["model"]["name"] == "qwen3.6-35b-a3b"


def test_m_suffix_counts_in_binary_millions_like_k():
    assert plan_tool.parse_counts("128k,1M,2m", "-c") == [131_072, 1_048_576, 2_097_152]


def test_without_gpu_or_mem_plans_for_this_machine(capsys):
    code, out, _ = run_cli(capsys, "-o", "json")
    target = json.loads(out)["target"]
    local = plan.local_target()
    assert code == 0 and target["name"] == local.name and target["name"].startswith("this ")
    assert abs(target["memory"] - local.memory) < (1 << 30)      # MemAvailable moves while the test runs


def test_a_folder_is_planned_with_the_weights_run_loads(capsys):
    code, out, _ = run_cli(capsys, "--mem", "1GiB", "-o", "json")     # no -m: the bundled model, stored bf16
    result = json.loads(out)
    llm = kvslim.load(ctx=64)
    row = result["rows"][0]
    assert code == 0 and row["weight_quant"] == "bf16" and result["model"]["stored_quant"] == "bf16"
    assert row["weights"] == weight_bytes(llm.model)                   # what `kvslim run` reports holding


@pytest.mark.parametrize("kind", ["gemma", "qwen3_5_moe"])
def test_planner_bytes_equal_what_run_holds_for_a_folder(tmp_path, capsys, kind):
    """A folder saved in bf16 (gemma: an architecture added without a change in plan/): the
    planner's weights in the stored dtype are the bytes ``kvslim run`` reports holding, and its
    KV and state bytes those the run allocated for its tokens."""
    from .conftest import tiny_hf_model, write_tiny_tokenizer
    hf = tiny_hf_model(kind).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path, hf.config.vocab_size)
    code = cli.main(["run", "-m", str(tmp_path), "-p", "the " * 40, "-n", "4", "-c", "512", "-ctk", "q8_0",
                     "-ctv", "turbo3", "--temp", "0", "-o", "json"])
    record = json.loads(capsys.readouterr().out)
    model = plan.resolve_model(str(tmp_path))
    n_tokens = record["prompt_tokens"] + record["completion_tokens"]
    assert code == 0 and model.stored_quant == "bf16"
    assert record["weights_bytes"] == plan.weight_size(model, "bf16").total
    assert record["kv_bytes"] == plan.kv_bytes(model.config, n_tokens, 1, "q8_0", "turbo3")
    assert record["state_bytes"] == plan.state_bytes(model.config, 1)


def test_bundled_model_reports_its_limit_and_trained_context(capsys):
    code, out, _ = run_cli(capsys, "--mem", "1GiB")
    assert code == 0 and "context limit 32768 (max_position_embeddings), trained on sequences of at most 4096" in out


def test_contexts_past_the_model_limit_are_flagged_and_never_launched(capsys):
    code, out, _ = run_cli(capsys, "-m", "qwen3.6-27b", "-c", "1000000", "--gpu", "h200", "-o", "json")
    result = json.loads(out)
    assert code == 0 and result["rows"][0]["past_limit"] and result["rows"][0]["fits"]
    assert "-c 262144 " in result["launch"]["llama_server"] and "--max-model-len 262144 " in result["launch"]["vllm"]
    assert "past the model's limit of 262144" in result["launch"]["notes"][0]
    code, out, _ = run_cli(capsys, "-m", "qwen3.6-27b", "-c", "1000000", "--gpu", "h200")
    commands = [line for line in out.split("Launch lines")[1].splitlines() if line.startswith("  llama-server")]
    assert "yes (past limit)" in out and len(commands) == 1 and " -c 262144 " in commands[0]


def test_calibrated_v_types_are_suggested_only_with_a_calibration():
    """klt3 is a V type that needs the model's KV calibration: a model with one may be told to use
    it (it ranks by its measured KLD like every pair), a model without one never is, and it is
    never offered as K."""
    from kvslim.plan.suggest import kv_candidates
    assert "klt3" in kv_candidates("v", calibrated=True)
    assert "klt3" not in kv_candidates("v") and "klt3" not in kv_candidates("k", calibrated=True)
    bare, target = plan.resolve_model("qwen3.6-35b-a3b"), plan.gpu_target("rtx4090")
    calibrated = dataclasses.replace(bare, kv_calibrated=True)
    fits = lambda k, v, ctx: plan.fits(bare, plan.Request(ctx, type_k=k, type_v=v), target)
    ctx = next(c for c in range(65_536, 4_194_304, 4096) if fits("nl4s", "klt3", c) and not fits("nl4s", "nl4s", c))
    req = plan.Request(ctx, type_k="nl4s", type_v="nl4s")
    kv = lambda m: next(s for s in plan.suggestions(m, req, target) if s.change == "kv_types").flags
    assert kv(calibrated) == "-ctk nl4s -ctv klt3"
    assert "klt3" not in kv(bare)
    from kvslim.loading import default_model
    assert plan.resolve_model(str(default_model())).kv_calibrated
