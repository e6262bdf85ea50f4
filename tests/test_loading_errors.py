"""Broken model folders and files, and failed conversions: one clear line naming the problem
(``kvslim CMD: error: ...``, exit 2), never a traceback from inside safetensors, tokenizers or
gguf, and never a half-written output file left under the output's name."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

import kvslim
from kvslim.cli import main
from kvslim.loading import convert_hf_to_gguf, parse_dtype


@pytest.fixture
def folder(tiny_folder, tmp_path):
    """A copy of the tiny llama folder, free to break."""
    src, _ = tiny_folder("llama")
    return shutil.copytree(src, tmp_path / "llama")


@pytest.fixture(scope="module")
def f16_gguf(tiny_folder, tmp_path_factory):
    src, _ = tiny_folder("llama")
    return convert_hf_to_gguf(src, tmp_path_factory.mktemp("gguf") / "llama-f16.gguf", "f16")


def cli_error(capsys, *argv) -> str:
    """``kvslim ARGV``'s one error line, checked to be a clean refusal (exit 2)."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"kvslim {argv[0]}: error: "), err
    return err


def run_error(capsys, model) -> str:
    return cli_error(capsys, "run", "-m", model, "-p", "hi", "-n", "1", "-t", "1", "-c", "32")


def rewritten(src, dst, keys: dict | None = None, drop: tuple = ()):
    """A copy of the GGUF ``src`` with metadata ``keys`` replaced and the keys in ``drop`` left out."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, (keys or {}).get(name, field.contents()), field.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ----- Hugging Face folders ---------------------------------------------------------------
@pytest.mark.parametrize("cut", [0, 20, "half"])
def test_truncated_safetensors_is_named(folder, capsys, cut):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2 if cut == "half" else cut])
    assert f"{weights}: not a readable safetensors file, truncated or corrupt" in run_error(capsys, folder)


def test_broken_shard_index_is_named(folder, capsys):
    index = folder / "model.safetensors.index.json"
    index.write_text("{not json")
    assert f"{index}: not valid JSON" in run_error(capsys, folder)
    index.write_text(json.dumps({"metadata": {}}))
    assert f'{index}: no "weight_map"' in run_error(capsys, folder)


def test_unreadable_json_files_are_named(folder, capsys):
    config = folder / "config.json"
    good = config.read_bytes()
    config.write_bytes(b"\xff\xfe not utf-8")
    assert f"{config}: not valid JSON" in run_error(capsys, folder)
    config.write_bytes(good)
    generation = folder / "generation_config.json"
    generation.write_text("[2]")
    assert f"{generation}: expected a JSON object" in run_error(capsys, folder)
    generation.unlink()
    (folder / "tokenizer_config.json").write_text("{not json")
    assert f"{folder}: tokenizer_config.json or chat_template.jinja cannot be read" in run_error(capsys, folder)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer.json").write_text("{not json")
    assert f"{folder / 'tokenizer.json'}: not a tokenizer" in run_error(capsys, folder)


def test_a_file_of_a_folder_points_to_the_folder(folder, capsys):
    assert f"pass the folder, {folder}" in run_error(capsys, folder / "model.safetensors")


def test_prequantized_checkpoint_is_refused_by_name(folder, capsys):
    """An FP8 checkpoint as Qwen publishes them: the codes in float8, scale tensors beside them."""
    from safetensors.torch import load_file, save_file
    weights = load_file(str(folder / "model.safetensors"))
    fp8 = {}
    for name, t in weights.items():
        fp8[name] = t.to(torch.float8_e4m3fn) if name.endswith("proj.weight") else t
        if name.endswith("proj.weight"):
            fp8[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(fp8, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    for err in (run_error(capsys, folder), cli_error(capsys, "convert", folder, "-o", folder / "out.gguf")):
        assert "a pre-quantized checkpoint (quant_method 'fp8')" in err
    assert not (folder / "out.gguf").exists()


def test_non_float_weights_and_dtypes_are_refused(folder, capsys):
    from safetensors.torch import load_file, save_file
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    save_file(weights, str(folder / "model.safetensors"))
    assert "weight model.norm.weight is torch.int32, not a float type" in run_error(capsys, folder)
    with pytest.raises(ValueError, match="torch.int8 is not a float type"):
        parse_dtype(torch.int8)


# ----- conversion ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("intermediate_size", 128), ("num_hidden_layers", 2),
                                          ("num_hidden_layers", 6)])
def test_convert_refuses_weights_the_config_does_not_describe(folder, capsys, field, value):
    """Such a GGUF loads nowhere (llama.cpp: wrong shape / wrong number of tensors): not written."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    out = folder / "out.gguf"
    err = cli_error(capsys, "convert", folder, "-o", out)
    assert "the config implies" in err or "weights missing" in err or "unexpected weights" in err
    assert not out.exists()


def test_interrupted_conversion_leaves_no_partial_file(folder, tmp_path, f16_gguf, monkeypatch, capsys):
    """Ctrl-C while the tensors are written: the file that was there stays as it was, a new one
    (or any part of a split) is not created, and no temporary folder is left behind."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    existing = shutil.copy(f16_gguf, out_dir / "model.gguf")
    before = existing.read_bytes()

    def half_written(self, *args, **kwargs):
        for f in self.fout:
            f.write(b"\0" * 4096)
            f.flush()
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", half_written)
    assert main(["convert", str(folder), "-o", str(existing), "--type", "q8_0"]) == 130
    assert main(["convert", str(folder), "-o", str(out_dir / "split.gguf"), "--split-max-tensors", "5"]) == 130
    assert existing.read_bytes() == before
    assert [p.name for p in out_dir.iterdir()] == ["model.gguf"]
    monkeypatch.undo()
    assert main(["convert", str(folder), "-o", str(existing), "--type", "q8_0"]) == 0   # overwrites, as llama.cpp
    assert kvslim.gguf.file_type(existing) == "MOSTLY_Q8_0"


def test_failed_llama_quantize_leaves_no_partial_file(folder, tmp_path, monkeypatch):
    """The K-quant path: llama.cpp's quantizer writes beside the f32 export, moved in when done."""
    from kvslim import peer
    from kvslim.tools import convert

    def failing(src, dst, *args):
        dst.write_bytes(b"GGUF" + b"\0" * 64)
        raise RuntimeError("llama.cpp could not quantize")
    monkeypatch.setattr(peer, "binding", lambda: None)
    monkeypatch.setattr(peer, "quantize", failing)
    out = tmp_path / "q4_k.gguf"
    with pytest.raises(RuntimeError):
        convert.convert(folder, out, "q4_k")
    assert list(tmp_path.iterdir()) == [folder]


def test_output_path_that_is_a_folder_is_refused(folder, tmp_path, capsys):
    (tmp_path / "dir.gguf").mkdir()
    assert "dir.gguf: it is a folder; give the output file's name" in cli_error(
        capsys, "convert", folder, "-o", tmp_path / "dir.gguf")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert "dir.gguf: it is a folder; give the output file's name" in cli_error(
        capsys, "imatrix", folder, "-f", text, "-o", tmp_path / "dir.gguf", "-c", "16", "--chunks", "1")
    assert "a folder, not a calibration text file" in cli_error(
        capsys, "imatrix", folder, "-f", tmp_path, "-o", tmp_path / "m.gguf")
    nested = tmp_path / "new" / "dir" / "imatrix.gguf"                 # made, as convert makes its folder
    assert main(["imatrix", str(folder), "-f", str(text), "-o", str(nested), "-c", "16", "--chunks", "1"]) == 0
    assert nested.is_file()


# ----- GGUF files ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [4, 200, "half", -1])
def test_truncated_gguf_is_called_truncated(f16_gguf, tmp_path, capsys, keep):
    data = f16_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2 if keep == "half" else keep])
    assert f"{cut}: truncated or corrupt GGUF file" in run_error(capsys, cut)


def test_gguf_blocks_past_block_count_are_refused(f16_gguf, tmp_path, capsys):
    """Blocks past block_count were dropped as if they were multi-token-prediction blocks,
    and the model ran with half its layers."""
    path = rewritten(f16_gguf, tmp_path / "short.gguf", {"llama.block_count": 2})
    assert "GGUF tensors go up to blk.3, but llama.block_count is 2" in run_error(capsys, path)


def test_gguf_metadata_that_cannot_make_a_model_is_named(f16_gguf, tmp_path, capsys):
    path = rewritten(f16_gguf, tmp_path / "heads.gguf", {"llama.attention.head_count": 0})
    assert "llama.attention.head_count is 0; it must be positive" in run_error(capsys, path)
    path = rewritten(f16_gguf, tmp_path / "novocab.gguf", drop=("tokenizer.ggml.tokens",))
    assert "tokenizer.ggml.tokens is missing" in run_error(capsys, path)
    tokens = gguf.GGUFReader(str(f16_gguf)).fields["tokenizer.ggml.tokens"].contents()
    path = rewritten(f16_gguf, tmp_path / "short-vocab.gguf", {"tokenizer.ggml.tokens": tokens[:100],
                                                                "tokenizer.ggml.token_type": [1] * 100})
    assert "tokens/merges do not make a BPE tokenizer" in run_error(capsys, path)


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", "64", "an integer"), ("rms_norm_eps", "1e-6", "a number"), ("num_attention_heads", True, "an integer"),
    ("tie_word_embeddings", "no", "true or false")])
def test_a_config_field_of_the_wrong_type_is_named(folder, capsys, field, value, expected):
    # "hidden_size": "64" failed inside torch with a TypeError
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    assert f"config field {field!r} is {value!r}; expected {expected}" in run_error(capsys, folder)


def test_qwen3_moe_as_transformers_5_saves_it_plans():
    from kvslim import plan
    from kvslim.models import config_from_dict
    d = plan.resolve_model("qwen3-30b-a3b").config
    saved = {"model_type": "qwen3_moe", "vocab_size": d.vocab_size, "hidden_size": d.hidden_size,
             "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
             "num_key_value_heads": d.num_key_value_heads, "head_dim": d.head_dim,
             "num_local_experts": d.num_experts, "num_experts_per_tok": d.num_experts_per_tok,
             "moe_intermediate_size": d.moe_intermediate_size, "rope_theta": 1000000}
    assert config_from_dict(saved).num_experts == d.num_experts == 128


def test_weight_types_are_read_in_either_case(capsys):
    # llama.cpp prints Q8_0; -ctk Q8_0 was always taken, --weights Q8_0 was refused
    assert main(["run", "-p", "hi", "-n", "1", "--temp", "0", "--weights", "Q8_0", "-ctk", "Q8_0", "-ctv", "TURBO4",
                 "-o", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["completion_tokens"] == 1 and (record["type_k"], record["type_v"]) == ("q8_0", "turbo4")
    llm = kvslim.load(weights="Q4_0", ctx=64)
    assert llm.generate("hi", 1, temperature=0).token_ids
