"""Shared fixtures: tiny random models built and saved by transformers itself."""
from __future__ import annotations

import os

import pytest
import torch

TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=96)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
EVEN_MOE = dict(MOE, shared_expert_intermediate_size=32)


def _share_the_cores() -> int:
    """Under pytest-xdist (``make test`` runs ``-n auto``) each worker takes its share of the
    cores: with torch's default of every core per process, two workers on 2 cores ran the suite
    slower than one (941 s against 840 s, 30 CPU minutes against 17: threads waiting on
    threads). The share is also set in
    OMP_NUM_THREADS for the processes the tests start (servers, CLIs, interpreted kernels)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, (os.cpu_count() or 1) // workers)
    if workers > 1:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    return torch.get_num_threads()


THREADS = _share_the_cores()

# The files that take longest (seconds of one worker, session 36's run on 2 cores), collected
# first: ``make test`` hands whole files to the workers (--dist loadfile) in collection order,
# and a heavy file that starts last runs alone at the end. Only the order changes.
HEAVY_FIRST = ["test_native_step.py", "test_decode_step.py", "test_triton_weights.py", "test_triton_wiring.py",
               "test_bench.py", "test_server_agents.py", "test_triton_prefill.py", "test_triton_attention.py",
               "test_readme.py", "test_imatrix.py", "test_graph_decode.py", "test_native_build.py",
               "test_host_copies.py", "test_pool.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: the rest keep their order


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from a second thread, and on a machine shared with other jobs a
    busy second core stalls every parallel op (32 greedy tokens of the bundled model at Q8_0: 66 s
    on 2 threads beside another job, under 1 s on one). Per test: ``_threads_restored`` puts the
    count back after each test, which undid the module-wide fixtures this replaces after their
    first test whenever a process had 2 threads (``make test TEST_JOBS=0``)."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _threads_restored():
    """Tests that set torch's thread count (-t 1, the C kernels' thread checks) leave it as found."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


TINY_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "llama", "qwen3", "qwen2", "llama31", "gemma")


def tiny_hf_model(kind: str, seed: int = 0):
    """A transformers model of architecture ``kind`` with every parameter randomised
    (norm weights, A_log, dt_bias too, so every convention shows in the logits)."""
    tf = pytest.importorskip("transformers")
    configs = {
        "qwen3_5": lambda: (tf.Qwen3_5TextConfig(**TINY, **LINEAR), tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": lambda: (tf.Qwen3_5MoeTextConfig(**TINY, **LINEAR, **MOE), tf.Qwen3_5MoeForCausalLM),
        # a shared expert as wide as a routed one, as in the released 35B-A3B (512 both): in the
        # kernels, one more pair of the routed experts' GEMVs (not in TINY_TYPES: tests ask for it)
        "qwen3_5_moe_even": lambda: (tf.Qwen3_5MoeTextConfig(**TINY, **LINEAR, **EVEN_MOE), tf.Qwen3_5MoeForCausalLM),
        "qwen3_next": lambda: (tf.Qwen3NextConfig(**TINY, **LINEAR, **MOE), tf.Qwen3NextForCausalLM),
        "llama": lambda: (tf.LlamaConfig(**TINY, rope_theta=50_000.0), tf.LlamaForCausalLM),
        "qwen3": lambda: (tf.Qwen3Config(**TINY), tf.Qwen3ForCausalLM),
        "qwen2": lambda: (tf.Qwen2Config(**TINY), tf.Qwen2ForCausalLM),
        "gemma": lambda: (tf.GemmaConfig(**TINY), tf.GemmaForCausalLM),
        # Llama 3.1 RoPE scaling, with a short original context so all three bands occur
        "llama31": lambda: (tf.LlamaConfig(**TINY, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), tf.LlamaForCausalLM),
    }
    config, cls = configs[kind]()
    torch.manual_seed(seed)
    return randomize(cls(config).eval())


def randomize(model):
    """Every parameter random, norm weights and dt_bias around their own init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif "norm" in name or name.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.3)                  # around its own init (0 or 1)
            else:
                p.normal_(0.0, 0.08)
    return model


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def saved_random_model(folder, config_class: str, model_class: str, **config):
    """A transformers ``model_class`` of ``config_class(**config)`` (names in transformers),
    seeded with 0 and ``randomize``d, saved in ``folder`` with ``write_tiny_tokenizer``'s
    tokenizer; returns the folder."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    made = getattr(tf, config_class)(**config)
    randomize(getattr(tf, model_class)(made).eval()).save_pretrained(folder)
    write_tiny_tokenizer(folder, made.vocab_size)
    return folder


def write_tiny_tokenizer(folder, vocab_size: int) -> None:
    """A byte-level BPE trained on real text (standard-library docstrings), saved as HF files."""
    import json
    import os
    import re as re_module

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = [m.__doc__ for m in (os, json, re_module, pytest, torch) if m.__doc__]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture
def short_imatrix(monkeypatch):
    """``kvslim convert`` measures the importance matrix it needs over 4 chunks of 128 tokens
    instead of llama-imatrix's 64 of 512 (11 s a conversion on 2 cores): the tests check that
    it measures and that llama.cpp takes the result, not the matrix's quality."""
    from kvslim.tools import imatrix
    monkeypatch.setattr(imatrix, "CTX_SIZE", 128)
    monkeypatch.setattr(imatrix, "CHUNKS", 4)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """``tiny_folder(kind)`` -> (path of a saved tiny HF model, the transformers model)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            model = tiny_hf_model(kind)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            write_tiny_tokenizer(path, model.config.vocab_size)
            made[kind] = (path, model)
        return made[kind]
    return make


def import_training(module: str):
    """A module of training/ (train, model_card, ...), imported without leaving training/ on sys.path."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "training")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(folder)


def assert_devices_agree(got: torch.Tensor, ref: torch.Tensor, unquantized: torch.Tensor | None = None,
                         atol: float = 2e-3, rtol: float = 1e-3) -> None:
    """Logits of one model on two devices. With float K/V caches (``unquantized`` None) they
    agree to float32 rounding (atol/rtol). With quantized ones, rounding differences put a few
    values on the other side of a code boundary on one device (the H200 against the CPU,
    session 31: 1 to 178 of 2.4M logits past 2e-3, up to 8.3e-3). Such flips stay rare and
    smaller than the format's own effect, ``ref`` against ``unquantized`` (the same model and
    input with float caches): 95% of the logits within the float tolerance (a systematic error
    moves them all), the largest difference within a tenth of the quantization's own largest."""
    got, ref = got.float().cpu(), ref.float().cpu()
    if unquantized is None:
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
        return
    diff = (got - ref).abs()
    within = (diff <= atol + rtol * ref.abs()).float().mean().item()
    own = (ref - unquantized.float().cpu()).abs().max().item()
    assert within >= 0.95, f"only {within:.1%} of the logits agree to float tolerance"
    assert diff.max().item() <= 0.1 * own, f"largest difference {diff.max().item():.3g} over a tenth of " \
                                          f"the quantization's own largest ({own:.3g})"
