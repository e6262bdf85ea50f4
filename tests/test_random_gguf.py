"""benchmarks/random_gguf.py: the random-weight GGUF of a catalog model that llama.cpp runs on a
GPU beside kvslim's own random model (issue 18's side-by-side). The file must hold what the
planner predicts for the model's weights and be read the same way by both engines."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from kvslim import peer
from kvslim.engine import load
from kvslim.gguf import writer
from kvslim.models import config_from_dict
from kvslim.plan.fit import Request, breakdown
from kvslim.plan.model import Model, resolve_model

needs_peer = pytest.mark.skipif(not peer.available(), reason="no llama.cpp binding (pip install 'kvslim[peer]')")


@pytest.fixture(scope="module")
def random_gguf():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "random_gguf.py"
    spec = importlib.util.spec_from_file_location("random_gguf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small_file(random_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("random") / "a3b-small.gguf"
    assert random_gguf.main([str(out), "--shrink", "16", "--layers", "4"]) == 0
    return out


def test_full_35b_a3b_plan_holds_the_planners_weight_bytes(random_gguf):
    """The whole Qwen3.6-35B-A3B at q4_0, planned on the meta device (no bytes made): every
    matrix q4_0 but the output's q6_k, and the bytes the planner predicts to the byte."""
    hf = random_gguf.shrunk_config("qwen3.6-35b-a3b", 1, None)
    arch, config = writer.check_export(hf, "q4_0")
    plan = random_gguf.plan_tensors(arch, config, "q4_0")
    kinds = {name: kind for _, name, _, kind in plan}
    assert kinds["output.weight"] == "q6_k" and kinds["blk.0.ffn_gate_exps.weight"] == "q4_0"
    assert kinds["blk.0.attn_norm.weight"] == "f32" and kinds["blk.3.attn_q.weight"] == "q4_0"
    assert len([n for n in kinds if n.startswith("blk.39.")]) > 0 and not any(n.startswith("blk.40.") for n in kinds)
    total = sum(random_gguf.nbytes(shape, kind) for *_, shape, kind in plan)
    model = Model("qwen3.6-35b-a3b", config_from_dict(hf), "catalog")
    assert total == breakdown(model, Request(4096, 1, weight_quant="q4_0")).weights


def test_written_file_has_the_planned_bytes_and_kvslim_runs_it(random_gguf, small_file):
    hf = random_gguf.shrunk_config("qwen3.6-35b-a3b", 16, 4)
    arch, config = writer.check_export(hf, "q4_0")
    planned = sum(random_gguf.nbytes(shape, kind) for *_, shape, kind in random_gguf.plan_tensors(arch, config, "q4_0"))
    assert resolve_model(str(small_file)).gguf_bytes >= planned       # + metadata and vocabulary
    logits = load(small_file).logits([5, 77, 140, 9, 250, 31])
    assert torch.isfinite(logits).all() and logits.float().abs().max() > 0


@needs_peer
def test_llama_cpp_and_kvslim_read_the_file_alike(small_file):
    """llama.cpp loads the file (its loader refuses a tensor missing or of the wrong shape or
    type) and computes what kvslim computes from it, to float rounding. The weights are random,
    so this cannot tell a layout convention from its inverse; test_gguf checks those on trained
    weights against transformers."""
    tokens = [5, 77, 140, 9, 250, 31, 200, 64, 1000, 7]
    ours = load(small_file).logits(tokens)
    ours = (ours[-1] if ours.ndim == 2 else ours).float().numpy()
    ctx = peer.open_peer(small_file, n_ctx=64)
    try:
        theirs = np.asarray(ctx.eval(tokens))[-1]
    finally:
        ctx.close()
    assert ours.argmax() == theirs.argmax()
    assert np.corrcoef(ours, theirs)[0, 1] > 0.999
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(theirs).max()


def test_unknown_model_or_type_is_refused_by_name(random_gguf, tmp_path, capsys):
    assert random_gguf.main([str(tmp_path / "x.gguf"), "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(SystemExit):
        random_gguf.main([str(tmp_path / "y.gguf"), "-t", "q4_k"])
