"""KERNEL "mma": decode attention with turbo4's codes decoded into tensor-core operands
(kvslim/gpu/_decode_mma_kernel.py, Gluon).

Gluon has no interpreter. Under TRITON_INTERPRET=1 the kernel's own function bodies run as
Triton kernels (layouts read as no-ops, the products in float32 of the f16 operands, the byte
permutes as a table read), so the interpreted child checks the kernel's logic against the torch
block loop. The byte permutes themselves are checked here by running their PTX text over every
2-byte unit (a small interpreter of the five instructions it uses), against the plane words the
kernel builds from the table. An sm_90 compile checks the layout: no shared memory, no barrier,
no spill, and every conversion to an operand layout a relabelling (the kernel asserts it when
compiled). The CUDA tests run the compiled kernel on a lent GPU.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import kvslim.gpu
from kvslim import formats
from kvslim.gpu import paged_decode as gpu
from kvslim.gpu import paged_prefill

from .test_native_attention import _case, _torch_state
from .test_triton_attention import _step_args, _step_gate
from .triton_harness import compiled_process, resource_usage, run_interpreted

pytestmark = pytest.mark.skipif(not kvslim.gpu.available(), reason="triton is not installed: no GPU kernel to check")

# (K, V, head_dim, group, lengths, page_size, split_keys, tune): 4-, 3- and 2-bit codes, q8_0's
# bytes, q4_0's and iq4_nl's nibbles and f16 rows, K and V apart; two blocks a row and one; 8, 5,
# 3 and 1 query rows of the products' 8; an empty sequence; splits of 32 and the default; pages
# of 12 (a step's keys across pages); 32 keys a step, once with 64-bit row offsets; each row kind
# with every load of a step issued first (EARLY); the rows of steps on asked of L2 (L2_AHEAD: under
# the interpreter its table reads run, its prefetches do not)
CASES = [("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32, {}),
         ("turbo4", "turbo4", 128, 5, (37, 100), 12, None, {}),
         ("turbo4", "turbo4", 256, 1, (70,), 16, None, {"N": 32, "WIDE": True}),
         ("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32, {"PREFETCH": 1, "maxnreg": 128}),   # case 0: rows a step
                                                                                  # ahead, registers capped
         ("turbo3", "turbo3", 256, 8, (37, 100, 0), 12, None, {}),
         ("turbo2", "turbo3", 128, 3, (20, 5), 16, None, {}),
         ("turbo3", "turbo4", 128, 8, (50,), 16, 32, {"N": 32}),
         ("f16", "f16", 256, 8, (40, 3, 0), 16, 32, {}),                   # f16 rows as they lie
         ("f16", "turbo3", 128, 5, (37, 100), 12, None, {}),
         ("turbo4", "f16", 256, 2, (20, 5), 16, None, {"N": 32}),
         ("q8_0", "turbo4", 256, 8, (40, 3, 0), 16, 32, {}),               # q8_0: scales per value
         ("q8_0", "q8_0", 128, 5, (37, 100), 12, None, {"N": 32}),
         ("turbo3", "q8_0", 128, 8, (30,), 16, None, {}),
         ("q4_0", "q4_0", 256, 8, (40, 3, 0), 16, 32, {}),                 # nibbles in ggml's order
         ("iq4_nl", "turbo4", 128, 5, (37, 100), 12, None, {"N": 32}),
         ("turbo3", "iq4_nl", 256, 8, (30,), 16, None, {}),
         ("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32, {"EARLY": 1, "PREFETCH": 1}),   # case 0: every load of
                                                                                  # a step first
         ("q8_0", "q4_0", 128, 5, (37, 100), 12, None, {"EARLY": 1}),
         ("f16", "turbo3", 256, 3, (20, 5), 16, None, {"EARLY": 1, "N": 32}),
         ("turbo4", "turbo4", 256, 8, (40, 3, 0), 16, 32, {"L2_AHEAD": 2, "EARLY": 1, "PREFETCH": 1}),  # case 0
         ("q8_0", "iq4_nl", 128, 5, (37, 100), 12, None, {"L2_AHEAD": 4, "N": 32})]        # with L2 asked ahead
MATRIX = ("f16", "q8_0", "q4_0", "iq4_nl", "turbo4", "turbo3", "turbo2")   # issue 18's formats
# step_output on it: one split (the kernel stores the output, gated too), and two (merged); the
# last two with every load of a step first (EARLY)
STEPS = [("turbo4", "turbo4", 256, 8, (20, 5), 16, None, "bfloat16"),
         ("turbo3", "turbo3", 128, 4, (72, 3), 32, 64, "float32"),
         ("q8_0", "turbo4", 256, 8, (40, 9), 16, None, "bfloat16")]
STEP_TUNES = [{"KERNEL": "mma"}, {"KERNEL": "mma", "EARLY": 1}, {"KERNEL": "mma", "PREFETCH": 1, "EARLY": 1}]


def _tables() -> dict:
    """Tables to read (16 entries, zero past a format's own): turbo4's, turbo3's, turbo2's, q4_0's
    and iq4_nl's at head_dim 256, and one of f16 values of every kind (both signs, subnormal, zero, large) in no
    order, whose first 8 and 4 entries the 3- and 2-bit codes read."""
    gen = torch.Generator().manual_seed(5)
    odd = torch.cat([torch.randn(12, generator=gen) * 100, torch.tensor([0.0, -6e-8, 3e-5, -65504.0])])
    tables = {name: paged_prefill._lut(formats.get(name, role="k"), 256, "cpu")[:16]
              for name in ("turbo4", "turbo3", "turbo2", "q4_0", "iq4_nl")}
    return dict(tables, odd=odd[torch.randperm(16, generator=gen)])


def _planes_kernel(lut, out):
    """The kernel's plane words of the table at ``lut``, stored (decorated in the child)."""
    words = _mma._planes(lut)
    for i in tl.static_range(8):
        tl.store(out + i, words[i])


def _in_child(cases, path: Path) -> None:
    """The interpreted states, step outputs and plane words (the kernel's ``_planes``)."""
    global tl, _mma                         # what the interpreted _planes_kernel reads
    import triton
    import triton.language as tl

    from kvslim.gpu import _decode_mma_kernel as _mma
    from kvslim.gpu import swiglu
    planes = triton.jit(_planes_kernel)
    out = {"states": [], "steps": [], "planes": {}}
    for case in CASES:
        args = _case(*case[:4], list(case[4]), page_size=case[5])
        out["states"].append(gpu.decode_state(*args, split_keys=case[6] or paged_prefill.SPLIT_KEYS,
                                              tune={"KERNEL": "mma", **case[7]}))
    for step, tune in zip(STEPS, STEP_TUNES):
        args, gate = _step_args(step), _step_gate(step)
        plain = gpu.step_output(*args[:-1], **args[-1], tune=tune)
        out["steps"].append((plain, gpu.step_output(*args[:-1], **args[-1], tune=tune, gate=gate),
                             swiglu.sigmoid_mul(gate, plain, gate.dtype)))
    for name, table in _tables().items():
        words = torch.zeros(8, dtype=torch.int32)
        planes[(1,)](torch.cat([table, torch.zeros(48)]), words)
        out["planes"][name] = words
    torch.save(out, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted("tests.test_triton_decode_mma", "_in_child", (), tmp_path_factory.mktemp("mma"))


def _check_f16_products(got, want, n_keys) -> None:
    """f16 operands' products (scores and weighted values) against the float32 reference: as the
    tile kernel's f16 products are held (test_triton_attention), and empty sequences empty."""
    m, l, acc = got
    live = n_keys > 0
    assert torch.allclose(m[:, live], want.m[:, live], atol=1e-2, rtol=1e-2)
    assert torch.allclose(acc[:, live] / l[:, live], want.result()[:, live], atol=1e-2, rtol=1e-2)
    assert (l[:, ~live] == 0).all() and torch.isinf(m[:, ~live]).all() and (acc[:, ~live] == 0).all()


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][2:4])))
def test_mma_decode_matches_torch_block_loop(interpreted, index):
    case = CASES[index]
    args = _case(*case[:4], list(case[4]), page_size=case[5])
    _check_f16_products(interpreted["states"][index], _torch_state(*args), args[-1])


def test_loads_moved_give_the_same_bits(interpreted):
    """PREFETCH 1 moves when a step's table entries are read, EARLY when its codes are, L2_AHEAD
    what L2 holds, and maxnreg where ptxas keeps values, not what is summed: case 0's state bit
    for bit."""
    moved = [i for i, case in enumerate(CASES) if i and case[:7] == CASES[0][:7]]
    assert [CASES[i][7] for i in moved] == [{"PREFETCH": 1, "maxnreg": 128}, {"EARLY": 1, "PREFETCH": 1},
                                            {"L2_AHEAD": 2, "EARLY": 1, "PREFETCH": 1}]
    for i in moved:
        for got, at_use in zip(interpreted["states"][i], interpreted["states"][0]):
            assert torch.equal(got, at_use)


@pytest.mark.parametrize("index", range(len(STEPS)), ids=lambda i: f"{STEPS[i][2]}-{STEPS[i][7]}")
def test_a_decode_step_by_mma_matches_the_ops_torch_form(interpreted, index):
    """``step_output`` on it: stored by the kernel (one split) or merged (two), and gated with
    sigmoid_mul's bits."""
    plain, gated, want_gated = interpreted["steps"][index]
    fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions, _ = _step_args(STEPS[index])
    want = torch.ops.kvslim.paged_decode(q, k_pool, v_pool, table, slots, positions, scale, STEPS[index][0],
                                         STEPS[index][1])
    torch.testing.assert_close(plain, want, atol=1e-2, rtol=1e-2)
    assert torch.equal(gated, want_gated)


# ---- the byte permutes' PTX, run over every unit ---------------------------------------------

def _prmt(a, b, selector):
    """PTX ``prmt.b32`` (generic mode): byte i of the result is byte (nibble i of the selector) & 7
    of {b, a} (a's bytes 0-3, b's 4-7), or that byte's sign bit copied into all 8 where the
    nibble's bit 3 is set."""
    source = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint32)
    for i in range(4):
        nibble = (selector >> np.uint32(4 * i)) & np.uint32(15)
        shift = (nibble & np.uint32(7)).astype(np.uint64) * np.uint64(8)
        byte = ((source >> shift) & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(nibble & np.uint32(8), np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0)), byte)
        out |= byte << np.uint32(8 * i)
    return out


def _run_ptx(text: str, inputs: list, outputs: int) -> list:
    """The kernel's asm text on numpy uint32 arrays: $outputs.. the inputs, $0.. the 16-bit
    outputs. Knows mov, and, or, xor, shl, shr, prmt, f16x2 sub and mul (rounded to nearest) and
    the unpacking mov, and refuses anything else."""
    regs = {f"${outputs + i}": np.asarray(x, dtype=np.uint32) for i, x in enumerate(inputs)}
    value = lambda tok: regs[tok] if tok in regs else np.uint32(int(tok, 0))   # noqa: E731
    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            pair = re.fullmatch(r"\{(\$\d+), (\$\d+)\}, (\w+)", rest)
            regs[pair[1]], regs[pair[2]] = regs[pair[3]] & np.uint32(0xFFFF), regs[pair[3]] >> np.uint32(16)
            continue
        dest, *args = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[dest] = value(args[0])
        elif op in ("sub.rn.f16x2", "mul.rn.f16x2"):
            pair = np.broadcast_arrays(np.asarray(value(args[0]), np.uint32), np.asarray(value(args[1]), np.uint32))
            halves = [np.stack([x & np.uint32(0xFFFF), x >> np.uint32(16)]).astype(np.uint16).view(np.float16)
                      for x in pair]
            out = halves[0] - halves[1] if op.startswith("sub") else halves[0] * halves[1]   # numpy rounds once
            bits = out.view(np.uint16).astype(np.uint32)
            regs[dest] = bits[0] | (bits[1] << np.uint32(16))
        elif op == "xor.b32":
            regs[dest] = value(args[0]) ^ value(args[1])
        elif op == "and.b32":
            regs[dest] = value(args[0]) & value(args[1])
        elif op == "or.b32":
            regs[dest] = value(args[0]) | value(args[1])
        elif op == "shl.b32":
            regs[dest] = (value(args[0]).astype(np.uint64) << np.uint64(int(args[1]))).astype(np.uint32)
        elif op == "shr.u32":
            regs[dest] = value(args[0]) >> value(args[1])
        elif op == "prmt.b32":
            regs[dest] = _prmt(value(args[0]), value(args[1]), np.broadcast_to(value(args[2]), value(args[0]).shape))
        else:
            raise AssertionError(f"an instruction this check does not know: {line}")
    return [regs[f"${i}"] for i in range(outputs)]


def _f16_bits(table: torch.Tensor) -> np.ndarray:
    return table.to(torch.float16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


@pytest.mark.parametrize("name", list(_tables()))
def test_the_byte_permutes_read_every_unit_from_the_table(interpreted, name):
    """4-bit codes: every 2-byte unit's four codes (bits 0, 4, 8, 12) come out as their table
    entries' f16 bits, from the plane words the kernel built from the float32 table."""
    from kvslim.gpu._decode_mma_kernel import PERMUTE_ASM
    units = np.arange(1 << 16, dtype=np.uint32)
    words = interpreted["planes"][name].numpy().view(np.uint32)
    got = _run_ptx(PERMUTE_ASM.value, [units, *(np.full_like(units, w) for w in words)], 4)
    table = _f16_bits(_tables()[name])
    for p in range(4):
        assert np.array_equal(got[p], table[(units >> np.uint32(4 * p)) & np.uint32(15)]), p


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("name", ["turbo3", "turbo2", "odd"])
def test_the_byte_permutes_read_3_and_2_bit_groups(interpreted, bits, name):
    """3- and 2-bit codes, a group of 16 in 3 or 2 units: each code at each of the 16 places with
    each value, and 20,000 random groups, come out as their entries' f16 bits."""
    from kvslim.gpu._decode_mma_kernel import THREE_ASM, TWO_ASM
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(20_000, 16), dtype=np.uint64)
    every = np.zeros((16 << bits, 16), dtype=np.uint64)
    for place in range(16):
        every[place << bits:(place + 1) << bits, place] = np.arange(1 << bits)
    codes = np.concatenate([every, codes])
    run = (codes << (np.arange(16, dtype=np.uint64) * np.uint64(bits))).sum(axis=1)      # little-endian bits
    units = [((run >> np.uint64(16 * i)) & np.uint64(0xFFFF)).astype(np.uint32) for i in range(bits)]
    words = interpreted["planes"][name].numpy().view(np.uint32)
    planes = [np.full_like(units[0], words[i]) for i in (0, 1, 4, 5)]
    got = _run_ptx((THREE_ASM if bits == 3 else TWO_ASM).value, units + planes, 16)
    table = _f16_bits(_tables()[name])
    for c in range(16):
        assert np.array_equal(got[c], table[codes[:, c].astype(np.int64)]), c


@pytest.mark.parametrize("scale", [1.0, 0.0137, -3.5, 6e-5, 400.0])
def test_q8_0s_bytes_come_out_times_their_scale_rounded_once(scale):
    """q8_0: every 2-byte unit's two int8 codes, as f16 products of the code and the block's f16
    scale (the tile kernel's f16 products round so), small, negative, subnormal-making and large
    scales (up to 127 x 400, near f16's largest)."""
    from kvslim.gpu._decode_mma_kernel import Q8_ASM
    units = np.arange(1 << 16, dtype=np.uint32)
    half = np.float16(scale)
    bits = np.uint32(np.array(half).view(np.uint16))
    lo, hi = _run_ptx(Q8_ASM.value, [units, np.full_like(units, bits | (bits << np.uint32(16)))], 2)
    for got, byte in ((lo, units & np.uint32(0xFF)), (hi, units >> np.uint32(8))):
        code = byte.astype(np.uint8).view(np.int8).astype(np.float16)
        want = (code * half).view(np.uint16).astype(np.uint32)
        assert np.array_equal(got, want)


# ---- what it refuses -------------------------------------------------------------------------

@pytest.mark.parametrize("name_k,name_v,dim,rows,tune,why", [
    ("q5_0", "turbo4", 256, 8, {}, "2-bit codes through a table (turbo4, turbo3, turbo2), not q5_0"),
    ("q4_1", "turbo4", 256, 8, {}, "blocks of 32 codes after one f16 scale, not q4_1's layout"),   # its minimum
    ("turbo4", "nl4", 256, 8, {}, "blocks of 128 codes after one f16 scale, not nl4's layout"),
    ("bf16", "turbo3", 256, 8, {}, "not bf16 rows"),
    ("turbo4", "turbo4", 64, 8, {}, "head_dim 128 or 256, not 64"),
    ("turbo4", "turbo4", 256, 9, {}, "at most 8 query rows"),
    ("turbo4", "turbo4", 256, 8, {"N": 8}, "N=8 with KERNEL='mma'"),
    ("turbo4", "turbo4", 256, 8, {"PREFETCH": 2}, "PREFETCH=2 with KERNEL='mma'"),
    ("turbo4", "turbo4", 256, 8, {"EARLY": 2}, "EARLY=2 with KERNEL='mma'"),
    ("turbo4", "turbo4", 256, 8, {"maxnreg": 64}, "maxnreg=64 with KERNEL='mma'"),
    ("turbo4", "turbo4", 256, 8, {"L2_AHEAD": 3}, "L2_AHEAD=3 with KERNEL='mma'"),
    ("turbo4", "turbo4", 256, 8, {"BLOCK_N": 32}, "not a setting of KERNEL='mma': BLOCK_N")])
def test_mma_refuses_what_it_cannot_read(name_k, name_v, dim, rows, tune, why):
    """Refused by name before a launch, never decoded wrong; reads_by_mma agrees."""
    fmt_k, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    with pytest.raises(ValueError, match=re.escape(why)):
        paged_prefill._launch_config(fmt_k, fmt_v, rows, dim, {"KERNEL": "mma", **tune})
    assert paged_prefill.reads_by_mma(fmt_k, fmt_v, dim, rows) == bool(tune)


def test_n_is_mmas_setting():
    with pytest.raises(ValueError, match="N is a setting of KERNEL='mma'"):
        paged_prefill._launch_config(formats.get("turbo4"), formats.get("turbo4"), 8, 256, {"N": 16})


def test_mma_decodes_only():
    fmt_k, fmt_v, q, k_pool, v_pool, table, n_keys = _case("turbo4", "turbo4", 256, 8, [20], page_size=16)
    with pytest.raises(ValueError, match="KERNEL='mma' decodes"):
        paged_prefill.attend(fmt_k, fmt_v, q, torch.arange(8, dtype=torch.int32)[None], k_pool, v_pool, table, n_keys,
                             tune={"KERNEL": "mma"})


# ---- its sm_90 code, without a GPU -----------------------------------------------------------

def _sm90(name_k: str, name_v: str, dim: int, tune: dict):
    """Decode's launch of the kernel (8 rows, bf16 q read in place, the table by slot) with ``tune``,
    compiled for sm_90 without a GPU."""
    from kvslim.gpu import _decode_mma_kernel, compile_sm90
    fmt, fmt_v = formats.get(name_k, role="k"), formats.get(name_v, role="v")
    config = dict(paged_prefill._launch_config(fmt, fmt_v, 8, dim, {"KERNEL": "mma", **tune}), BY_SLOT=True)
    config.pop("KERNEL")
    num_warps = config.pop("num_warps")
    return compile_sm90(_decode_mma_kernel.paged_decode_mma, dict(paged_prefill.POINTER_ARGS, q_ptr="*bf16"),
                        config, paged_prefill.aligned_args(fmt, fmt_v, dim), num_warps=num_warps)


@pytest.mark.parametrize("name_k,name_v,dim,keys,tune", [
    ("turbo4", "turbo4", 256, 16, {}), ("turbo4", "turbo4", 128, 16, {}), ("turbo4", "turbo4", 256, 32, {}),
    ("turbo4", "turbo4", 256, 16, {"PREFETCH": 1}), ("turbo4", "turbo4", 256, 16, {"PREFETCH": 1, "EARLY": 1}),
    ("turbo3", "turbo3", 256, 16, {}), ("turbo2", "turbo4", 128, 16, {}), ("f16", "f16", 256, 16, {"PREFETCH": 1}),
    ("q8_0", "turbo4", 256, 16, {}), ("q8_0", "q4_0", 256, 16, {"EARLY": 1}), ("q4_0", "iq4_nl", 256, 16, {}),
    ("turbo4", "turbo4", 256, 16, {"L2_AHEAD": 4, "PREFETCH": 1, "EARLY": 1}), ("f16", "f16", 256, 16, {"L2_AHEAD": 4}),
    ("q8_0", "turbo4", 256, 16, {"L2_AHEAD": 8})])
def test_mma_decodes_in_registers_for_an_h100_without_one(name_k, name_v, dim, keys, tune):
    """What the kernel is for, in its sm_90 SASS (decode's launch: bf16 q read in place, the table
    by slot): no shared memory at all, no barrier or shared-memory access in its loop over keys,
    no spill; and it compiled, so every conversion to an operand layout was a relabelling
    (``assert_trivial``). turbo4/turbo4 85 instructions a key at head_dim 256, turbo3 75 (Triton
    3.6 and 3.9). With L2_AHEAD, the loop's L2 prefetches (``CCTL.E.PF2``): a (keys, 8 lines)
    tile a lane's share, for K's rows and V's, 8 a step at 16 keys; none without."""
    from kvslim.gpu import cuobjdump, loop_ops
    compiled = _sm90(name_k, name_v, dim, {"N": keys, **tune})
    step = loop_ops(cuobjdump(compiled, "-sass"))
    assert step and not [op for op in step if op.startswith(("BAR", "LDS", "STS"))], sorted(set(step))
    assert compiled.metadata.shared == 0 and resource_usage(compiled)["STACK"] == 0
    assert sum(op.startswith("HMMA") for op in step) == 2 * dim // 16 * keys // 16   # K's and V's products
    prefetches = sum(op.startswith("CCTL") for op in step)
    assert prefetches == (2 * keys * 8 // 32 if tune.get("L2_AHEAD") else 0), prefetches


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0030*/                   IADD3 R5, R4, 0x1, RZ ;
        /*0040*/               @P0 LDG.E R12, desc[UR4][R2.64+0x4] ;
        /*0050*/                   HMMA.16816.F32 R20, R16, R10, R20 ;
        /*0060*/                   IMAD R13, R5, 0x2, RZ ;
        /*0070*/                   STG.E desc[UR4][R2.64], R13 ;
        /*0080*/              @!P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
"""


def test_load_leads_count_instructions_to_the_first_read():
    """In the loop (0x10 .. the BRA): the 16-bit load is read 2 instructions on, the 128-bit one
    (R8 .. R11) 3 on by the HMMA's R10, and the predicated load to R12 never, so it has no lead;
    where the loop's first instruction reads R12 instead, its lead runs around the back edge."""
    from kvslim.gpu import load_leads, loop_ops
    assert loop_ops(SASS) == ["LDG.E.U16", "LDG.E.128", "IADD3", "LDG.E", "HMMA.16816.F32", "IMAD", "STG.E", "BRA"]
    assert load_leads(SASS) == [2, 3]
    looped = SASS.replace("LDG.E.U16 R4, desc[UR4][R2.64]", "IADD3 R4, R12, 0x1, RZ")
    assert load_leads(looped) == [3, 5]
    stored = SASS.replace("IADD3 R5, R4, 0x1, RZ", "NOP").replace("STG.E desc[UR4][R2.64], R13",
                                                                   "STG.E desc[UR4][R4.64], R13")
    assert load_leads(stored) == [6, 3]            # a store's address reads too


def test_load_waves_count_the_stops_on_memory():
    """Outside a loop: the two loads go out, the IADD3 reads R4 (one wave), then the predicated
    load's R12 is never read; where the HMMA reads R12 too, a second wave; loads that are never
    read make none."""
    from kvslim.gpu import load_waves
    assert load_waves(SASS) == 1
    assert load_waves(SASS.replace("R16, R10, R20", "R16, R12, R20")) == 2
    assert load_waves(SASS.replace("IADD3 R5, R4", "IADD3 R5, R3").replace("R16, R10", "R16, R14")) == 0


def test_early_loads_lead_their_reads_by_hundreds_of_instructions():
    """What EARLY is for, in sm_90 SASS (turbo4/turbo4, head_dim 256): with it and PREFETCH 1, the
    step's loads come hundreds of instructions before their first reads (median ~700, least
    ~220: Triton 3.6 and 3.9); loaded at use, under a hundred (median ~80, least 3-9), which one
    warp cannot hide from memory's latency."""
    from kvslim.gpu import cuobjdump, load_leads
    leads = {early: sorted(load_leads(cuobjdump(_sm90("turbo4", "turbo4", 256, {"PREFETCH": early, "EARLY": early}),
                                                "-sass")))
             for early in (0, 1)}
    assert len(leads[0]) == len(leads[1]) == 80                 # K's and V's units and norms, the table's entries
    assert leads[0][40] < 150 and leads[1][40] > 400 and leads[1][0] > 150, leads


# ---- on a lent GPU ---------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][2:4])))
def test_mma_decode_on_cuda_matches_torch_block_loop(index):
    compiled_process()
    case = CASES[index]
    fmt_k, fmt_v, *tensors = _case(*case[:4], list(case[4]), page_size=case[5])
    got = gpu.decode_state(fmt_k, fmt_v, *[t.cuda() for t in tensors], split_keys=case[6] or paged_prefill.SPLIT_KEYS,
                           tune={"KERNEL": "mma", **case[7]})
    _check_f16_products([x.cpu() for x in got], _torch_state(fmt_k, fmt_v, *tensors), tensors[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("name_k,name_v", [(k, v) for k in MATRIX for v in MATRIX])
def test_mma_decode_on_cuda_at_each_head_dim_and_group(name_k, name_v, dim):
    """Issue 18's matrix for the formats this kernel reads, K and V: at GQA 1, 4 and 8."""
    compiled_process()
    for group in (1, 4, 8):
        fmt_k, fmt_v, *tensors = _case(name_k, name_v, dim, group, [37, 100, 16, 0], page_size=16)
        got = gpu.decode_state(fmt_k, fmt_v, *[t.cuda() for t in tensors], split_keys=64, tune={"KERNEL": "mma"})
        _check_f16_products([x.cpu() for x in got], _torch_state(fmt_k, fmt_v, *tensors), tensors[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the compiled kernel waits for a GPU")
@pytest.mark.parametrize("index", range(len(STEPS)), ids=lambda i: f"{STEPS[i][2]}-{STEPS[i][7]}")
def test_a_decode_step_by_mma_on_cuda_matches_the_ops_torch_form(index):
    compiled_process()
    fmt_k, fmt_v, q, scale, k_pool, v_pool, table, slots, positions, split = _step_args(STEPS[index])
    on_gpu = [t.cuda() for t in (q, k_pool, v_pool, table, slots, positions)]
    got = gpu.step_output(fmt_k, fmt_v, on_gpu[0], scale, *on_gpu[1:], **split, tune=STEP_TUNES[index])
    want = torch.ops.kvslim.paged_decode(q, k_pool, v_pool, table, slots, positions, scale, STEPS[index][0],
                                         STEPS[index][1])
    torch.testing.assert_close(got.cpu(), want, atol=1e-2, rtol=1e-2)
