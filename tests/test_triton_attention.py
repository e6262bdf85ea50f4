"""The Triton decode attention (the prefill kernel, every row at its newest position) against
the torch block loop (its reference), on the CPU.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernel with numpy on CPU tensors, so its
indexing, unpacking and online softmax are checked without a GPU. Triton reads that switch
when a kernel is decorated, and importing kvslim already imports triton (through torch), so the
kernels run in one child process started with the switch set; the references run here. The cases mirror
tests/test_native_attention.py: pools from each format's own encoder, shuffled pages,
sequences of different lengths (a partial last page, one empty), several splits per sequence.
What the interpreter cannot check (compilation, tf32 or layout choices of the GPU compiler,
speed) waits for a CUDA run: see docs/gpu.md.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import kvslim.gpu

from kvslim import formats
from kvslim.gpu import paged_decode as gpu
from kvslim.gpu import paged_prefill

from .test_native_attention import _case, _torch_state
from .triton_harness import (check_state, compile_for_sm90, compiled_process, resource_usage, run_interpreted,
                             spilled_bytes)

pytestmark = pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed: no GPU kernel to check")

PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("iq4_nl", "f16"), ("turbo4", "q8_0"),
         ("f16", "turbo4"), ("turbo3", "iq4_nl"), ("bf16", "f32"), ("nl4", "turbo2"), ("q4_0", "nl3"),
         ("q5_1", "q4_1"), ("q5_0", "q5_1-norot"), ("q4_1", "turbo3"),
         ("nl4s", "nl3s")]                   # index 13: head_dim 128 and 256 (nls rows are blocks of 128)
SHAPES = [(64, 1), (128, 4), (256, 8)]                 # (head_dim, GQA group): each pair meets two, each shape 5+ pairs
LENGTHS = (37, 100, 16, 0)                             # a partial page, a whole page, an empty sequence
# (K, V, head_dim, group, lengths, page_size, split_keys): split_keys None is the default SPLIT_KEYS
CASES = [(k, v, dim, group, LENGTHS, 16, 64) for i, (k, v) in enumerate(PAIRS)
         for dim, group in (SHAPES[i % 3], SHAPES[(i + 1) % 3])]
LONG = ("q8_0", "turbo4", 64, 2, (1100, 5), 32, None)            # several default splits
ODD_PAGES = ("iq4_nl", "q4_0", 64, 3, (50, 7), 12, 32)          # a page size that is not a power of two
# a head_dim that is not a power of two: codes read one by one, iq4_nl's K table by a tree of
# selects, turbo4's V table by a gather (the other cases read codes in units)
ODD_DIM = ("iq4_nl", "turbo4", 96, 2, (40, 9), 16, 32)
BATCH = ("f16", "q8_0", 64, 4, (150, 37, 70), 16, 64)
REFUSED = [("turbo4p", "f16")]   # a QJL sketch
# launch overrides (benchmarks/gpu_decode.py --sweep's kind) on ODD_PAGES: wider key blocks than a
# page and than a split's tail, another dot precision; they change the schedule, not the sums' terms
TUNED = [{"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_N": 32, "num_stages": 2, "DOT": "tf32x3"},
         {"BLOCK_N": 8, "DOT": "fma", "WIDE": True},     # fma: 3 query rows in a tile of 4, 8 keys a block
         {"DOT": "f16"},                                 # f16 operands: held to a looser bound below
         {"CODECS": "per-value"},                        # session 31's reading: a load per value
         {"PREFETCH": True, "BLOCK_N": 8},               # rows a block ahead, blocks across pages of 12
         {"PREFETCH": True, "DOT": "f16", "BLOCK_N": 32},
         {"COLUMNS": "strided"}, {"COLUMNS": "strided", "DOT": "f16"}]   # codes W columns apart (sessions 32-44)

# PREFETCH 2 (each block's codes loaded a block ahead, its table rows two ahead), against the same
# launch without it: 3-bit units (three loads a group), q4_1's offset, f16 rows as they lie with f16
# products, q8_0 (not prefetched: read at use), blocks of 8 across pages of 12, empty sequences
PREFETCHED = [(("turbo3", "q4_1", 64, 2, (50, 7, 0, 30), 12, 32), {"BLOCK_N": 8}),
              (("f16", "q8_0", 128, 4, (61, 16), 16, None), {"DOT": "f16", "BLOCK_N": 16}),
              (("turbo4", "turbo2", 256, 8, (40, 3), 16, 32), {"DOT": "f16", "BLOCK_N": 32}),
              (("iq4_nl", "f16", 64, 1, (100, 1), 16, 64), {"BLOCK_N": 16})]

# f16 products on codes read from a table (turbo's Lloyd-Max, iq4_nl's), by integer steps (q4_0) or
# as bytes (q8_0): values and scales taken in f16 and multiplied there; f16 rows read as they lie
# (``_codecs``' HALF), at decode's shapes
F16_TABLES = [("turbo4", "turbo3", 256, 8, (40, 3), 16, 32), ("turbo2", "iq4_nl", 128, 4, (37, 16), 16, None),
              ("iq4_nl", "turbo4", 64, 2, (20,), 16, None), ("q8_0", "q4_0", 256, 8, (33, 5), 16, None),
              ("turbo4", "f16", 128, 8, (30, 7), 16, None)]


# decode by warps (KERNEL "warps": each warp its own keys, products on CUDA cores): 4-bit codes
# from tables and by integer steps, turbo3's 3-bit groups (half a group a lane), q4_1's offsets,
# q8_0's bytes, f16 and bf16 rows; one warp (its
# sums rescaled only when a row's max grows), two and four; one and two keys a warp a step; 64-bit
# row offsets; pages of 12; empty sequences, and a sequence of 100 keys over two splits of 64
WARPS = [(("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32), {"num_warps": 4}),
         (("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32), {}),
         (("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32), {"PREFETCH": 0}),
         (("q4_0", "iq4_nl", 128, 4, (41, 16), 16, None), {"num_warps": 1, "KP": 2}),
         (("f16", "q8_0", 128, 4, (37, 100), 16, 64), {"num_warps": 4, "KP": 2}),
         (("q8_0", "turbo2", 256, 5, (20, 1, 0), 12, None), {"num_warps": 1, "WIDE": True}),
         (("q4_1", "bf16", 128, 1, (33,), 16, None), {"num_warps": 2, "PREFETCH": 0}),
         (("turbo3", "turbo3", 256, 8, (40, 3), 16, 32), {}),
         (("f16", "turbo3", 256, 2, (20,), 12, None), {"num_warps": 2, "PREFETCH": 0})]
# queries 12x _case's: scores spread over tens, so a one-warp program's running max grows past
# RESCALE_AT after its first step, and its sums are rescaled there (RESCALE_AT 1e30: at the first
# step only, where the max grows from -inf)
STEEP = ("turbo4", "q8_0", 128, 2, (48, 20), 16, None)
# step_output by warps: one split (the output stored by the kernel, gated too), and two (merged)
WARP_STEPS = [("q8_0", "turbo4", 128, 4, (20, 5), 16, None, "bfloat16"),
              ("turbo4", "q4_0", 256, 8, (72, 3), 32, 64, "float32")]


def _states_in_child(cases, path: Path) -> None:
    """Run in a child whose TRITON_INTERPRET=1 came before triton's import (kvslim imports triton
    through torch, so this process cannot switch its kernels to the interpreter)."""
    out = {"kernels": [], "alone": None, "supports": []}
    for case in cases:
        args = _case(*case[:4], list(case[4]), page_size=case[5])
        split = {} if case[6] is None else {"split_keys": case[6]}
        out["kernels"].append((gpu.supports(*args[:3]), gpu.decode_state(*args, **split)))
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case(*BATCH[:4], list(BATCH[4]), page_size=BATCH[5])
    out["alone"] = gpu.decode_state(fmt_k, fmt_v, q[:, :1].contiguous(), k_pool, v_pool, table[:1], n_keys[:1], 64)
    args = _case(*ODD_PAGES[:4], list(ODD_PAGES[4]), page_size=ODD_PAGES[5])
    out["tuned"] = [gpu.decode_state(*args, split_keys=ODD_PAGES[6], tune=tune) for tune in TUNED]
    out["prefetched"] = []
    for case, tune in PREFETCHED:
        args = _case(*case[:4], list(case[4]), page_size=case[5])
        split = case[6] or paged_prefill.SPLIT_KEYS
        out["prefetched"].append((gpu.decode_state(*args, split_keys=split, tune={**tune, "PREFETCH": 2}),
                                  gpu.decode_state(*args, split_keys=split, tune=tune)))
    out["f16_tables"] = [gpu.decode_state(*_case(*case[:4], list(case[4]), page_size=case[5]),
                                          split_keys=case[6] or paged_prefill.SPLIT_KEYS, tune={"DOT": "f16"})
                         for case in F16_TABLES]
    out["warps"] = [gpu.decode_state(*_case(*case[:4], list(case[4]), page_size=case[5]),
                                     split_keys=case[6] or paged_prefill.SPLIT_KEYS, tune={"KERNEL": "warps", **tune})
                    for case, tune in WARPS]
    steep = list(_case(*STEEP[:4], list(STEEP[4]), page_size=STEEP[5]))
    steep[2] = steep[2] * 12
    out["steep"] = [gpu.decode_state(*steep, tune={"KERNEL": "warps", "num_warps": warps, "RESCALE_AT": at})
                    for warps, at in ((1, 8.0), (1, 1e30), (4, 8.0))]
    from kvslim.gpu import swiglu
    out["warp_steps"] = []
    for step in WARP_STEPS:
        args, gate = _step_args(step), _step_gate(step)
        tune = {"KERNEL": "warps", "num_warps": 1}
        plain = gpu.step_output(*args[:-1], **args[-1], tune=tune)
        out["warp_steps"].append((plain, gpu.step_output(*args[:-1], **args[-1], tune=tune, gate=gate),
                                  swiglu.sigmoid_mul(gate, plain, gate.dtype)))
    gpu.DECODE_BY_WARPS = True                  # the switch: chosen over the bf16 backend's f16 products
    args = _step_args(WARP_STEPS[0])
    q, n_kv = args[2], args[4].shape[0]
    tune, split = gpu.step_launch(args[0], args[1], q.shape[-1], q.shape[1] // n_kv, "bf16", q.device)
    out["by_switch"] = gpu.step_output(*args[:-1], **args[-1], split_keys=split, tune=tune)
    gpu.DECODE_BY_WARPS = False
    q = torch.zeros(2, 1, 2, 128)
    out["supports"] = [gpu.supports(formats.get(k), formats.get(v), q) for k, v in REFUSED + [("f16", "f16")]]
    out["supports"].append(gpu.supports(formats.get("f16"), formats.get("f16"), torch.zeros(2, 1, 65, 128)))
    out["merged"] = [paged_prefill.merged(*_split_states(*shape)) for shape in MERGES]
    out["merged_gpu_tile"] = paged_prefill.merged(*_split_states(*MERGES[0]), tile=paged_prefill.MERGE_TILE)
    out["steps"] = [(gpu.serves_step(*args[:3], args[4].shape[0]), gpu.step_output(*args[:-1], **args[-1]))
                    for args in map(_step_args, STEPS)]
    out["gated"] = []
    for step, (_, plain) in zip(STEPS, out["steps"]):
        args, gate = _step_args(step), _step_gate(step)
        out["gated"].append((gpu.step_output(*args[:-1], **args[-1], gate=gate),
                             swiglu.sigmoid_mul(gate, plain, gate.dtype)))
    torch.save(out, path)


# A decode step's attention as the paged_decode op hands it over: (K, V, head_dim, group, lengths,
# page_size, split_keys, q dtype). Splits of 64 keys (merged into the output) or one split (the
# output stored by the attention kernel itself); rotated K and V; bf16 queries.
STEPS = [("q8_0", "q4_0", 128, 4, (37, 100, 16), 16, 64, "bfloat16"),
         ("turbo4", "turbo3", 64, 2, (20, 5), 16, None, "float32"),
         ("f16", "iq4_nl", 64, 8, (600, 3), 32, None, "bfloat16"),
         ("iq4_nl", "turbo4", 64, 1, (9,), 16, None, "bfloat16"),
         ("q8_0", "f16", 128, 4, (37, 100), 16, 64, "bfloat16"),            # V unrotated: the merge stores
         ("turbo4", "q4_0-norot", 64, 2, (20, 5), 16, None, "bfloat16")]     # ... and the attention kernel


def _step_gate(step) -> torch.Tensor:
    """Gated attention's gate for a STEPS case: (B, H, D) in q's dtype, each head's second half of
    a (B, H, 2D) projection (rows and heads strided), values up to about +-6."""
    _, _, dim, group, lengths, _, _, dtype = step
    n_heads = 2 * group                                                   # _case's 2 KV heads
    wide = torch.randn(len(lengths), n_heads, 2 * dim, generator=torch.Generator().manual_seed(11)) * 2
    return wide.to(getattr(torch, dtype))[..., dim:]


def _step_args(step):
    """``step_output``'s arguments for a STEPS case: _case's pools; its table's rows moved to
    shuffled slots of a wider table with 2 spare columns, the first P columns handed over (rows
    strided); positions each sequence's last key; q (B, H, D) in the model domain, its rows
    strided (a slice of a wider projection output), in the case's dtype; a scale that is not
    head_dim ** -0.5."""
    name_k, name_v, dim, group, lengths, page_size, split_keys, dtype = step
    fmt_k, fmt_v, _, k_pool, v_pool, table, n_keys = _case(name_k, name_v, dim, group, list(lengths),
                                                            page_size=page_size)
    gen = torch.Generator().manual_seed(7)
    n_seq, n_pages = table.shape
    slots = torch.randperm(n_seq + 2, generator=gen)[:n_seq]
    wide = torch.zeros(n_seq + 2, n_pages + 2, dtype=torch.int32)
    wide[slots, :n_pages] = table
    n_heads = k_pool.shape[0] * group
    rows = torch.randn(n_seq, n_heads * dim + 5, generator=gen).to(getattr(torch, dtype))
    q = rows[:, 3:3 + n_heads * dim].view(n_seq, n_heads, dim)
    split = {} if split_keys is None else {"split_keys": split_keys}
    return fmt_k, fmt_v, q, 0.7 * dim ** -0.5, k_pool, v_pool, wide[:, :n_pages], slots, n_keys - 1, split


MERGES = [(70, 96), (2, 256)]      # (splits, head_dim): more splits than two of the merge's steps, 2 column tiles


def _split_states(n_splits: int, dim: int, seed: int = 3):
    """Splits' states m, l (2, 3, n, 5) and acc (..., dim): every third split of sequence 0 empty
    (m = -inf, l = 0, acc = 0), and sequence 2's row 1 without a key in any split."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(2, 3, n_splits, 5, generator=gen) * 4
    l = torch.rand(2, 3, n_splits, 5, generator=gen) * 30 + 1
    acc = torch.randn(2, 3, n_splits, 5, dim, generator=gen) * 10
    for empty in ((slice(None), 0, slice(0, None, 3)), (slice(None), 2, slice(None), 1)):
        m[empty], l[empty], acc[empty] = float("-inf"), 0.0, 0.0
    return m, l, acc


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case's kernel state, computed once by one interpreted child process."""
    cases = CASES + [LONG, ODD_PAGES, BATCH, ODD_DIM]
    out = run_interpreted("tests.test_triton_attention", "_states_in_child", cases, tmp_path_factory.mktemp("triton"))
    out["kernels"] = dict(zip(cases, out["kernels"]))
    return out


def _check(got, want, n_keys):
    check_state(got, want, n_keys > 0)


def _against_reference(interpreted, case):
    served, got = interpreted["kernels"][case]
    assert served
    args = _case(*case[:4], list(case[4]), page_size=case[5])
    _check(got, _torch_state(*args), args[-1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}")
def test_kernel_state_matches_torch_block_loop(interpreted, case):
    """Splits of 64 keys: the 100-key sequence spans two splits, the others one or none."""
    _against_reference(interpreted, case)


def test_default_splits_cut_a_long_sequence(interpreted):
    """A sequence longer than SPLIT_KEYS is cut into programs whose states merge."""
    assert max(LONG[4]) > 2 * gpu.SPLIT_KEYS
    _against_reference(interpreted, LONG)


def test_a_page_size_that_is_not_a_power_of_two(interpreted):
    """Keys find their page by t // page_size, whatever the page size."""
    _against_reference(interpreted, ODD_PAGES)


def test_a_head_dim_that_is_not_a_power_of_two(interpreted):
    """Codes read one by one (no units) and K's table read by the tree of selects."""
    fmt_k, fmt_v = formats.get(ODD_DIM[0], role="k"), formats.get(ODD_DIM[1], role="v")
    config = paged_prefill._launch_config(fmt_k, fmt_v, ODD_DIM[3], ODD_DIM[2])
    assert (config["K_LOOKUP"], config["V_LOOKUP"], config["K_PHASES"]) == (paged_prefill.TREE, paged_prefill.GATHER, 1)
    _against_reference(interpreted, ODD_DIM)


def test_launch_overrides_keep_the_state(interpreted):
    """Other keys per block, warps, stages or dot precision: the same state as the reference."""
    args = _case(*ODD_PAGES[:4], list(ODD_PAGES[4]), page_size=ODD_PAGES[5])
    want = _torch_state(*args)
    for tune, got in zip(TUNED, interpreted["tuned"]):
        if tune.get("DOT") != "f16":
            _check(got, want, args[-1])
            continue
        _check_f16_products(got, want, args[-1])                     # operands rounded to f16 (11 bits)
    with pytest.raises(ValueError, match="not a launch setting: BLOCK_M"):
        paged_prefill._launch_config(formats.get("f16"), formats.get("f16"), 8, 64, {"BLOCK_M": 64})
    with pytest.raises(ValueError, match="DOT='bf16': expected one of ieee"):
        paged_prefill._launch_config(formats.get("f16"), formats.get("f16"), 8, 64, {"DOT": "bf16"})
    assert paged_prefill._launch_config(formats.get("f16"), formats.get("f16"), 8, 64, {"DOT": "fma"})["BLOCK_M"] == 8
    from kvslim.cache.kv import DEFAULT_PAGE_SIZE          # the offline compiles' page size is the cache's default
    assert paged_prefill._launch_config(formats.get("f16"), formats.get("f16"), 8, 64)["PAGE_SIZE"] == DEFAULT_PAGE_SIZE
    with pytest.raises(ValueError, match="PREFETCH=3: expected 0"):
        paged_prefill._launch_config(formats.get("f16"), formats.get("f16"), 8, 64, {"PREFETCH": 3})
    with pytest.raises(ValueError, match="CODECS='bytes': expected one of units, per-value"):
        paged_prefill._launch_config(formats.get("f16"), formats.get("f16"), 8, 64, {"CODECS": "bytes"})


@pytest.mark.parametrize("case,tune", PREFETCHED, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}" if isinstance(c, tuple) else "")
def test_codes_loaded_a_block_ahead_give_the_same_bits(interpreted, case, tune):
    """PREFETCH 2 changes when a block's bytes are loaded, not what is summed: the state equals
    the same launch's without it, bit for bit, and the reference within the products' bound."""
    ahead, plain = interpreted["prefetched"][[c for c, _ in PREFETCHED].index(case)]
    for got, want in zip(ahead, plain):
        assert torch.equal(got, want)
    args = _case(*case[:4], list(case[4]), page_size=case[5])
    if tune.get("DOT") == "f16":
        _check_f16_products(ahead, _torch_state(*args), args[-1])
    else:
        _check(ahead, _torch_state(*args), args[-1])


@pytest.mark.parametrize("case,tune", WARPS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}" if isinstance(c, tuple) else str(c))
def test_decode_by_warps_matches_torch_block_loop(interpreted, case, tune):
    """KERNEL "warps" (each warp its own keys and softmax, merged once a program) leaves the
    state the tile kernel leaves, against the torch block loop within the same bounds."""
    args = _case(*case[:4], list(case[4]), page_size=case[5])
    _check(interpreted["warps"][WARPS.index((case, tune))], _torch_state(*args), args[-1])


def test_rows_a_step_ahead_give_the_same_bits(interpreted):
    """PREFETCH 1 (the warps kernel's default) moves when a step's rows are loaded, not what is
    summed: the same state as the launch that loads them at use, bit for bit."""
    ahead, at_use = interpreted["warps"][1], interpreted["warps"][2]
    assert WARPS[2][1] == {"PREFETCH": 0} and WARPS[1][1] == {}
    for got, want in zip(ahead, at_use):
        assert torch.equal(got, want)


def test_one_warps_sums_are_rescaled_when_its_max_grows(interpreted):
    """Steep scores: the one-warp launch (sums rescaled only past RESCALE_AT), the same launch
    rescaling at its first step only (terms up to e^40 or so, still finite), and the four-warp one
    (every step) all match the reference; the first two differ in their bits, so the rescale
    past the first step was taken."""
    args = list(_case(*STEEP[:4], list(STEEP[4]), page_size=STEEP[5]))
    args[2] = args[2] * 12
    lazy, first_only, eager = interpreted["steep"]
    for got in (lazy, first_only, eager):
        _check(got, _torch_state(*args), args[-1])
    assert not torch.equal(lazy[2], first_only[2])


@pytest.mark.parametrize("step", WARP_STEPS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}")
def test_a_decode_step_by_warps_matches_the_ops_torch_form(interpreted, step):
    """``step_output`` by warps: its output (stored by the kernel, or merged from two splits) as
    the op's torch form gives it, and gated, sigmoid_mul's bits."""
    plain, gated, want_gated = interpreted["warp_steps"][WARP_STEPS.index(step)]
    fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions, _ = _step_args(step)
    want = torch.ops.kvslim.paged_decode(q, k_pool, v_pool, table, slots, positions, scale, step[0], step[1])
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(gated, want_gated)


def test_the_switch_decodes_steps_by_warps(interpreted):
    """paged_decode.DECODE_BY_WARPS (KVSLIM_DECODE_WARPS=1): a step whose formats the warps
    kernel reads is launched on it (``step_launch``) whatever the backend's products, bit for
    bit its launch's."""
    assert torch.equal(interpreted["by_switch"], interpreted["warp_steps"][0][0])


@pytest.mark.parametrize("tune,message", [
    ({"KERNEL": "warps", "BLOCK_N": 32}, "not a setting of KERNEL='warps': BLOCK_N"),
    ({"KERNEL": "lanes"}, "KERNEL='lanes': expected one of tiles, warps, mma"),
    ({"KP": 2}, "KP is a setting of KERNEL='warps'"),
    ({"KERNEL": "warps", "PREFETCH": 2}, "PREFETCH=2 with KERNEL='warps': expected 0")])
def test_warps_settings_are_checked(tune, message):
    with pytest.raises(ValueError, match=message):
        paged_prefill._launch_config(formats.get("turbo4"), formats.get("turbo4"), 8, 256, tune)


def test_warps_decodes_only():
    """A prompt's rows (q_pos given) are the tile kernel's: KERNEL "warps" says so before any launch."""
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case("turbo4", "turbo4", 256, 8, [20], page_size=16)
    q_pos = torch.arange(8, dtype=torch.int32)[None]
    with pytest.raises(ValueError, match="KERNEL='warps' decodes"):
        paged_prefill.prefill_state(fmt_k, fmt_v, q, q_pos, k_pool, v_pool, table, n_keys, tune={"KERNEL": "warps"})


@pytest.mark.parametrize("name_k,name_v,dim,rows,why", [
    ("turbo3", "turbo4", 128, 8, "does not read turbo3 rows at head_dim 128"),
    ("turbo4", "turbo2", 128, 8, "does not read turbo2 rows at head_dim 128"),
    ("turbo4p", "turbo4", 256, 8, "does not read turbo4p rows at head_dim 256"),
    ("f16", "f16", 256, 16, "at most 8 query rows a KV head, not 16")])
def test_warps_refuses_what_it_cannot_read(name_k, name_v, dim, rows, why):
    """Rows that fill fewer than 32 lanes (turbo3 and turbo2 at head_dim 128: 16), layouts the
    kernels do not decode (turbo4p's QJL sketch) and more than 8 query rows are refused by name,
    not decoded wrong."""
    with pytest.raises(ValueError, match=why):
        paged_prefill._launch_config(formats.get(name_k), formats.get(name_v), rows, dim, {"KERNEL": "warps"})


def _check_f16_products(got, want, n_keys) -> None:
    """A state whose products took f16 operands against the float32 reference: ~1e-3, not 1e-5,
    and rounded (not the float32 path)."""
    m, l, acc = got
    live = n_keys > 0
    assert torch.allclose(m[:, live], want.m[:, live], atol=1e-2, rtol=1e-2)
    assert torch.allclose(acc[:, live] / l[:, live], want.result()[:, live], atol=1e-2, rtol=1e-2)
    assert not torch.equal(m[:, live], want.m[:, live])


@pytest.mark.parametrize("case", F16_TABLES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}")
def test_f16_products_on_code_tables(interpreted, case):
    """turbo4, turbo3, turbo2, iq4_nl, q4_0, q8_0 and f16, K and V, with f16 operands (the bf16
    backend's decode): codes and scales read in f16, against the float32 reference within f16's
    rounding."""
    args = _case(*case[:4], list(case[4]), page_size=case[5])
    _check_f16_products(interpreted["f16_tables"][F16_TABLES.index(case)], _torch_state(*args), args[-1])


@pytest.mark.parametrize("name,lookups,phases", [
    ("q4_0", ("AFFINE", "AFFINE"), 4), ("q4_1", ("AFFINE", "AFFINE"), 4), ("iq4_nl", ("TABLE", "TABLE"), 4),
    ("turbo4", ("TABLE", "TABLE"), 4), ("turbo2", ("TABLE", "TABLE"), 8), ("turbo3", ("TABLE", "TABLE"), 16),
    ("q8_0", ("GATHER", "GATHER"), 1), ("q5_0", ("AFFINE", "AFFINE"), 1)])
def test_each_format_reads_its_codes_the_cheapest_exact_way(name, lookups, phases):
    """Codes that fill their block's bytes are read in 2-byte units (turbo3's 16 codes from 3
    units; q5_0's fifth bits sit apart, q8_0's codes are bytes); tables with integer steps by
    arithmetic, the others of such codes from the table held in registers. The values these reads give are checked against the reference by
    every parity case; this pins the choice, so that a table or layout change shows up here."""
    config = paged_prefill._launch_config(formats.get(name, role="k"), formats.get(name, role="v"), 8, 256)
    want = tuple(getattr(paged_prefill, mode) for mode in lookups)
    assert (config["K_LOOKUP"], config["V_LOOKUP"]) == want
    assert config["K_PHASES"] == config["V_PHASES"] == phases
    per_value = paged_prefill._launch_config(formats.get(name, role="k"), formats.get(name, role="v"), 8, 256,
                                             {"CODECS": "per-value"})
    assert (per_value["K_LOOKUP"], per_value["V_LOOKUP"], per_value["K_PHASES"]) == (
        paged_prefill.SELECT, paged_prefill.GATHER, 1)
    if paged_prefill._fields(formats.get(name, role="k"), 96) is not None:   # whole blocks, head_dim not a power of 2
        assert paged_prefill._launch_config(formats.get(name, role="k"), formats.get(name, role="v"), 8, 96)["K_PHASES"] == 1


def test_a_sequence_gets_the_same_bits_whatever_its_batch(interpreted):
    """Splits are cut at fixed key counts, so one sequence's state does not depend on the others."""
    _against_reference(interpreted, BATCH)
    for a, b in zip(interpreted["alone"], interpreted["kernels"][BATCH][1]):
        assert torch.equal(a[:, 0], b[:, 0])


def test_formats_without_a_decoder_are_refused(interpreted):
    assert interpreted["supports"] == [False] * len(REFUSED) + [True, False]      # 65 rows: more than MAX_ROWS


def test_cpu_tensors_without_the_interpreter_are_refused():
    """This process's triton is not interpreted (it was imported before any test could ask)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the whole run is interpreted")
    assert not gpu.supports(formats.get("f16"), formats.get("f16"), torch.zeros(2, 1, 2, 128))


@pytest.mark.parametrize("shape", MERGES, ids=lambda s: f"splits{s[0]}-d{s[1]}")
def test_the_merge_kernel_matches_the_torch_merge(interpreted, shape):
    """``merged`` (one launch) against ``merge_splits``: float32 sums over the splits in another
    order; an all-empty row keeps -inf, 0, 0."""
    want = paged_prefill.merge_splits(*_split_states(*shape))
    tiles = [interpreted["merged"][MERGES.index(shape)]]
    if shape == MERGES[0]:                          # the GPU's tile too (the interpreter's is whole rows)
        tiles.append(interpreted["merged_gpu_tile"])
    for got in tiles:
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert got[0][:, 2, 1].isneginf().all() and (got[1][:, 2, 1] == 0).all() and (got[2][:, 2, 1] == 0).all()


@pytest.mark.parametrize("step", STEPS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}-{c[7]}")
def test_a_decode_step_from_its_operands_matches_the_ops_torch_form(interpreted, step):
    """``step_output`` (q scaled and regrouped as read, the table's rows found by slot, the
    positions offset by one, acc / l stored in (B, H, D) by the attention or the merge kernel)
    against the paged_decode op's torch form, here with the kernels off."""
    served, got = interpreted["steps"][STEPS.index(step)]
    fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions, _ = _step_args(step)
    assert served and not kvslim.gpu.TRITON
    want = torch.ops.kvslim.paged_decode(q, k_pool, v_pool, table, slots, positions, scale, step[0], step[1])
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step", STEPS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}-{c[7]}")
def test_a_gated_decode_step_stores_sigmoid_muls_bits(interpreted, step):
    """With gated attention's gate, ``step_output`` stores the output times sigmoid(gate) in the
    gate's type from the launch that stores it (the attention kernel, the merge, or V's rotation
    back): the bits of ``sigmoid_mul``'s launch on the ungated output; and the op's torch form
    (the kernels off here) within its own three roundings."""
    got, apart = interpreted["gated"][STEPS.index(step)]
    gate = _step_gate(step)
    assert got.dtype == apart.dtype == gate.dtype and torch.equal(got, apart)
    fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions, _ = _step_args(step)
    want = torch.ops.kvslim.paged_decode(q, k_pool, v_pool, table, slots, positions, scale, step[0], step[1], "f32",
                                         gate)
    ulp = 2 * torch.finfo(gate.dtype).eps if gate.dtype != torch.float32 else 1e-5
    assert want.dtype == gate.dtype and ((got.double() - want.double()).abs() <= ulp * want.double().abs() + 1e-5).all()


def test_merge_of_splits_matches_one_pass():
    """The merge alone: two halves of a block folded separately equal the block folded at once."""
    gen = torch.Generator().manual_seed(1)
    scores, v = torch.randn(2, 3, 4, 40, generator=gen), torch.randn(2, 3, 40, 8, generator=gen)
    scores[:, 1, :, 20:] = float("-inf")                                         # sequence 1: second half empty
    parts = []
    for half in (slice(0, 20), slice(20, 40)):
        m = scores[..., half].amax(-1)
        safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(scores[..., half] - safe.unsqueeze(-1))
        parts.append((m, p.sum(-1), p @ v[:, :, half]))
    m, l, acc = paged_prefill.merge_splits(*(torch.stack(x, 2) for x in zip(*parts)))
    assert torch.allclose(acc / l, torch.softmax(scores, -1) @ v, atol=1e-6)
    assert torch.equal(m, scores.amax(-1, keepdim=True))


CUDA_CASES = CASES + [LONG, ODD_PAGES]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}-p{c[5]}")
def test_compiled_kernel_on_cuda_matches_torch_block_loop(case):
    """The same cases, compiled for the GPU in this process; the reference stays on the CPU."""
    compiled_process()
    fmt_k, fmt_v, *tensors = _case(*case[:4], list(case[4]), page_size=case[5])
    on_gpu = [t.cuda() for t in tensors]
    assert gpu.supports(fmt_k, fmt_v, on_gpu[0])
    split = {} if case[6] is None else {"split_keys": case[6]}
    got = [x.cpu() for x in gpu.decode_state(fmt_k, fmt_v, *on_gpu, **split)]
    _check(got, _torch_state(fmt_k, fmt_v, *tensors), tensors[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case,tune", PREFETCHED, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}" if isinstance(c, tuple) else "")
def test_codes_a_block_ahead_on_cuda_give_the_same_bits(case, tune):
    """PREFETCH 2 compiled: the same state as the launch without it, bit for bit (the sums'
    terms and order are the same; only when the bytes are loaded moves)."""
    compiled_process()
    fmt_k, fmt_v, *tensors = _case(*case[:4], list(case[4]), page_size=case[5])
    on_gpu = [t.cuda() for t in tensors]
    split = case[6] or paged_prefill.SPLIT_KEYS
    ahead = gpu.decode_state(fmt_k, fmt_v, *on_gpu, split_keys=split, tune={**tune, "PREFETCH": 2})
    plain = gpu.decode_state(fmt_k, fmt_v, *on_gpu, split_keys=split, tune=tune)
    for got, want in zip(ahead, plain):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case,tune", WARPS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}" if isinstance(c, tuple) else str(c))
def test_decode_by_warps_on_cuda_matches_torch_block_loop(case, tune):
    """KERNEL "warps" compiled, against the torch block loop on the CPU."""
    compiled_process()
    fmt_k, fmt_v, *tensors = _case(*case[:4], list(case[4]), page_size=case[5])
    on_gpu = [t.cuda() for t in tensors]
    got = gpu.decode_state(fmt_k, fmt_v, *on_gpu, split_keys=case[6] or paged_prefill.SPLIT_KEYS,
                           tune={"KERNEL": "warps", **tune})
    _check([x.cpu() for x in got], _torch_state(fmt_k, fmt_v, *tensors), tensors[-1])


# issue 18's parity matrix: every K and V of these formats, each head_dim, each GQA group, on the GPU
MATRIX_FORMATS = ("f16", "q8_0", "q4_0", "iq4_nl", "turbo4", "turbo3", "turbo2")
MATRIX = [(k, v, dim) for k in MATRIX_FORMATS for v in MATRIX_FORMATS for dim in (64, 128, 256)]
MATRIX_GROUPS = (1, 4, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("name_k,name_v,dim", MATRIX, ids=lambda c: str(c))
def test_every_pair_head_dim_and_group_decodes_on_cuda(name_k, name_v, dim):
    """Decode's kernel compiled, at GQA 1, 4 and 8, against the torch block loop on the CPU: float32
    products to the kernel tests' tolerance, f16 products (the bf16 backend's) to f16's."""
    compiled_process()
    for group in MATRIX_GROUPS:
        fmt_k, fmt_v, *tensors = _case(name_k, name_v, dim, group, list(LENGTHS), page_size=16)
        on_gpu = [t.cuda() for t in tensors]
        want = _torch_state(fmt_k, fmt_v, *tensors)
        _check([x.cpu() for x in gpu.decode_state(fmt_k, fmt_v, *on_gpu, split_keys=64)], want, tensors[-1])
        half = [x.cpu() for x in gpu.decode_state(fmt_k, fmt_v, *on_gpu, split_keys=64, tune={"DOT": "f16"})]
        _check_f16_products(half, want, tensors[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("step", STEPS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}-{c[7]}")
def test_a_decode_step_on_cuda_matches_the_ops_torch_form(step):
    """``step_output`` compiled, against the op's torch form on the CPU."""
    compiled_process()
    fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions, split = _step_args(step)
    on_gpu = [t.cuda() for t in (q, k_pool, v_pool, table, slots, positions)]
    assert gpu.serves_step(fmt_k, fmt_v, on_gpu[0], k_pool.shape[0])
    got = gpu.step_output(fmt_k, fmt_v, on_gpu[0], scale, *on_gpu[1:], **split)
    want = torch.ops.kvslim.paged_decode(q, k_pool, v_pool, table, slots, positions, scale, step[0], step[1])
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    from kvslim.gpu import swiglu                                        # gated: sigmoid_mul's bits, one launch fewer
    gate = _step_gate(step).cuda()
    gated = gpu.step_output(fmt_k, fmt_v, on_gpu[0], scale, *on_gpu[1:], **split, gate=gate)
    assert torch.equal(gated, swiglu.sigmoid_mul(gate, got, gate.dtype))


SM90 = [("q8_0", "turbo4", 256, 8), ("iq4_nl", "turbo3", 128, 4), ("f16", "bf16", 64, 1), ("nl4s", "q5_1", 128, 4)]


@pytest.mark.parametrize("name_k,name_v,dim,group", SM90)
def test_kernel_compiles_for_an_h100_without_one(name_k, name_v, dim, group):
    """What the interpreter cannot say: the kernel lowers through Triton's compiler and ptxas
    for sm_90 with decode's constexprs (a few rows, one tile) and warps (no GPU needed)."""
    from kvslim.gpu import _paged_prefill_kernel as kernel

    from .test_triton_prefill import POINTERS
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    config = paged_prefill._launch_config(fmt_k, fmt_v, group, dim)
    num_warps = config.pop("num_warps")
    divisible = paged_prefill.aligned_args(fmt_k, fmt_v, dim)
    assert compile_for_sm90(kernel.paged_prefill_tile, POINTERS, config, num_warps, divisible).asm["cubin"]


@pytest.mark.parametrize("name_k,name_v", [("turbo4", "turbo4"), ("turbo3", "turbo3"), ("f16", "f16")])
def test_codes_a_block_ahead_compile_without_spills(name_k, name_v):
    """PREFETCH 2 at decode's launch with f16 products (8 rows, head_dim 256, 16 keys, 8 warps):
    the next block's codes held in registers beside this block's tile, without spills and at
    most 32 registers over the same launch without it under the device image's Triton 3.6, where
    two programs of 8 warps still fit an SM (128 registers): session 43, turbo4 +15, turbo3 +19,
    f16 +10; session 45's adjacent columns, turbo4 116 -> 128, turbo3 107 -> 128. Under 3.9 (this
    machine's), 48: the adjacent columns took turbo4's launch without the prefetch from 166
    registers to 121, with it from 186 to 164 (turbo3 146 -> 107, 160 -> 128)."""
    import triton

    from kvslim.gpu import _paged_prefill_kernel as kernel

    from .test_triton_prefill import POINTERS
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    usage = {}
    for prefetch in (0, 2):
        config = paged_prefill._launch_config(fmt_k, fmt_v, 8, 256, {"DOT": "f16", "PREFETCH": prefetch})
        num_warps = config.pop("num_warps")
        usage[prefetch] = resource_usage(compile_for_sm90(kernel.paged_prefill_tile, POINTERS, config, num_warps,
                                                          paged_prefill.aligned_args(fmt_k, fmt_v, 256)))
    device = triton.__version__.startswith("3.6.")
    assert usage[2]["STACK"] == 0 and usage[2]["REG"] <= usage[0]["REG"] + (32 if device else 48), usage
    if device:
        assert usage[2]["REG"] <= 128, usage


@pytest.mark.parametrize("name_k,name_v,dim,group", SM90[:3])
@pytest.mark.parametrize("store", ["splits", "one-split", "gated"])
def test_a_decode_steps_launch_compiles_for_an_h100_without_one(name_k, name_v, dim, group, store):
    """``step_output``'s launch: bf16 q read in place, the table's rows by slot, every row at its
    last key, and with one split the output stored by the kernel itself (gated: times sigmoid of
    a bf16 gate, stored as bf16)."""
    from kvslim.gpu import _paged_prefill_kernel as kernel

    from .test_triton_prefill import POINTERS
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    config = dict(paged_prefill._launch_config(fmt_k, fmt_v, group, dim), AT_END=True, BY_SLOT=True,
                  NORMALISE=store != "splits", GATED=store == "gated")
    num_warps = config.pop("num_warps")
    divisible = paged_prefill.aligned_args(fmt_k, fmt_v, dim)
    pointers = dict(POINTERS, q_ptr="*bf16", **({"acc_out": "*bf16"} if store == "gated" else {}))
    compiled = compile_for_sm90(kernel.paged_prefill_tile, pointers, config, num_warps, divisible)
    assert compiled.asm["cubin"] and (".local" not in compiled.asm["ptx"] or store == "splits")


@pytest.mark.parametrize("store", ["state", "output", "gated"])
def test_the_merge_compiles_for_an_h100_without_one(store):
    from kvslim.gpu import _paged_prefill_kernel as kernel
    pointers = {name: "*fp32" for name in ("m_ptr", "l_ptr", "acc_ptr", "m_out", "l_out", "acc_out")}
    pointers.update({"acc_out": "*bf16", "gate_ptr": "*bf16"} if store == "gated" else {})
    constexprs = {"HEAD_DIM": 256, **paged_prefill.MERGE_TILE, "NORMALISE": store != "state", "GATED": store == "gated"}
    compiled = compile_for_sm90(kernel.merge_splits, pointers, constexprs, 4)
    assert compiled.asm["cubin"] and spilled_bytes(compiled) == 0
    # both passes' blocks fetched ahead by cp.async (LDGSTS): a plain loop, which Triton pipelines
    # only when asked, waited on memory at every block (8 a pass at 128K keys' 256 splits)
    from kvslim.gpu import cuobjdump, loop_ops
    sass = cuobjdump(compiled, "-sass")
    assert any(op.startswith("LDGSTS") for op in loop_ops(sass))


@pytest.mark.parametrize("name_k,name_v,dim,rows", [("turbo4", "turbo4", 256, 8), ("q8_0", "q4_0", 128, 4),
                                                    ("f16", "iq4_nl", 256, 6), ("turbo3", "turbo3", 256, 8)])
@pytest.mark.parametrize("warps", [1, 2])
def test_decode_by_warps_steps_without_barriers(name_k, name_v, dim, rows, warps):
    """What the warps kernel is for, in its sm_90 SASS (decode's launch: bf16 q read in place,
    the table by slot): its loop over keys holds no barrier and no shared-memory access (the
    warps share nothing until the program's end) and nothing spills. Triton orders a load's
    axes by contiguity differently in 3.6 and 3.9; checked under both (docs/gpu.md)."""
    from kvslim.gpu import _decode_warps_kernel, cuobjdump, loop_ops

    from .test_triton_prefill import POINTERS
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    config = dict(paged_prefill._launch_config(fmt_k, fmt_v, rows, dim, {"KERNEL": "warps", "num_warps": warps}),
                  BY_SLOT=True)
    config.pop("KERNEL")
    num_warps = config.pop("num_warps")
    compiled = compile_for_sm90(_decode_warps_kernel.paged_decode_warps, dict(POINTERS, q_ptr="*bf16"), config,
                                num_warps, paged_prefill.aligned_args(fmt_k, fmt_v, dim))
    step = loop_ops(cuobjdump(compiled, "-sass"))
    assert step and not [op for op in step if op.startswith(("BAR", "LDS", "STS"))], sorted(set(step))
    assert resource_usage(compiled)["STACK"] == 0


def test_the_tie_probe_reads_how_this_triton_coalesces():
    """The warps kernel's loads are shaped by how Triton's coalescing orders equally contiguous
    axes, read from a probe's compiled layout: first axis first under Triton 3.6 (the lent GPUs'),
    last first under 3.9 (CI's), as their SASS showed (docs/gpu.md)."""
    compiled_process()
    import triton
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kvslim.gpu import _decode_warps_kernel
    found = _decode_warps_kernel.first_axis_first()
    version = tuple(int(n) for n in triton.__version__.split(".")[:2])
    if version not in ((3, 6), (3, 9)):
        pytest.skip(f"Triton {triton.__version__}: its order is read, not known here ({found})")
    assert found == (version == (3, 6))
    assert paged_prefill._ties_up() == found


@pytest.mark.parametrize("dim", [128, 256])
def test_f16_rows_load_16_bytes_at_a_time(dim):
    """f16 K/V rows are read by 16-byte loads (or 16-byte async copies into shared memory), as
    SDPA's kernels read them, not one 2-byte load per value: the sm_90 PTX of decode's launch,
    with the alignment a launch knows (pools 16-byte aligned, row sizes multiples of 16). Before
    session 31 the f16 pointer was typed after the value's offset was added, so no load
    vectorised (32 two-byte loads a thread per block of 16 keys at head_dim 256)."""
    from kvslim.gpu import _paged_prefill_kernel as kernel

    from .test_triton_prefill import POINTERS
    f16 = formats.get("f16", role="k")
    config = paged_prefill._launch_config(f16, f16, 8, dim)
    num_warps = config.pop("num_warps")
    divisible = paged_prefill.aligned_args(f16, f16, dim)
    ptx = compile_for_sm90(kernel.paged_prefill_tile, POINTERS, config, num_warps, divisible).asm["ptx"]
    wide = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32|cp\.async\.\w+\.shared\.global[^;]*, 16;", ptx))
    narrow = len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx))
    assert wide > 0 and narrow == 0, (wide, narrow)
