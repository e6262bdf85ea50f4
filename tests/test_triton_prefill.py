"""The Triton prefill-attention kernel against the torch block loop (its reference), on the CPU.

As tests/test_triton_attention.py: the kernel runs under Triton's interpreter in one child
process (tests/triton_harness.py), the reference ``attention._scan_pages`` here, on pools from
each format's own encoder with shuffled pages and sequences of different lengths (a partial
last page, one empty). Each sequence has a chunk of T query positions per query head, rows
g*T + t as ``attention._group`` lays them out, at its own depth: a chunk ending at the packed
end, one reaching past it (rows in the f16 window), one starting before the first key (rows
that see nothing beside rows that do), and the empty sequence's rows that see nothing.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvslim import formats
from kvslim.cache import attention
from kvslim.gpu import available
from kvslim.gpu import paged_prefill as gpu

from .test_native_attention import _case
from .test_triton_attention import MATRIX, MATRIX_GROUPS, PAIRS, SHAPES
from .triton_harness import check_state, compile_for_sm90, compiled_process, run_interpreted

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed: no GPU kernel to check")

LENGTHS = (37, 100, 16, 0)
FIRSTS = (33, 99, -2, 0)                               # each sequence's first query position, at T = 4
# (K, V, head_dim, group, lengths, firsts, T, page_size, split_keys): split_keys None is the default
CASES = [(k, v, dim, group, LENGTHS, FIRSTS, 4, 16, 64) for i, (k, v) in enumerate(PAIRS)
         for dim, group in (SHAPES[i % 3], SHAPES[(i + 1) % 3])]
MANY_ROWS = ("q8_0", "turbo4", 64, 4, (150, 37), (126, 20), 24, 16, None)     # 96 rows: three tiles, one split
TILES_AND_SPLITS = ("turbo4", "f16", 256, 8, (40,), (34,), 6, 16, 16)         # 48 rows: 3 tiles x 3 splits
LONG = ("f16", "q4_0", 64, 2, (1100, 5), (1096, 2), 4, 32, None)              # few rows, default splits
ODD_PAGES = ("iq4_nl", "q4_0", 64, 3, (50, 7), (42, 0), 8, 12, 32)           # a page size not a power of two
EXTRA = [MANY_ROWS, TILES_AND_SPLITS, LONG, ODD_PAGES]
REFUSED = [("turbo4p", "f16")]   # a QJL sketch
# the bf16 backend's prompts: f16 products, codes and scales read in f16 (turbo's and iq4_nl's
# tables, q8_0's bytes, q4_0's steps, f16 rows), many rows in causal tiles
F16_PRODUCTS = [("q8_0", "turbo4", 128, 4, (150, 37), (126, 20), 24, 16, None),
                ("turbo3", "f16", 256, 2, (40,), (34,), 6, 16, 16), ("f16", "q4_0", 64, 2, (70,), (60,), 10, 16, None)]


def _prefill_case(name_k, name_v, dim, group, lengths, firsts, chunk, page_size):
    """-> fmt_k, fmt_v, q (2, S, group * chunk, dim), q_pos (S, group * chunk), pools, table, lengths."""
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case(name_k, name_v, dim, group * chunk, list(lengths),
                                                           page_size=page_size)
    q_pos = (torch.tensor(firsts)[:, None] + torch.arange(chunk)).repeat(1, group)   # row g*T + t
    return fmt_k, fmt_v, q, q_pos, k_pool, v_pool, table, n_keys


def _args(case):
    return _prefill_case(*case[:8])


def _split(case) -> dict:
    return {} if case[8] is None else {"split_keys": case[8]}


def _torch_state(fmt_k, fmt_v, q, q_pos, k_pool, v_pool, table, lengths):
    acc = attention._OnlineSoftmax(*q.shape, q.device)
    attention._scan_pages(fmt_k, fmt_v, k_pool, v_pool, table, q, q_pos, lengths, acc, 3, q.shape[-1])
    return acc


def _states_in_child(cases, path: Path) -> None:
    """Run in a child whose TRITON_INTERPRET=1 came before triton's import."""
    out = {"kernels": [], "alone": None, "supports": []}
    for case in cases:
        args = _args(case)
        out["kernels"].append((gpu.supports(*args[:3]), gpu.prefill_state(*args, **_split(case))))
    fmt_k, fmt_v, q, q_pos, k_pool, v_pool, table, lengths = _args(LONG)
    out["alone"] = gpu.prefill_state(fmt_k, fmt_v, q[:, :1].contiguous(), q_pos[:1], k_pool, v_pool,
                                     table[:1], lengths[:1])
    q = torch.zeros(2, 1, 300, 128)
    out["supports"] = [gpu.supports(formats.get(k), formats.get(v), q) for k, v in REFUSED + [("f16", "f16")]]
    out["f16"] = [gpu.prefill_state(*_args(case), **_split(case), tune={"DOT": "f16"}) for case in F16_PRODUCTS]
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case's kernel state, computed once by one interpreted child process."""
    cases = CASES + EXTRA
    out = run_interpreted("tests.test_triton_prefill", "_states_in_child", cases, tmp_path_factory.mktemp("triton"))
    out["kernels"] = dict(zip(cases, out["kernels"]))
    return out


def _check(got, want, q_pos, lengths):
    """Rows that see a key (their limit and their sequence's length) match; the rest are empty."""
    check_state(got, want, torch.minimum(q_pos + 1, lengths[:, None]) > 0)


def _against_reference(interpreted, case):
    served, got = interpreted["kernels"][case]
    assert served
    args = _args(case)
    _check(got, _torch_state(*args), args[3], args[-1])


@pytest.mark.parametrize("case", F16_PRODUCTS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}")
def test_f16_products_stay_within_f16_rounding(interpreted, case):
    """Prompt rows with f16 operands against the float32 reference: within ~1e-3, and rounded."""
    args = _args(case)
    m, l, acc = interpreted["f16"][F16_PRODUCTS.index(case)]
    want = _torch_state(*args)
    live = torch.minimum(args[3] + 1, args[-1][:, None]) > 0                # rows that see a key
    assert torch.allclose(m[:, live], want.m[:, live], atol=1e-2, rtol=1e-2)
    assert torch.allclose(acc[:, live] / l[:, live], want.result()[:, live], atol=1e-2, rtol=1e-2)
    assert not torch.equal(m[:, live], want.m[:, live])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}")
def test_kernel_state_matches_torch_block_loop(interpreted, case):
    """Splits of 64 keys: the 100-key sequence spans two, and some rows' limits fall in the first."""
    _against_reference(interpreted, case)


def test_more_rows_than_a_tile(interpreted):
    """96 rows at head_dim 64 are three tiles of 32, not split over keys (more than SPLIT_ROWS)."""
    assert gpu._launch_config(*(formats.get(n) for n in MANY_ROWS[:2]), 96, 64)["BLOCK_M"] < 96
    _against_reference(interpreted, MANY_ROWS)


def test_tiles_and_splits_together(interpreted):
    """48 rows at head_dim 256: three tiles of 16, each cut into three splits of 16 keys."""
    _against_reference(interpreted, TILES_AND_SPLITS)


def test_default_splits_cut_a_long_history(interpreted):
    """Few rows over more than 2 * SPLIT_KEYS keys: programs whose states merge."""
    assert LONG[4][0] > 2 * gpu.SPLIT_KEYS
    _against_reference(interpreted, LONG)


def test_a_page_size_that_is_not_a_power_of_two(interpreted):
    _against_reference(interpreted, ODD_PAGES)


def test_a_sequence_gets_the_same_bits_whatever_its_batch(interpreted):
    """Splits are cut at fixed key counts, so one sequence's state does not depend on the others."""
    for a, b in zip(interpreted["alone"], interpreted["kernels"][LONG][1]):
        assert torch.equal(a[:, 0], b[:, 0])


def test_formats_without_a_decoder_are_refused(interpreted):
    assert interpreted["supports"] == [False] * len(REFUSED) + [True]


def test_cpu_tensors_without_the_interpreter_are_refused():
    """This process's triton is not interpreted (it was imported before any test could ask)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the whole run is interpreted")
    assert not gpu.supports(formats.get("f16"), formats.get("f16"), torch.zeros(2, 1, 2, 128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", CASES + EXTRA, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[3]}-T{c[6]}-p{c[7]}")
def test_compiled_kernel_on_cuda_matches_torch_block_loop(case):
    """The same cases, compiled for the GPU in this process; the reference stays on the CPU."""
    compiled_process()
    fmt_k, fmt_v, *tensors = _args(case)
    on_gpu = [t.cuda() for t in tensors]
    assert gpu.supports(fmt_k, fmt_v, on_gpu[0])
    got = [x.cpu() for x in gpu.prefill_state(fmt_k, fmt_v, *on_gpu, **_split(case))]
    _check(got, _torch_state(fmt_k, fmt_v, *tensors), tensors[1], tensors[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("name_k,name_v,dim", MATRIX, ids=lambda c: str(c))
def test_every_pair_head_dim_and_group_prefills_on_cuda(name_k, name_v, dim):
    """The prompt kernel compiled, at GQA 1, 4 and 8 (chunks of 4 rows a head, causal), against
    the torch block loop on the CPU (issue 18's parity matrix, as the decode test's)."""
    compiled_process()
    for group in MATRIX_GROUPS:
        case = (name_k, name_v, dim, group, LENGTHS, FIRSTS, 4, 16, 64)
        fmt_k, fmt_v, *tensors = _args(case)
        got = [x.cpu() for x in gpu.prefill_state(fmt_k, fmt_v, *[t.cuda() for t in tensors], **_split(case))]
        _check(got, _torch_state(fmt_k, fmt_v, *tensors), tensors[1], tensors[-1])


SM90 = [("q8_0", "turbo4", 256), ("iq4_nl", "turbo3", 128), ("f16", "bf16", 64)]
POINTERS = gpu.POINTER_ARGS


@pytest.mark.parametrize("name_k,name_v,dim", SM90)
def test_kernel_compiles_for_an_h100_without_one(name_k, name_v, dim):
    """The kernel lowers through Triton's compiler and ptxas for sm_90 with the launcher's
    constexprs and warps at a full row tile (a 512-token chunk at GQA 4)."""
    from kvslim.gpu import _paged_prefill_kernel as kernel
    config = gpu._launch_config(formats.get(name_k, role="k"), formats.get(name_v, role="v"), 2048, dim)
    num_warps = config.pop("num_warps")
    assert compile_for_sm90(kernel.paged_prefill_tile, POINTERS, config, num_warps).asm["cubin"]
