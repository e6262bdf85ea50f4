"""Importance matrices (``kvslim/gguf/imatrix.py``, ``kvslim imatrix``): measured per parameter,
carried into the GGUF writer's names and column order, written and read in llama-imatrix's
format, and taken by llama.cpp's quantizer (the oracle for their names and sizes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvslim import peer
from kvslim.gguf import imatrix
from kvslim.gguf.writer import LAYER, check_export, layer_tensors
from kvslim.loading import default_model, load_model, measure_importance, read_config

from .test_native_step import moe256_folder  # noqa: F401 (fixture)

needs_peer = pytest.mark.skipif(not peer.available(), reason="no llama.cpp binding (pip install 'kvslim[peer]')")
CHUNKS = [list(range(3, 40)), list(range(50, 70))]


def weighted_total(imp: imatrix.Importance, w: torch.Tensor) -> float:
    """sum over columns of importance x the column's sum of squared weights (per expert): the
    same number in any layout whose columns carry their own importance."""
    w = w.double().reshape(imp.sums.shape[0], -1, imp.sums.shape[1])
    return float((imp.sums * (w ** 2).sum(1).numpy()).sum())


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "llama", "gemma"])
def test_measured_importance_follows_the_writers_layout(tiny_folder, kind):
    folder, _ = tiny_folder(kind)
    model, _, _ = load_model(folder, "f32")
    collected = imatrix.collect(model, CHUNKS)
    arch, config = check_export(read_config(folder), "f32")
    params = dict(model.named_parameters())
    tokens = sum(len(c) for c in CHUNKS)
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head.weight"}
    assert linears <= collected.keys()
    permuted = 0
    for name, imp in collected.items():
        w = params[name].detach()
        if imp.sums.shape[0] == 1:
            assert imp.counts.tolist() == [tokens], name
        else:                                           # each token reaches top_k experts
            assert imp.counts.sum() == tokens * config.num_experts_per_tok and imp.sums.shape[0] == w.shape[0]
        parts = dict(layer_tensors(arch, config, LAYER.match(name)[2], w.float().clone()))
        entries = imatrix.to_gguf(arch, config, {name: imp})
        layer = LAYER.match(name)[1]
        assert entries.keys() == {f"blk.{layer}.{s}" for s in parts}, name
        hf = weighted_total(imp, w)
        assert np.isclose(sum(weighted_total(entries[f"blk.{layer}.{s}"], t) for s, t in parts.items()), hf,
                          rtol=1e-5), name
        permuted += any(not np.array_equal(e.sums.astype(np.float32), imp.sums.astype(np.float32))
                        for e in entries.values())
    if kind in ("qwen3_5", "qwen3_5_moe"):              # llama.cpp's order of the DeltaNet's value heads
        assert permuted > 0


def test_each_expert_gets_the_inputs_of_the_tokens_routed_to_it(tiny_folder):
    """An expert's gate_up entry sums x^2 over exactly the tokens its router sent to it (seen
    here by a hook on the routers, apart from the recording)."""
    model, _, _ = load_model(tiny_folder("qwen3_5_moe")[0], "f32")
    routed = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=name: routed.setdefault(n, []).append((args[0], out[1])))
             for name, m in model.named_modules() if name.endswith("mlp.gate")]
    collected = imatrix.collect(model, CHUNKS)
    for h in hooks:
        h.remove()
    assert len(routed) == model.config.num_hidden_layers
    for name, calls in routed.items():
        x = torch.cat([c[0].reshape(-1, c[0].shape[-1]) for c in calls]).double()
        experts = torch.cat([c[1].reshape(-1, c[1].shape[-1]) for c in calls])
        imp = collected[name.removesuffix("gate") + "experts.gate_up_proj"]
        for e in range(imp.sums.shape[0]):
            chosen = (experts == e).any(-1)
            assert imp.counts[e] == int(chosen.sum())
            assert np.allclose(imp.sums[e], (x[chosen] ** 2).sum(0).numpy(), rtol=1e-6), (name, e)


def test_the_file_format_round_trips_as_llama_quantize_reads_it(tmp_path):
    rng = np.random.default_rng(0)
    entries = {"blk.0.ffn_up.weight": imatrix.Importance(rng.uniform(1, 4, (1, 64)), np.array([30.0])),
               "blk.0.ffn_up_exps.weight": imatrix.Importance(rng.uniform(1, 4, (3, 64)), np.array([5.0, 0.0, 2.0]))}
    path = imatrix.write(tmp_path / "imatrix.gguf", entries, ["some text"], 2, 512)
    back = imatrix.read(path)
    assert back.keys() == entries.keys()
    for name, e in entries.items():
        assert np.allclose(back[name].sums, e.sums) and np.array_equal(back[name].counts, e.counts)
    means = back["blk.0.ffn_up_exps.weight"].means().reshape(3, 64)
    assert np.allclose(means[0], entries["blk.0.ffn_up_exps.weight"].sums[0] / 5)
    assert (means[1] == 1).all()                        # an expert no token chose: no preference
    with pytest.raises(ValueError, match="no such importance matrix file"):
        imatrix.read(tmp_path / "missing.gguf")



def test_a_cut_or_interrupted_gguf_matrix_is_named_and_never_half_written(tmp_path, monkeypatch):
    """A file cut after its magic failed inside gguf's reader with an IndexError; an interrupted
    write left a half-written file under the output's name."""
    import gguf
    entries = {"blk.0.ffn_up.weight": imatrix.Importance(np.ones((1, 64)), np.array([3.0]))}
    data = imatrix.write(tmp_path / "imatrix.gguf", entries, ["text"], 1, 16).read_bytes()
    for keep in (4, len(data) // 2):
        (tmp_path / "cut.gguf").write_bytes(data[:keep])
        with pytest.raises(ValueError, match="cut.gguf: a truncated or corrupt GGUF importance matrix"):
            imatrix.read(tmp_path / "cut.gguf")

    def interrupted(self, *args, **kwargs):
        self.fout[0].write(b"\0" * 64)
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        imatrix.write(tmp_path / "imatrix.gguf", entries, ["other text"], 1, 16)
    assert (tmp_path / "imatrix.gguf").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "imatrix.gguf"]

def test_the_legacy_dat_format_reads_as_llama_quantize_reads_it(tmp_path):
    """imatrix.dat: sums of squares over calls per tensor (llama-quantize divides them), and an
    optional trailer; a truncated or foreign file is refused by name."""
    import struct
    rng = np.random.default_rng(1)
    sums = {"blk.0.attn_q.weight": rng.uniform(1, 9, 64).astype(np.float32),
            "blk.1.ffn_down_exps.weight": rng.uniform(1, 9, 3 * 32).astype(np.float32)}
    body = struct.pack("<i", len(sums))
    for name, values in sums.items():
        body += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 40, values.size) + values.tobytes()
    body += struct.pack("<ii", 10, 4) + b"wiki"                     # chunks and dataset name
    (tmp_path / "imatrix.dat").write_bytes(body)
    got = imatrix.read(tmp_path / "imatrix.dat")
    assert got.keys() == sums.keys()
    assert all(np.allclose(got[k].means(), v / 40) for k, v in sums.items())
    (tmp_path / "cut.dat").write_bytes(body[:40])
    with pytest.raises(ValueError, match="ends inside entry"):
        imatrix.read(tmp_path / "cut.dat")
    (tmp_path / "text.dat").write_text("not an importance matrix at all")
    with pytest.raises(ValueError, match="not an importance matrix"):
        imatrix.read(tmp_path / "text.dat")


@needs_peer
def test_llama_cpp_quantizes_a_mixture_to_iq2_xxs_with_the_measured_matrix(moe256_folder, tmp_path):  # noqa: F811
    """llama.cpp refuses a very-low-bit tensor without its entry and checks each entry's size
    (columns x experts): the measured matrix passes, and kvslim loads the result packed."""
    from kvslim.loading import convert_hf_to_gguf
    from kvslim.weights.modules import QuantExperts
    entries, ran = measure_importance(moe256_folder, "The quick brown fox. " * 200, n_ctx=64, max_chunks=4)
    assert ran == 4
    source = convert_hf_to_gguf(moe256_folder, tmp_path / "f32.gguf", "f32")
    out = peer.quantize(source, tmp_path / "iq2_xxs.gguf", "iq2_xxs", 2, {k: e.means() for k, e in entries.items()})
    experts = [m for m in load_model(out)[0].modules() if isinstance(m, QuantExperts)]
    assert experts and {e.gate_up_type[0].name for e in experts} == {"iq2_xxs"}


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_gguf_measures_as_its_checkpoint(tiny_folder, tmp_path, kind):
    """llama-imatrix runs a GGUF, and so does kvslim: an F32 file gives its checkpoint's entries
    exactly (tokenizer, names, layouts); a Q8_0 file runs with its matrices and experts packed,
    and its inputs are those of the same weights dequantized into float layers."""
    from kvslim.gguf.reader import read_model
    from kvslim.loading import config_from_dict, convert_hf_to_gguf, instantiate
    from kvslim.weights.modules import QuantExperts, QuantLinear
    folder, _ = tiny_folder(kind)
    text = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 40
    ref, _ = measure_importance(folder, text, n_ctx=64, max_chunks=3)
    got, ran = measure_importance(convert_hf_to_gguf(folder, tmp_path / "f32.gguf", "f32"), text, n_ctx=64, max_chunks=3)
    assert ran == 3 and got.keys() == ref.keys()
    assert all(np.array_equal(got[k].sums, e.sums) and np.array_equal(got[k].counts, e.counts) for k, e in ref.items())

    path = convert_hf_to_gguf(folder, tmp_path / "q8_0.gguf", "q8_0")
    packed = load_model(path, "f32")[0]
    assert any(isinstance(m, QuantLinear) for m in packed.modules())
    assert (kind == "qwen3_5_moe") == any(isinstance(m, QuantExperts) for m in packed.modules())
    config, state, _, _ = read_model(path, torch.float32)                        # every tensor dequantized
    dense = instantiate(config_from_dict(config), state, torch.float32, "cpu")
    assert not any(isinstance(m, (QuantLinear, QuantExperts)) for m in dense.modules())
    a, b = imatrix.collect(packed, CHUNKS), imatrix.collect(dense, CHUNKS)
    assert a.keys() == b.keys() and len(a) > 10
    for name, e in b.items():
        assert np.array_equal(a[name].counts, e.counts), name
        assert np.linalg.norm(a[name].sums - e.sums) <= 1e-4 * np.linalg.norm(e.sums), name   # float rounding


@needs_peer
def test_the_tools(tmp_path, capsys, short_imatrix):
    """``kvslim imatrix`` writes the file; ``kvslim convert --type iq2_xxs`` takes it, or measures
    one itself; bad arguments are named."""
    import gguf
    from kvslim.cli import main
    path = tmp_path / "imatrix.gguf"
    assert main(["imatrix", str(default_model()), "-o", str(path), "-c", "128", "--chunks", "3"]) == 0
    assert "3 chunks of 128 tokens of kvslim held-out classics+bible" in capsys.readouterr().out
    assert len(imatrix.read(path)) > 20
    for extra in (["--imatrix", str(path)], []):
        out = tmp_path / "iq2_xxs.gguf"
        assert main(["convert", str(default_model()), "-o", str(out), "--type", "iq2_xxs", *extra]) == 0
        assert ("measuring one" in capsys.readouterr().out) == (not extra)
        assert gguf.GGUFReader(str(out)).get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_IQ2_XXS
    assert main(["imatrix", str(default_model()), "-f", str(tmp_path / "none.txt")]) == 2
    assert "no such calibration text file" in capsys.readouterr().err
    assert main(["imatrix", str(out), "-o", str(tmp_path / "from-gguf.gguf"), "-c", "128", "--chunks", "2"]) == 0
    assert len(imatrix.read(tmp_path / "from-gguf.gguf")) == len(imatrix.read(path))   # an IQ2_XXS file runs packed
    assert main(["imatrix", str(tmp_path / "none.gguf")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["convert", str(default_model()), "-o", str(out), "--type", "iq2_xxs", "--imatrix", str(out)]) == 2
    assert "no <tensor>.in_sum2 entries" in capsys.readouterr().err
