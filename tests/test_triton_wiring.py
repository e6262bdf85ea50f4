"""The Triton kernels as the model uses them: whole-model logits with attention served by them.

Under Triton's interpreter (TRITON_INTERPRET=1) the kernels accept CPU tensors, so in such a
child process ``attend_pages`` hands prompt chunks to ``gpu.paged_prefill`` and decode rows to
``gpu.paged_decode`` (on a GPU they take CUDA tensors the same way). New rows are
encoded into the pools by ``gpu.kv_append``. The bundled model's
logits over a prompt and a few cached decode steps must match this process's, where the
torch block loop and the C kernel serve attention. This checks the wiring (shapes, code
domains, the f16 window folded after the kernel's state), not only the kernels.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvslim.gpu

from kvslim.gpu import paged_decode

from .test_triton_weights import embedding_inputs
from .triton_harness import attention_kernels_only, run_interpreted

pytestmark = pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed")
# (K, V, f16 window). Formats whose kernel encoder writes torch's bytes here: iq4_nl's can flip
# a near-tie code (tests/test_triton_append.py), which moves this tiny model's logits by ~0.02.
PAIRS = [("q8_0", "turbo4", 0), ("f16", "q4_0", 8)]
PROMPT, STEPS = list(range(5, 53)), [60, 61, 62]


def logits(pairs, pools: list | None = None):
    """Prefill PROMPT in chunks of 20 (a chunk at depth), then one token per STEPS, per pair.
    ``pools`` (a list) gets each pair's attention layers' (K pool, V pool) bytes."""
    from kvslim.loading import load_model
    from kvslim.models import Batch
    model, _, _ = load_model(None, torch.float32, torch.device("cpu"))
    out = []
    for type_k, type_v, window in pairs:
        cache = model.make_cache(128, 1, type_k, type_v, f16_window=window)
        rows = [model(Batch.build([(0, PROMPT[i:i + 20], i)]), cache, all_logits=True)
                for i in range(0, len(PROMPT), 20)]
        rows += [model(Batch.build([(0, [tok], len(PROMPT) + i)]), cache, all_logits=True)
                 for i, tok in enumerate(STEPS)]
        out.append(torch.cat(rows))
        if pools is not None:
            pools.append([(c.k_pool.clone(), c.v_pool.clone()) for c in cache.kv_layers])
    return out


def _dot_of(args: tuple, kw: dict) -> str:
    """The DOT a ``paged_prefill.prefill_state`` or ``attend`` call asks for (decode_state passes its tune as
    the 10th argument, attend_pages by name)."""
    tune = kw["tune"] if "tune" in kw else (args[9] if len(args) > 9 else None)
    return (tune or {}).get("DOT", "ieee")


def logits_counted(pairs, path: Path) -> None:
    """``logits`` in the interpreted child, counting the kernels' calls. Only the attention kernels
    serve (``attention_kernels_only``): the others sum and round a few float32 ulps from torch,
    which could move the first attention layer's K/V off the torch path's bytes."""
    from kvslim.gpu import kv_append, paged_prefill
    attention_kernels_only()
    calls = {"prefill": 0, "decode": 0, "append": 0}

    dots = set()

    def counted(module, name, key):
        inner = getattr(module, name)

        def call(*args, **kw):
            calls[key] += len(args[0]) if key == "append" else 1      # the K and V sides a launch stores
            if key == "prefill":
                dots.add(_dot_of(args, kw))
            return inner(*args, **kw)
        setattr(module, name, call)
    counted(paged_prefill, "prefill_state", "prefill")
    counted(paged_decode, "decode_state", "decode")
    counted(kv_append, "_append", "append")
    pools = []
    torch.save({"logits": logits(pairs, pools), "pools": pools, "calls": calls, "dots": dots}, path)


def flipped_rows(got, want, fmt: str) -> int:
    """Rows of a pool (layers, pages, rows, bytes) whose codes differ, each checked to be a near
    tie: one byte differs, by one step of a 4-bit code (a nibble +-1) or of a byte (an 8-bit
    code, or a scale's low byte by an ulp). A wrong decode, mask or window changes many bytes of
    a row. f16 rows count as equal: their bytes differ by the ulps the kernels' summation order
    gives the inputs."""
    if fmt == "f16":
        return 0
    rows = (got != want).any(-1)
    for a, b in zip(got[rows], want[rows]):
        where = (a != b).nonzero().flatten()
        step = abs(int(a[where[0]]) - int(b[where[0]]))          # 255: an int8 code's -1 <-> 0
        assert len(where) == 1 and step in (1, 16, 255), \
            f"{fmt}: a row differs in bytes {where.tolist()} by {step}: not a near tie"
    return int(rows.sum())


def test_model_logits_with_triton_attention_match_the_torch_paths(tmp_path):
    got = run_interpreted("tests.test_triton_wiring", "logits_counted", PAIRS, tmp_path)
    # 2 attention layers: 3 prompt chunks and 3 decode steps per pair, each storing K and V
    # (the f16 window's rows are encoded when they leave it, in other calls); a decode call
    # launches the one attention kernel through prefill_state too
    calls = got["calls"]
    assert calls["decode"] == 2 * 3 * len(PAIRS) and calls["prefill"] == 2 * (2 * 3 * len(PAIRS))
    assert got["dots"] == {"ieee"}                  # the torch backend: float32 products
    assert calls["append"] >= 2 * 2 * 6 * len(PAIRS) - 2 * 2 * 6, calls
    # The attention kernels sum in another order, so the second attention layer sees inputs a
    # few ulps apart, and a value near a rounding edge takes the other code. Measured: on the
    # weights trained to 32K, 1 q8_0 K row of 48 flipped and the logits moved 1.7e-3; on v5's,
    # one q4_0 V row (f16/q4_0) and the logits moved 0.063 at the 3 positions that attend to it
    # (the rest within 1e-4); with the prompt's float32 matmuls in bf16x3 (models/matmul_precision),
    # two rows of that pool, the logits again 0.063 apart; with them in plain float32 on an AMX
    # Xeon (whose bf16 mode rounds once, so it is not taken), three rows, each by one step of one
    # code or of a scale's last bit, the logits 0.069 apart. So the first layer's pools must be
    # bit-identical (its K/V come before any attention), the second's may flip four rows per pool
    # (of 48 x 2 heads), each a near tie (flipped_rows), and only a pair without a flip is
    # held to 3e-3; a flipped pair keeps every argmax and stays within 0.1. A wrong decode or mask
    # moves the logits by more (an f16 window of 0 or 16 rows instead of 8: 0.25) and flips many
    # rows; test_triton_append checks the appended bytes.
    want_pools = []
    for (type_k, type_v, _), a, b, pools, ref in zip(PAIRS, got["logits"], logits(PAIRS, want_pools), got["pools"],
                                                     want_pools):
        (k0, v0), (k0_ref, v0_ref) = pools[0], ref[0]
        assert torch.equal(k0, k0_ref) and torch.equal(v0, v0_ref), f"{type_k}/{type_v}: first layer's pools"
        flips = [flipped_rows(p, q, fmt) for (p, q), fmt in zip(zip(pools[1], ref[1]), (type_k, type_v))]
        assert max(flips) <= 4, f"{type_k}/{type_v}: {flips} rows of the second layer's K/V pools differ"
        if sum(flips) == 0:
            torch.testing.assert_close(a, b, atol=3e-3, rtol=1e-4, msg=f"{type_k}/{type_v}")
        else:
            torch.testing.assert_close(a, b, atol=0.1, rtol=0, msg=f"{type_k}/{type_v} (a near-tie code flipped)")
            assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{type_k}/{type_v}"


def backend_forward(args):
    """The bundled model with K/V types and attention backend ``args``: a 20-token prompt chunk, a
    decode step in a flat batch and one through a DecodeBatch (the paged_decode op, as CUDA
    graphs run it). In the interpreted child (``tuned_forwards``) the attention kernels serve it;
    the DOT and kernel each attention kernel launch was given are kept."""
    type_k, type_v, backend = args
    from kvslim.devices import to_device
    from kvslim.gpu import paged_prefill
    from kvslim.loading import load_model
    from kvslim.models import Batch, DecodeBatch
    dots, kernels = [], []
    inner = paged_prefill.attend                     # every attention launch: prefill_state's and step_output's

    def seen(*args, **kw):
        dots.append(_dot_of(args, kw))
        kernels.append(((kw.get("tune") or {}).get("KERNEL", "tiles"), kw.get("split_keys", paged_prefill.SPLIT_KEYS)))
        return inner(*args, **kw)
    paged_prefill.attend = seen
    try:
        model, _, _ = load_model(None, torch.float32, torch.device("cpu"))
        cache = model.make_cache(64, 1, type_k, type_v, backend=backend)
        rows = [model(Batch.build([(0, PROMPT[:20], 0)]), cache, all_logits=True),
                model(Batch.build([(0, [STEPS[0]], 20)]), cache)]
        cache.prepare_decode([0], [21])
        rows.append(model.run(DecodeBatch(*[to_device(x, "cpu") for x in ([STEPS[1]], [21], [0])], 2), cache))
        cache.commit_decode([0])
    finally:
        paged_prefill.attend = inner
    return {"logits": torch.cat(rows), "dots": dots, "kernels": kernels}


# The pairs a lease's end-to-end run times; a tuned file choosing KERNEL "mma" for each (its loads
# early, in splits of 16 keys)
TUNED_PAIRS = [("q8_0", "turbo4"), ("turbo3", "turbo3"), ("f16", "f16")]
MMA = {"KERNEL": "mma", "N": 16, "PREFETCH": 1, "EARLY": 1}


def tuned_forwards(folder: str, path: Path) -> None:
    """In the interpreted child: ``backend_forward`` on the bf16 backend for each of TUNED_PAIRS,
    with a tuned file (written to ``folder``) choosing MMA for its decode steps, then with none
    (KVSLIM_DECODE_TUNED=0: the backend's default launch). One child for all six: a child's start
    is a few seconds."""
    import os
    from kvslim.gpu import tuned
    attention_kernels_only()
    out = {}
    for type_k, type_v in TUNED_PAIRS:
        file = Path(folder) / f"{type_k}-{type_v}.json"
        tuned.save(file, [tuned.Entry(type_k, type_v, 128, 2, "bf16", MMA, 16)], "test", "test")
        runs = []
        for chosen in (str(file), "0"):
            os.environ[tuned.ENV] = chosen
            tuned.reload()
            runs.append(backend_forward((type_k, type_v, "bf16")))
        out[type_k, type_v] = runs
    torch.save(out, path)


@pytest.fixture(scope="module")
def tuned_runs(tmp_path_factory):
    """(K, V) -> (with the mma file, with none): what ``tuned_forwards`` saw in one interpreted child."""
    folder = tmp_path_factory.mktemp("tuned")
    return run_interpreted("tests.test_triton_wiring", "tuned_forwards", str(folder), folder)


def test_the_bf16_backend_takes_the_kernels_products_in_f16(tuned_runs):
    """``--attn-backend bf16`` (kvslim serve's default) reaches the GPU kernels: every attention
    launch, prompt chunk or decode step, eager or through the paged_decode op, takes f16
    operands on tensor cores (the torch backend's launches keep float32 products:
    ``logits_counted``). The logits move from the torch backend's here (float32 products) by
    what f16 operands allow, no more."""
    got = tuned_runs["q8_0", "turbo4"][1]             # no tuned file: the backend's default launches
    assert got["dots"] == ["f16"] * 6              # 2 attention layers x (prompt chunk, flat step, DecodeBatch step)
    want = backend_forward(("q8_0", "turbo4", "torch"))["logits"]
    assert not torch.equal(got["logits"], want)
    torch.testing.assert_close(got["logits"], want, atol=0.02, rtol=0)   # measured: 3.8e-3 on logits up to 12
    assert torch.equal(got["logits"].argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("type_k,type_v", TUNED_PAIRS)
def test_a_tuned_file_serves_the_models_decode_steps_by_mma(tuned_runs, type_k, type_v):
    """The path a lease's end-to-end run takes with its sweep's file (KVSLIM_DECODE_TUNED) where
    that file chooses KERNEL "mma" (its three pairs): the bundled model's decode step through the paged_decode op
    (as CUDA graphs run it) launches the tensor-core kernel, with its loads early, in splits of
    16 keys (22 keys: two splits, merged, the output gate in the merge); prompt chunks and the
    flat step keep the default launch. The step's logits stay where the bf16 backend's default
    launch puts them (f16 operands both), and the rows before it are the same bits."""
    got, want = tuned_runs[type_k, type_v]
    # the prompt chunk's, the flat step's, then the op's launch, each in the 2 attention layers
    # (mma's operands are f16 whatever DOT says; the tile kernel's launches take the backend's f16)
    assert got["kernels"] == [("tiles", 512)] * 4 + [("mma", 16)] * 2 and got["dots"][:4] == ["f16"] * 4
    assert want["kernels"] == [("tiles", 512)] * 6
    assert torch.equal(got["logits"][:-1], want["logits"][:-1])      # the same launches up to the op's step
    # measured: 7e-4, 3.1e-3 and 4e-4 (logits up to 12)
    torch.testing.assert_close(got["logits"][-1], want["logits"][-1], atol=0.01, rtol=0)
    assert torch.equal(got["logits"].argmax(-1), want["logits"].argmax(-1))


def quant_linear_served(shapes, path: Path) -> None:
    """``kvslim.weights.quant_linear`` in the interpreted child: which kernel served each call."""
    from kvslim import weights
    from kvslim.gpu import quant_matmul
    calls, out = [], []
    for fn in ("gemv", "gemm", "rows"):                          # count the calls, then run them
        inner = getattr(quant_matmul, fn)
        setattr(quant_matmul, fn, lambda *a, _f=inner, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    for name, rows in shapes:
        w = weights.QuantTensor.quantize(torch.randn(48, 256, generator=torch.Generator().manual_seed(rows)),
                                         weights.get(name))
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
        out.append((weights.quant_linear(x, w), weights.reference_linear(x, w)))
    from kvslim.weights.matmul import embedding_rows
    embedded = [embedding_rows(ids, w, getattr(torch, dtype)) for ids, w, dtype in embedding_inputs()]
    torch.save({"calls": calls, "out": out, "embedded": embedded}, path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    shapes = [("q8_0", 1), ("q4_0", 3), ("q4_0", 40)]
    return run_interpreted("tests.test_triton_wiring", "quant_linear_served", shapes,
                           tmp_path_factory.mktemp("served"))


def test_quantized_linear_takes_the_triton_kernels_where_they_run(served):
    """On a GPU (here: the interpreter) quant_linear hands q8_0/q4_0 weights to the Triton GEMV
    (decode rows) and GEMM (a prompt's rows), equal to the whole matrix dequantized."""
    assert served["calls"][:3] == ["gemv", "gemv", "gemm"]
    for got, want in served["out"]:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_embedding_rows_take_one_launch_and_gguf_values(served):
    """A quantized embedding's lookup with the kernels on: one ``quant_matmul.rows`` launch a
    call, the torch decoders' values (gguf's) rounded once to the type, bit for bit; an id
    outside the table gives zeros (never other memory)."""
    from kvslim.weights.matmul import embedding_rows
    assert served["calls"][3:] == ["rows"] * 3
    for got, (ids, w, dtype) in zip(served["embedded"], embedding_inputs()):
        inside = ids.clamp(0, w.shape[0] - 1)
        want = embedding_rows(inside, w, getattr(torch, dtype))               # the kernels are off here
        want[(ids != inside)] = 0
        assert got.dtype == want.dtype and got.shape == (*ids.shape, 512)
        assert torch.equal(got, want)


def test_bad_embedding_lookups_are_named():
    from kvslim.gpu import quant_matmul
    ids, w, _ = embedding_inputs()[0]
    with pytest.raises(ValueError, match="integer ids"):
        quant_matmul.rows(ids.float(), w.data, w.wtype.ggml_type, w.cols, torch.float32)
    with pytest.raises(ValueError, match="rows of 256 values"):
        quant_matmul.rows(ids, w.data, w.wtype.ggml_type, 256, torch.float32)


def mixture_logits(variants, path: Path) -> None:
    """The tiny qwen3_5_moe of each (folder, weights) variant (q8_0 weights, or float32 experts
    with ``weights`` None), in the interpreted child (both variants in one: a child's start is
    a few seconds) or here: prompts of 70 and 4 tokens in one batch (148 routed pairs: the
    grouped GEMM) and a decode step of the two (4 pairs: the expert GEMV, or batched products),
    f16 K/V; which expert, DeltaNet-step and gated-norm kernels ran, counted."""
    from kvslim.gpu import add_norm, delta_step, gated_norm, quant_matmul
    from kvslim.loading import load_model
    from kvslim.models import Batch
    calls, out = [], []
    for module, fn in ((quant_matmul, "gemm_experts"), (quant_matmul, "gemv_experts"),
                       (quant_matmul, "gemv_mixture_down"), (delta_step, "delta_step"),
                       (gated_norm, "gated_rms_norm"), (add_norm, "add_rms_norm")):
        inner = getattr(module, fn)
        setattr(module, fn, lambda *a, _f=inner, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    for folder, weights in variants:
        calls.clear()
        model, _, _ = load_model(folder, torch.float32, torch.device("cpu"), weights=weights)
        cache = model.make_cache(128, 2, "f16", "f16")
        prompt = model(Batch.build([(0, list(range(3, 73)), 0), (1, list(range(5, 9)), 0)]), cache, all_logits=True)
        step = model(Batch.build([(0, [80], 70), (1, [81], 4)]), cache)
        mixtures = sum(type(m).__name__ == "SparseMoE" for m in model.modules())
        deltas = sum(type(m).__name__ == "GatedDeltaNet" for m in model.modules())
        out.append({"logits": (prompt, step), "calls": list(calls), "mixtures": mixtures, "deltas": deltas,
                    "layers": len(model.model.layers)})
    torch.save(out, path)


# (tiny model, weights): q8_0 experts; float32 experts; q8_0 with the shared expert as wide as a
# routed one, so that it runs as one more pair of their GEMVs (quant_matmul.SHARED_AS_PAIR)
MIXTURES = [("qwen3_5_moe", "q8_0"), ("qwen3_5_moe", None), ("qwen3_5_moe_even", "q8_0")]


@pytest.fixture(scope="module")
def interpreted_mixtures(tiny_folder, tmp_path_factory):
    """(kind, weights) -> what ``mixture_logits`` saw in one interpreted child, with the kernels on."""
    variants = [(str(tiny_folder(kind)[0]), w) for kind, w in MIXTURES]
    return dict(zip(MIXTURES, run_interpreted("tests.test_triton_wiring", "mixture_logits", variants,
                                              tmp_path_factory.mktemp("mixtures"))))


@pytest.mark.parametrize("kind,weights", MIXTURES, ids=lambda v: str(v))
def test_mixture_model_logits_with_grouped_experts_match_the_loop(interpreted_mixtures, tiny_folder, tmp_path, kind,
                                                                  weights):
    """A whole mixture-of-experts model (GGUF or float experts) with every kernel on (weights' GEMV/GEMM, routed experts
    grouped, attention, append, the DeltaNet decode step and output norm) gives the logits of this process's paths
    (experts looped). A quantized shared expert as wide as a routed one joins their GEMVs in the decode step."""
    got = interpreted_mixtures[(kind, weights)]
    assert got["mixtures"] > 0                               # the prompt: gate_up and down per mixture layer
    assert got["calls"].count("gemm_experts") == 2 * got["mixtures"]
    assert ("gemv_experts" in got["calls"]) == bool(weights)  # decode: the GEMV, or dense batched products
    shared_pairs = got["mixtures"] if kind == "qwen3_5_moe_even" else 0
    assert got["calls"].count("gemv_mixture_down") == shared_pairs   # the shared pair's down projection and combine
    assert got["deltas"] > 0 and got["calls"].count("delta_step") == got["deltas"]   # decode: one a DeltaNet layer
    assert got["calls"].count("gated_rms_norm") == got["deltas"]   # the prompt's output norms (the step's: in its launch)
    # add-norms: the prompt's 2 a layer (less the first layer's input, plus the final norm's); the
    # step's the same with float weights, none with quantized ones, whose mixers' output projections
    # and mixtures' down projections take them in their GEMVs' launches
    layers = got["layers"]
    assert got["calls"].count("add_rms_norm") == 2 * layers + (0 if weights else 2 * layers)
    mixture_logits([(str(tiny_folder(kind)[0]), weights)], tmp_path / "here.pt")
    want = torch.load(tmp_path / "here.pt")[0]
    assert want["calls"] == []                               # kernels off here: the loop
    for a, b in zip(got["logits"], want["logits"]):
        torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_every_kernel_launch_names_its_fp_fusion():
    """Each ``kernel[grid](...)`` in kvslim/gpu says whether Triton may fuse a * b + c (via
    ``**FP_FUSION`` or ``enable_fp_fusion=``): Triton 3.10 flips the unnamed default, which would
    change the kernels' rounding and speed silently."""
    import ast
    launches, unnamed = 0, []
    for path in sorted(Path(kvslim.gpu.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launches += 1
                names = {k.arg for k in node.keywords} | {ast.unparse(k.value) for k in node.keywords if k.arg is None}
                if not names & {"enable_fp_fusion", "FP_FUSION"}:
                    unnamed.append(f"{path.name}:{node.lineno}")
    assert launches >= 6, f"found only {launches} kernel launches: the scan no longer sees them"
    assert not unnamed, f"kernel launches without enable_fp_fusion: {unnamed}"
