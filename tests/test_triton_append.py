"""The Triton quantize-on-append kernel against each format's own torch encoder (its reference).

Rows of several tokens and KV heads go to scattered pool rows, found through a block table by
(slot, position) as the cache keeps them; the kernel must write the bytes ``fmt.encode_flagged``
gives, leave every other pool row alone, and raise the flag of each overflowing token's slot (NaN,
inf, values past the fp16 fields), and no other. A flagged token's bytes are not compared: nobody reads them (the engine
stops the sequence).

Exact formats (floats, q8_0, q4_0, rotated or not): the same arithmetic in the same order (the
Hadamard as the same butterfly, correctly rounded divisions, no mul+add fusion), so the same bytes.
Formats whose encoder sums over a block (iq4_nl's and the nl grids' scale searches, TurboQuant's
norm and rotation) sum in another order than torch (a tree in the kernel, a tl.dot on a GPU): a
near-tie may go the other way, so >= 99% of the bytes agree and the decoded rows have the same
error (the bound tests/test_native_step.py sets for the C encoders). Under the interpreter they
agreed exactly on these draws.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernel with numpy on CPU tensors in one child
process (tests/triton_harness.py says why); what it cannot check (the GPU's rounding of ``/`` and
fusion, compilation, speed) waits for a CUDA run, but compiling for sm_90 needs no GPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import kvslim.gpu

from kvslim import formats
from kvslim.gpu import kv_append as gpu

from .triton_harness import compile_for_sm90, compiled_process, run_interpreted, spilled_bytes

pytestmark = pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed: no GPU kernel to check")

F32, F16, BF16 = "float32", "float16", "bfloat16"
# (format, role, head_dim, input dtype): K rotates in blocks of head_dim's largest power-of-two
# divisor, V in 64s; 80, 96 and 192 pad the row (192: three blocks of nl4 or six of q8_0 in 256 lanes).
EXACT = [("f32", "k", 128, F32), ("f16", "k", 80, F16), ("bf16", "v", 96, BF16), ("q8_0", "k", 128, F32),
         ("q8_0", "v", 192, F32), ("q4_0", "k", 256, BF16), ("q4_0", "v", 64, F32), ("q8_0-norot", "k", 96, F16),
         ("q4_0-norot", "v", 128, F32), ("q4_1", "k", 128, F32), ("q5_0", "v", 64, BF16), ("q5_1", "k", 192, F32),
         ("q5_1-norot", "v", 96, F16)]
CLOSE = [("iq4_nl", "k", 128, F32), ("iq4_nl-norot", "v", 64, F32), ("turbo4", "k", 128, F32),
         ("turbo3", "v", 256, F32), ("turbo2", "k", 96, F32), ("nl4", "k", 192, F32), ("nl4", "v", 128, F32),
         ("nl3", "k", 64, F32), ("nl4s", "k", 128, F32), ("nl3s", "v", 256, BF16)]
N_KV, PAGE_SIZE = 2, 16
# a token's heads are a program's rows: one head; 20 (two programs a token, the second 4 rows of
# 16); turbo's rows padded to tl.dot's 16 (1 head x 1 block, and 20 heads x 2 blocks)
HEADS = [("q4_0", "k", 128, F32, 1), ("f16", "v", 64, F16, 20), ("q8_0", "k", 128, F32, 20),
         ("turbo4", "k", 128, F32, 1), ("turbo3", "v", 256, F32, 20)]
REFUSED = [("turbo4p", 128), ("nl4", 96)]      # QJL, no rotation


def _case(name, role, dim, dtype, n_kv=N_KV, n_tokens=16, seed=0):
    """(fmt, x (N, Hkv, D), pool of random bytes, flat pool rows (N,), where): magnitudes over
    five decades, one NaN, one inf and one value past every fp16 scale. ``where``: the append's
    (block table, slots, positions, per-slot flags) that place token n at rows[n]. 16 tokens over
    4 pages: a program a token, which the interpreter runs one by one (0.2 s each for iq4_nl)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = formats.get(name, role=role)
    x = torch.randn(n_tokens, n_kv, dim, generator=gen) * torch.logspace(-3, 2, n_tokens)[:, None, None]
    x[3, 1 % n_kv, 5], x[5, 0, dim - 1], x[7, n_kv - 1, 2] = float("nan"), float("inf"), 1e9
    # as the K or V columns of a fused projection: each token's heads contiguous, tokens strided
    wide = torch.cat([x.reshape(n_tokens, -1), torch.zeros(n_tokens, 8)], 1).to(getattr(torch, dtype))
    x = wide[:, :n_kv * dim].view(n_tokens, n_kv, dim)
    pages = n_tokens // PAGE_SIZE + 3
    pool = torch.randint(0, 256, (n_kv, pages, PAGE_SIZE, fmt.row_bytes(dim)), dtype=torch.uint8, generator=gen)
    rows = torch.randperm(pages * PAGE_SIZE, generator=gen)[:n_tokens]
    return fmt, x, pool, rows, _placement(rows, pages, gen)


def _placement(rows: torch.Tensor, pages: int, gen: torch.Generator):
    """Token n in slot slots[n] (one a token, shuffled), at position (n % 3) pages in plus rows[n]'s
    offset, its table entry rows[n]'s page, the rest of the table random; slot 0's flag already
    raised (an append must not lower it)."""
    n = rows.shape[0]
    slots = torch.randperm(n, generator=gen)
    positions = (torch.arange(n) % 3) * PAGE_SIZE + rows % PAGE_SIZE
    table = torch.randint(0, pages, (n, 3), dtype=torch.int32, generator=gen)
    table[slots, torch.arange(n) % 3] = (rows // PAGE_SIZE).int()
    flags = torch.zeros(n, dtype=torch.uint8)
    flags[0] = 1
    return table, slots, positions, flags


# K and V of one format (head_dim, input dtype): one launch where they encode alike, f16's and
# turbo4's; q8_0's K rotates by 128s and its V by 64s, so two
PAIRS = [("f16", 128, F16), ("turbo4", 256, BF16), ("q8_0", 128, F32)]


def _pair(name: str, dim: int, dtype: str):
    """K and V rows of one cache step (one placement) and their pools, V's values other than K's."""
    fmt_k, k, k_pool, rows, where = _case(name, "k", dim, dtype, seed=0)
    fmt_v, v, v_pool, _, _ = _case(name, "v", dim, dtype, seed=1)
    return (fmt_k, k, k_pool), (fmt_v, v, v_pool), rows, where


def _pair_appended(name: str, dim: int, dtype: str, cuda: bool = False):
    """(launches, K pool, V pool, flags) of ``append_kv``, then the pools and flags of one ``append``
    for each side, from the same start (with ``cuda``, on the GPU); returned on the CPU."""
    (fmt_k, k, k_pool), (fmt_v, v, v_pool), _, where = _pair(name, dim, dtype)
    on = (lambda t: t.cuda()) if cuda else (lambda t: t)        # .cuda(): what tests/rehearse_cuda.py stands in for
    k, k_pool, v, v_pool = (on(t) for t in (k, k_pool, v, v_pool))
    table, slots, positions, flags = (on(t) for t in where)
    apart = [k_pool.clone(), v_pool.clone(), flags.clone()]
    launches = []
    inner = gpu._append
    gpu._append = lambda sides, *a: launches.append(len(sides)) or inner(sides, *a)
    try:
        gpu.append_kv(fmt_k, k, k_pool, fmt_v, v, v_pool, table, slots, positions, flags)
    finally:
        gpu._append = inner
    gpu.append(fmt_k, k, apart[0], table, slots, positions, apart[2])
    gpu.append(fmt_v, v, apart[1], table, slots, positions, apart[2])
    return launches, tuple(t.cpu() for t in (k_pool, v_pool, flags)), [t.cpu() for t in apart]


def _appended_in_child(cases, path: Path) -> None:
    """In a TRITON_INTERPRET=1 child: every case's pool after the append, its flags, and supports()."""
    out = {"cases": [], "supports": []}
    for case in cases:
        fmt, x, pool, _, (table, slots, positions, flags) = _case(*case)
        served = gpu.supports(fmt, x)
        gpu.append(fmt, x, pool, table, slots, positions, flags)
        out["cases"].append((served, flags, pool))
    out["pairs"] = [_pair_appended(*pair) for pair in PAIRS]
    out["supports"] = [gpu.supports(formats.get(name), torch.zeros(2, 1, dim)) for name, dim in REFUSED]
    out["supports"] += [gpu.supports(formats.get("q8_0"), torch.zeros(2, 1, 128, dtype=torch.float64)),
                        gpu.supports(formats.get("q8_0"), torch.zeros(2, 128)),
                        gpu.supports(formats.get("q8_0"), torch.zeros(2, 1, 128))]
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case appended once, by one interpreted child process."""
    cases = EXACT + CLOSE + HEADS
    out = run_interpreted("tests.test_triton_append", "_appended_in_child", cases, tmp_path_factory.mktemp("append"))
    return dict(zip(cases, out["cases"])), out["supports"], out["pairs"]


@pytest.fixture(scope="module")
def interpreted_pairs(interpreted):
    return interpreted[2]


def _check(case, flags, pool, exact: bool):
    fmt, x, before, rows, (_, slots, _, flags_before) = _case(*case)
    dim = x.shape[-1]
    want, want_flags = fmt.encode_flagged(x)
    raised = flags_before.clone()
    raised[slots[want_flags]] = 1                                              # per slot: token n's is slots[n]
    assert torch.equal(flags.cpu(), raised) and want_flags[[3, 5]].all() and not want_flags[0]
    n_kv = x.shape[1]
    flat, flat_before = pool.cpu().view(n_kv, -1, pool.shape[-1]), before.view(n_kv, -1, before.shape[-1])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])           # nothing written elsewhere
    good = ~want_flags
    got, want = flat[:, rows].transpose(0, 1)[good], want[good]                 # (tokens, Hkv, row_bytes)
    if exact:
        assert torch.equal(got, want)
        return
    assert (got == want).float().mean() > 0.99
    err = lambda codes: float(((fmt.decode(codes.contiguous(), dim) - x[good].float()) ** 2).mean())   # noqa: E731
    assert err(got) == pytest.approx(err(want), rel=1e-3)


@pytest.mark.parametrize("case", EXACT, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}")
def test_block_and_float_formats_get_the_encoders_bytes(interpreted, case):
    served, flags, pool = interpreted[0][case]
    assert served
    _check(case, flags, pool, exact=True)


@pytest.mark.parametrize("case", CLOSE, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}")
def test_searched_and_rotated_formats_get_the_encoders_bytes_but_for_near_ties(interpreted, case):
    served, flags, pool = interpreted[0][case]
    assert served
    _check(case, flags, pool, exact=False)


@pytest.mark.parametrize("case", HEADS, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[4]}heads")
def test_a_tokens_heads_are_its_programs_rows_whatever_their_number(interpreted, case):
    served, flags, pool = interpreted[0][case]
    assert served
    _check(case, flags, pool, exact=not case[0].startswith("turbo"))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-d{p[1]}-{p[2]}")
def test_k_and_v_alike_are_appended_in_one_launch(interpreted_pairs, pair):
    """``append_kv`` writes each side's bytes and raises the flags as one ``append`` a side does,
    in one launch where K and V encode alike; their pools' bytes are the encoders' (for turbo4,
    but for near ties)."""
    _check_pair(pair, *interpreted_pairs[PAIRS.index(pair)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-d{p[1]}-{p[2]}")
def test_k_and_v_alike_on_cuda_in_one_launch(pair):
    compiled_process()
    _check_pair(pair, *_pair_appended(*pair, cuda=True))


def _check_pair(pair, launches, appended, apart):
    (k_pool, v_pool, flags), (k_apart, v_apart, flags_apart) = appended, apart
    assert launches == ([2] if pair[0] != "q8_0" else [1, 1])
    assert torch.equal(k_pool, k_apart) and torch.equal(v_pool, v_apart) and torch.equal(flags, flags_apart)
    (fmt_k, k, before_k), (fmt_v, v, before_v), rows, where = _pair(*pair)
    for fmt, x, before, pool in ((fmt_k, k, before_k, k_pool), (fmt_v, v, before_v, v_pool)):
        want, bad = fmt.encode_flagged(x)
        got = pool.view(N_KV, -1, pool.shape[-1])[:, rows].transpose(0, 1)[~bad]
        same = (got == want[~bad]).float().mean()
        assert same > 0.99 if pair[0] == "turbo4" else same == 1
        assert not torch.equal(pool, before)
    assert not torch.equal(k_pool[:, :, :, :64], v_pool[:, :, :, :64])      # each side its own rows


def test_formats_without_a_kernel_encoder_are_refused(interpreted):
    """The QJL rows, a head_dim the format cannot store, float64 or unbatched rows."""
    assert interpreted[1] == [False] * len(REFUSED) + [False, False, True]


def test_cpu_tensors_without_the_interpreter_are_refused():
    """This process's triton is not interpreted (it was imported before any test could ask)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the whole run is interpreted")
    assert not gpu.supports(formats.get("q8_0"), torch.zeros(2, 1, 128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("case", EXACT + CLOSE, ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-{c[3]}")
def test_compiled_kernel_on_cuda_gets_the_encoders_bytes(case):
    """The same cases compiled for the GPU in this process; the reference stays on the CPU. This is
    where an approximate division or a fused multiply-add would show in the exact formats."""
    compiled_process()
    fmt, x, pool, _, where = _case(*case)
    pool, (table, slots, positions, flags) = pool.cuda(), (t.cuda() for t in where)
    assert gpu.supports(fmt, x.cuda())
    gpu.append(fmt, x.cuda(), pool, table, slots, positions, flags)
    _check(case, flags, pool, exact=case in EXACT)


SM90 = [("q4_0", 128), ("turbo4", 256), ("nl4", 128), ("q5_1", 128), ("nl4s", 128)]
POINTERS = {"x_ptr": "*fp32", "pool": "*u8", "x2_ptr": "*fp32", "pool2": "*u8", "table_ptr": "*i32",
            "slots_ptr": "*i64", "pos_ptr": "*i64",
            "flags_ptr": "*u8", "rot_m": "*fp32",
            "bounds": "*fp32", "cents": "*fp32", "tries": "*fp32", "ladder": "*fp32", "limit": "fp32",
            "rot_scale": "fp32"}


@pytest.mark.parametrize("name,dim", SM90)
def test_kernel_compiles_for_an_h100_without_one(name, dim):
    """The Hadamard butterfly (tl.gather), TurboQuant's tl.dot and the grids' scale search lower
    through Triton's compiler and ptxas for sm_90 with the launcher's constexprs and warps, with
    at most a few bytes of spills (turbo4's product in one tl.dot spilled 752 a thread), and with
    no 64-bit integer division: a position's page and row, divided by a page size the kernel took
    as an argument, called that division's routine (its I2F.U64.RP) for every row (16 calls; f16
    rows 2,360 instructions a thread, 1,568 with the page size a constexpr)."""
    from kvslim.gpu import _kv_append_kernel as kernel, cuobjdump
    fmt = formats.get(name, role="k")
    config = gpu.kernel_config(gpu._launch_config(fmt.kernel_encoder(dim), dim, fmt.row_bytes(dim)), 2, 16)
    num_warps = config.pop("num_warps")
    compiled = compile_for_sm90(kernel.kv_append_rows, POINTERS, config, num_warps)
    assert compiled.asm["cubin"] and spilled_bytes(compiled) <= 64
    assert "I2F.U64" not in cuobjdump(compiled, "-sass")


@pytest.mark.parametrize("name,most", [("f16", 2), ("q8_0", 2), ("turbo4", 12), ("turbo3", 12)])
def test_a_tokens_rows_wait_on_memory_a_few_times(name, most):
    """A decode step's append at head_dim 256 and Qwen3.6's 2 KV heads, for sm_90: the token's slot,
    position and page loaded once, beside its rows (``gpu.load_waves``). With 16 rows of 8 tokens
    a program, each thread loaded every row's three in turn: f16 30 waits, q8_0 20, turbo4 and
    turbo3 22. Now 2, 2, and for turbo (its rotation's whole matrix one tl.dot step at 16 rows,
    loaded with x before the norm) 8 and 6 under Triton 3.9, 8 and 8 under 3.6: the waits past
    the first are the codebook's bounds and centroids, read from L1."""
    from kvslim.gpu import _kv_append_kernel as kernel, cuobjdump, load_waves
    fmt = formats.get(name, role="v")
    config = gpu.kernel_config(gpu._launch_config(fmt.kernel_encoder(256), 256, fmt.row_bytes(256)), 2, 16)
    num_warps = config.pop("num_warps")
    compiled = compile_for_sm90(kernel.kv_append_rows, POINTERS, config, num_warps)
    sass = cuobjdump(compiled, "-sass")
    assert load_waves(sass) <= most and spilled_bytes(compiled) <= 16
    if name.startswith("turbo"):      # the rotation's matrix (64 KB, 128-bit loads) goes out with x, before
        wide = sass.count("LDG.E.128")  # the norm's barrier: loaded after it, it was a round trip of its own
        assert wide >= 16 and sass[:sass.index("BAR.SYNC")].count("LDG.E.128") == wide
