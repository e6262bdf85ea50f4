"""The model shipped in the package: it loads, matches transformers, generates,
and the planner's byte figures equal what the engine allocates for it.
The suite never retrains it."""
from __future__ import annotations

import json

import pytest
import torch

import kvslim
from kvslim import plan
from kvslim.cli import main as cli_main
from kvslim.loading import default_model


@pytest.fixture(scope="module")
def folder():
    return default_model()


def test_bundled_model_is_a_small_qwen3_5_hybrid(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["head_dim"] >= 128
    assert config["layer_types"].count("full_attention") * 4 == len(config["layer_types"])
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 40 * 2**20
    assert (folder / "README.md").is_file() and (folder / "tokenizer_config.json").is_file()


def test_bundled_model_matches_transformers(folder):
    tf = pytest.importorskip("transformers")
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = kvslim.load(ctx=512, cache_type_k="f32", cache_type_v="f32", dtype="f32")
    ids = llm.tokenize("It is a truth universally acknowledged, that a single man in possession of a good "
                       "fortune, must be in want of a wife. " * 3)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (llm.logits(ids) - want).abs().max().item() <= 1e-3       # fp32 compute over bf16 weights
    tok = tf.AutoTokenizer.from_pretrained(folder)
    assert tok("Mr. Darcy's letter")["input_ids"] == llm.tokenize("Mr. Darcy's letter")


def test_bundled_model_generates_text(folder):
    llm = kvslim.load(ctx=256)
    out = llm.generate("Elizabeth", max_tokens=16, temperature=0)
    assert len(out.token_ids) > 0 and out.text.strip()
    chat = llm.chat([{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    assert chat.finish_reason in ("stop", "length")


def test_planner_bytes_equal_what_run_reports(folder, capsys):
    ctx, prompt_words = 1024, "the " * 200
    assert cli_main(["run", "-p", prompt_words, "-n", "4", "-c", str(ctx), "-ctk", "q8_0", "-ctv", "turbo3",
                     "--temp", "0", "-o", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    model = plan.resolve_model(str(folder))
    n_tokens = record["prompt_tokens"] + record["completion_tokens"]
    # the engine allocates whole pages for the tokens it holds, as the planner counts them
    assert record["kv_bytes"] == plan.kv_bytes(model.config, n_tokens, 1, "q8_0", "turbo3")
    assert record["state_bytes"] == plan.state_bytes(model.config, 1)
