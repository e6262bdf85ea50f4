"""Prompt forwards' float32 matmuls in oneDNN's bf16x3 mode (kvslim/models/matmul_precision.py):
where they apply, that the setting is undone, and that the logits keep float32's accuracy."""
from __future__ import annotations

import pytest
import torch

from kvslim.loading import load_model
from kvslim.models import Batch
from kvslim.models import matmul_precision as mp

BACKEND = torch.backends.mkldnn.matmul


@pytest.fixture(scope="module")
def hybrid(tiny_folder):
    return load_model(tiny_folder("qwen3_5")[0], "f32")[0]


def _seen_modes(model, n_tokens: int) -> list[str]:
    """The oneDNN matmul precision each layer's forward ran under, for an n-token prompt."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda *_: seen.append(BACKEND.fp32_precision))
             for layer in model.model.layers]
    try:
        model(Batch.build([(0, list(range(3, 3 + n_tokens)), 0)]), model.make_cache(64, 1))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_prompts_take_bf16x3_and_decode_steps_plain_float32(hybrid, monkeypatch):
    monkeypatch.delenv("KVSLIM_F32_MATMUL", raising=False)
    if not mp.native_bf16() or not mp.bf16x3_measured():
        # no bf16 dot products, or a bf16 mode that rounds once (an AMX Xeon: one such ran CI)
        assert set(_seen_modes(hybrid, 20)) == {"none"} and mp.prompt_mode("cpu") == "ieee"
        pytest.skip("this CPU has no bf16x3-accurate bf16 mode: only the refusal is checkable")
    assert set(_seen_modes(hybrid, 20)) == {"bf16"}
    assert set(_seen_modes(hybrid, mp.MIN_ROWS - 1)) == {"none"}          # a GEMV is slower in bf16x3
    assert BACKEND.fp32_precision == "none"                               # undone after the forward
    assert torch.get_float32_matmul_precision() == "highest"              # torch's legacy getter still answers


def test_the_switch_and_a_users_own_choice_are_respected(hybrid, monkeypatch):
    monkeypatch.setenv("KVSLIM_F32_MATMUL", "ieee")
    assert set(_seen_modes(hybrid, 20)) == {"none"} and mp.prompt_mode("cpu") == "ieee"   # bench records say so
    monkeypatch.delenv("KVSLIM_F32_MATMUL")
    BACKEND.fp32_precision = "ieee"                                       # the user chose plain float32
    try:
        assert set(_seen_modes(hybrid, 20)) == {"ieee"}
    finally:
        BACKEND.fp32_precision = "none"


def test_bf16x3_logits_keep_float32_accuracy(hybrid, monkeypatch):
    """Against plain float32 the logits move by float32 rounding, not bf16's (~4e-3 relative)."""
    monkeypatch.delenv("KVSLIM_F32_MATMUL", raising=False)
    if mp.prompt_mode("cpu") != "bf16x3":                    # both would run plain float32: nothing to compare
        pytest.skip("this CPU's prompts do not take bf16x3")
    ids = list(range(5, 69))

    def logits(mode):
        monkeypatch.setenv("KVSLIM_F32_MATMUL", mode)
        return hybrid(Batch.build([(0, ids, 0)]), hybrid.make_cache(128, 1), all_logits=True)
    ref, got = logits("ieee"), logits("bf16x3")
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max() and torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_mistyped_switch_is_refused_by_name(hybrid, monkeypatch):
    monkeypatch.setenv("KVSLIM_F32_MATMUL", "IEEE")
    with pytest.raises(ValueError, match="KVSLIM_F32_MATMUL='IEEE': expected one of bf16x3, ieee"):
        hybrid(Batch.build([(0, list(range(3, 23)), 0)]), hybrid.make_cache(64, 1))


def test_a_bf16_mode_that_rounds_once_is_not_taken(hybrid, monkeypatch):
    """On an Intel Xeon with AMX, oneDNN's bf16 mode rounded the inputs to bf16 once (2.3e-3
    measured there, session 31): a CPU that claims bf16 dot products must also show bf16x3's
    accuracy before prompts take the mode."""
    monkeypatch.delenv("KVSLIM_F32_MATMUL", raising=False)
    monkeypatch.setattr(mp, "native_bf16", lambda: True)
    monkeypatch.setattr(mp, "product_error", lambda mode: 2.3e-3 if mode == "bf16" else 3e-7)
    mp.bf16x3_measured.cache_clear()
    try:
        assert not mp.bf16x3_measured() and mp.prompt_mode("cpu") == "ieee"
        assert set(_seen_modes(hybrid, 20)) == {"none"}
        monkeypatch.setattr(mp, "product_error", lambda mode: 5e-7)     # bf16x3's accuracy: taken
        mp.bf16x3_measured.cache_clear()
        assert mp.prompt_mode("cpu") == "bf16x3" and set(_seen_modes(hybrid, 20)) == {"bf16"}
    finally:
        mp.bf16x3_measured.cache_clear()


def test_the_bound_parts_float32_from_one_bf16_rounding():
    """The probe's bound sits between plain float32 (measured here) and the same product with its
    inputs rounded to bf16 once, as the AMX host computed it."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 256, generator=gen), torch.randn(256, 32, generator=gen)
    exact = a.double() @ b.double()
    rounded = (a.bfloat16().double() @ b.bfloat16().double() - exact).norm() / exact.norm()
    assert mp.product_error("ieee") < 1e-6 < mp.BF16X3_MAX_ERROR < rounded.item() / 10
