"""Decode launches tuned on a GPU (``kvslim.gpu.tuned``): the sweep's choice, the files, and the
decode step taking a file's launch. No kernel runs here: the launches themselves are
tests/test_triton_attention.py's, and the sweep's dry run is tests/test_bench.py's."""
from __future__ import annotations

import json

import pytest
import torch

from kvslim import formats
from kvslim.cache import attention
from kvslim.gpu import paged_prefill, tuned

F16_DEFAULT = ({"BLOCK_N": 16, "num_warps": 8, "DOT": "f16", "CODECS": "units", "PREFETCH": False}, 512)
IEEE_DEFAULT = ({"BLOCK_N": 16, "num_warps": 8, "DOT": "ieee", "CODECS": "units", "PREFETCH": False}, 512)
WARPS = ({"KERNEL": "warps", "num_warps": 1, "KP": 1, "PREFETCH": 1}, 128)
TWO_WARPS_F16 = ({"BLOCK_N": 16, "num_warps": 2, "DOT": "f16", "CODECS": "units", "PREFETCH": 2}, 512)
MMA = ({"KERNEL": "mma", "N": 16}, 128)


def trial(launch, ms, err=1e-3):
    return [launch[0], launch[1], ms, err]


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    """A path KVSLIM_DECODE_TUNED names, the cache of files read cleared before and after."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned.ENV, str(path))
    tuned.reload()
    yield path
    tuned.reload()


def test_the_default_launches_are_the_backends():
    fmt = formats.get("turbo4")
    assert tuned.same_launch(fmt, fmt, 256, 8, F16_DEFAULT, (tuned.BACKENDS["bf16"], paged_prefill.SPLIT_KEYS))
    assert tuned.same_launch(fmt, fmt, 256, 8, IEEE_DEFAULT, (tuned.BACKENDS["f32"], paged_prefill.SPLIT_KEYS))
    assert not tuned.same_launch(fmt, fmt, 256, 8, F16_DEFAULT, (tuned.BACKENDS["bf16"], 128))
    assert not tuned.same_launch(fmt, fmt, 256, 8, TWO_WARPS_F16, (tuned.BACKENDS["bf16"], 512))
    assert tuned.same_launch(fmt, fmt, 256, 8, WARPS, ({"KERNEL": "warps"}, 128))
    assert attention.KERNEL_DOTS is tuned.BACKENDS


def test_the_sweep_takes_the_fastest_launch_over_every_point():
    """The geometric mean over the points the default was timed at decides: the two-warp tile
    wins on the means though the warps kernel is faster at batch 1; a launch not timed at every
    point, or off by more than TOLERANCE, is not taken."""
    trials = [trial(F16_DEFAULT, {"131072x8": 3.3, "131072x1": 0.45}),
              trial(WARPS, {"131072x8": 2.0, "131072x1": 0.2}, err=1e-7),
              trial(TWO_WARPS_F16, {"131072x8": 1.0, "131072x1": 0.3}),
              trial(({"BLOCK_N": 64, "num_warps": 8, "DOT": "f16"}, 512), {"131072x8": 0.5}),        # x1 cut
              trial(({"BLOCK_N": 32, "num_warps": 2, "DOT": "f16"}, 512), {"131072x8": 0.4, "131072x1": 0.1},
                    err=0.5)]                                                                      # wrong sums
    tune, split, ms, base = tuned.best(trials, 0, "bf16")
    assert (tune, split) == TWO_WARPS_F16
    assert ms == {"131072x1": 0.3, "131072x8": 1.0} and base == {"131072x1": 0.45, "131072x8": 3.3}


def test_the_float32_backend_takes_float32_products_only():
    """KERNEL "mma" (f16 operands) is the fastest here, and the bf16 backend's choice, never the
    float32 backend's."""
    trials = [trial(IEEE_DEFAULT, {"32768x8": 3.0}), trial(TWO_WARPS_F16, {"32768x8": 1.0}),
              trial(WARPS, {"32768x8": 2.0}), trial(MMA, {"32768x8": 0.5})]
    assert tuned.best(trials, 0, "f32")[:2] == WARPS
    assert tuned.best(trials, 0, "bf16")[:2] == MMA
    assert not tuned.float32_products(MMA[0]) and tuned.float32_products(WARPS[0])


def test_nothing_is_chosen_where_the_default_is_fastest_or_untimed():
    assert tuned.best([trial(F16_DEFAULT, {"131072x8": 1.0}), trial(WARPS, {"131072x8": 1.2})], 0, "bf16") is None
    assert tuned.best([trial(F16_DEFAULT, {}), trial(WARPS, {"131072x8": 1.2})], 0, "bf16") is None


def entry(backend="bf16", launch=TWO_WARPS_F16, k="turbo4", v="turbo4"):
    return tuned.Entry(k, v, 256, 8, backend, launch[0], launch[1], {"131072x8": 1.0}, {"131072x8": 3.3})


def test_saved_entries_load_back_and_replace_their_own_key(tmp_path):
    path = tmp_path / "NVIDIA_H200.json"
    tuned.save(path, [entry(), entry("f32", WARPS)], "NVIDIA H200", "gpu_decode.py --sweep")
    tuned.save(path, [entry(launch=WARPS), entry(k="q8_0")], "NVIDIA H200", "gpu_decode.py --sweep")
    got = tuned.load(path)
    assert set(got) == {("turbo4", "turbo4", 256, 8, "bf16"), ("turbo4", "turbo4", 256, 8, "f32"),
                        ("q8_0", "turbo4", 256, 8, "bf16")}
    assert (got["turbo4", "turbo4", 256, 8, "bf16"].tune, got["turbo4", "turbo4", 256, 8, "bf16"].split_keys) == WARPS
    doc = json.loads(path.read_text())
    assert doc["device"] == "NVIDIA H200" and doc["measured"] == "gpu_decode.py --sweep" and doc["triton"]
    assert tuned.file_for("NVIDIA H200") == tuned.DIR / "NVIDIA_H200.json"


@pytest.mark.parametrize("change,message", [
    ({"k": "turbo9"}, "entry 0: .*turbo9"),
    ({"backend": "f8"}, "entry 0: backend 'f8'"),
    ({"split_keys": 0}, "entry 0: split_keys 0 is not a positive integer"),
    ({"tune": {"BLOCK_M": 16}}, "entry 0: not a launch setting: BLOCK_M"),
    ({"tune": {"KERNEL": "warps", "BLOCK_N": 16}}, "entry 0: not a setting of KERNEL='warps': BLOCK_N"),
    ({"backend": "f32", "tune": {"DOT": "f16"}}, "entry 0: the f32 backend takes float32 products"),
    ({"backend": "f32", "tune": {"KERNEL": "mma"}}, "entry 0: the f32 backend takes float32 products, not those of "
                                                     "KERNEL='mma'"),
    ({"tune": [16, 8]}, "entry 0: tune \\[16, 8\\] is not an object"),
    ({"rows": None}, "entry 0: rows None is not a positive integer")])
def test_a_malformed_entry_is_refused_by_name(tmp_path, change, message):
    raw = {**entry().as_json(), **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"decode": [raw]}))
    with pytest.raises(ValueError, match=message) as err:
        tuned.load(path)
    assert str(path) in str(err.value)


def test_a_file_that_is_not_a_tuned_file_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="tuned decode launches .*t.json"):
        tuned.load(path)
    path.write_text(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match="an object with a 'decode' list expected"):
        tuned.load(path)


def test_every_packaged_file_loads():
    """The files committed from leases (kvslim/gpu/tuned/) parse and their launches are ones the
    kernels take, named for the device they were measured on."""
    files = sorted(tuned.DIR.glob("*.json"))
    if not files:
        pytest.skip("no lease has written a tuned file yet")
    for path in files:
        doc = json.loads(path.read_text())
        assert tuned.file_for(doc["device"]) == path
        assert tuned.load(path)


def test_the_launch_comes_from_the_file_then_the_defaults(tuned_file, monkeypatch):
    fmt_k, fmt_v, cpu = formats.get("turbo4", role="k"), formats.get("turbo4", role="v"), torch.device("cpu")
    tuned.save(tuned_file, [entry(), entry("f32", WARPS)], "NVIDIA H200", "test")
    assert tuned.decode_launch(fmt_k, fmt_v, 256, 8, "bf16", cpu) == TWO_WARPS_F16
    assert tuned.decode_launch(fmt_k, fmt_v, 256, 5, "f32", cpu) == WARPS          # 5 rows: a tile of 8
    assert tuned.decode_launch(fmt_k, fmt_v, 128, 8, "bf16", cpu) == ({"DOT": "f16"}, 512)
    assert tuned.decode_launch(fmt_k, formats.get("q8_0"), 256, 8, "f32", cpu) == (None, 512)
    monkeypatch.setenv(tuned.ENV, "0")
    tuned.reload()
    assert tuned.decode_launch(fmt_k, fmt_v, 256, 8, "bf16", cpu) == ({"DOT": "f16"}, 512)


def test_no_file_serves_a_cpu_unless_named(monkeypatch):
    monkeypatch.delenv(tuned.ENV, raising=False)
    tuned.reload()
    fmt = formats.get("turbo4")
    assert tuned.decode_launch(fmt, fmt, 256, 8, "bf16", torch.device("cpu")) == ({"DOT": "f16"}, 512)
    tuned.reload()


def test_a_decode_step_launches_what_the_file_says(tuned_file, monkeypatch):
    """The paged_decode op hands the kernel the file's launch and keys a split for its formats,
    head_dim and query heads a KV head (16 over 2 here), and the backend's default elsewhere."""
    from kvslim.gpu import paged_decode as gpu_decode
    tuned.save(tuned_file, [entry()], "NVIDIA H200", "test")
    seen = []
    monkeypatch.setattr(attention.gpu, "TRITON", True)
    monkeypatch.setattr(gpu_decode, "serves_step", lambda *a: True)
    monkeypatch.setattr(gpu_decode, "step_output", lambda *a, split_keys, tune, gate: seen.append((tune, split_keys))
                        or torch.zeros(a[2].shape))
    q = torch.randn(1, 16, 256)
    pool = torch.zeros(2, 1, 16, 1, dtype=torch.uint8)
    args = (pool, pool, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long), 0.0625)
    torch.ops.kvslim.paged_decode(q, *args, "turbo4", "turbo4", "bf16")
    torch.ops.kvslim.paged_decode(q, *args, "turbo4", "turbo4", "f32")
    torch.ops.kvslim.paged_decode(q, *args, "q8_0", "turbo4", "bf16")
    assert seen == [TWO_WARPS_F16, (None, 512), ({"DOT": "f16"}, 512)]
