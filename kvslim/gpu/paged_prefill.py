"""Prefill attention on packed pages in Triton: many query rows per sequence, each causal.

``prefill_state`` returns the online-softmax state (running max, denominator, unnormalised sum
in V's code domain) of R query rows per sequence over its packed pages, row r seeing the keys
at positions <= q_pos[s, r] (and < lengths[s]): the state ``attention._scan_pages`` leaves in an
``_OnlineSoftmax``, which is its reference (tests/test_triton_prefill.py, under Triton's
interpreter). Decode (``paged_decode``) is this kernel with every row at its sequence's newest
position. The row layouts and code tables come from ``codec_fields``, the C kernel's
description of each format (nothing is restated); the decoding is ``_codecs.decode_tile``.

A program holds a tile of BLOCK_M rows and reads only the keys its rows can see. Long chunks
get their parallelism from the tiles (a 512-token chunk at GQA 4 is 64 tiles per KV head);
few rows (at most SPLIT_ROWS) over a deep history would leave most of the GPU idle, so those
are also cut into splits of keys, as flash-decoding, and merged in one more launch (``merged``;
``merge_splits`` is its torch reference).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..native.paged_attention import BF16, F16, KLT, NIBBLE, PACKED, Q8, CodecFields, codec_fields
from . import FP_FUSION, kernels, pdl, pow2, serves

GATHER, SELECT, TREE, MIRROR, AFFINE, TABLE = range(6)      # _codecs._lookup's ways to read a code table

SPLIT_KEYS = 512          # keys per program when rows are few: fixed, so a sequence's bits do not depend on its batch
SPLIT_ROWS = 64           # at most this many rows are split over keys: the per-split states grow with the rows
MIN_DOT = 16              # tl.dot's smallest M, N and K: fewer query rows are padded with zeros


# The kernel's pointer arguments and their element types (the others are i32 or constexprs): what
# compiling it without a device needs (tests, benchmarks/gpu_resources.py).
POINTER_ARGS = {"q_ptr": "*fp32", "q_pos_ptr": "*i32", "k_pool": "*u8", "v_pool": "*u8", "table_ptr": "*i32",
                "lengths_ptr": "*i32", "k_lut": "*fp32", "v_lut": "*fp32",
                "m_out": "*fp32", "l_out": "*fp32", "acc_out": "*fp32", "slots_ptr": "*i64", "q_scale": "fp32",
                "gate_ptr": "*bf16"}


# q's and the output's strides (elements): multiples of head_dim in every launch (heads of head_dim
# columns, rows of whole heads; a decode step's q may be a slice of a wider projection, whose
# rows are whole heads too)
STRIDES = ("q_heads", "q_seqs", "q_rows", "o_heads", "o_seqs", "o_rows")


def aligned_args(fmt_k, fmt_v, head_dim: int) -> tuple[str, ...]:
    """The int arguments a launch marks as multiples of 16 (Triton specialises every such int):
    what an offline compile (``compile_sm90``) must be told to vectorise as a launch does. Row
    sizes in bytes; q's and the output's strides where head_dim is a multiple of 16. Without
    the strides' mark, decode's output store at head_dim 256 compiled to 94 registers instead
    of 71 (f16, Triton 3.6): 64-bit addresses per element, no vector stores."""
    sizes = {"k_row_bytes": fmt_k.row_bytes(head_dim), "v_row_bytes": fmt_v.row_bytes(head_dim)}
    sizes.update(dict.fromkeys(STRIDES, head_dim))
    return tuple(name for name, size in sizes.items() if size % 16 == 0)


def _fields(fmt, head_dim: int) -> CodecFields | None:
    """The format's layout when this kernel decodes it (every layout the C kernel has but klt3's
    per-head rows, the rungs of the nls rows in bytes of their own: sub_bits dividing 8)."""
    fields = codec_fields(fmt, head_dim)
    if fields is None or fields.kind == KLT or (fields.sub_values and 8 % fields.sub_bits):
        return None
    if any(n % 2 for n in (fields.block_bytes, fields.header_bytes, fields.offset_at)):
        return None                     # its f16 fields would be misaligned for the 2-byte loads
    return fields


def _kernel():
    return kernels("_paged_prefill_kernel")             # imports triton: only when a kernel runs


def supports(fmt_k, fmt_v, q: torch.Tensor) -> bool:
    """Whether this kernel serves these formats for q (Hkv, S, R, D) float32: triton is
    importable, q is on a CUDA device (or on the CPU under TRITON_INTERPRET=1), and both
    formats have a layout it decodes. Any number of rows."""
    return q.dtype == torch.float32 and decodes(fmt_k, fmt_v, q.shape[-1], q.device)


def decodes(fmt_k, fmt_v, head_dim: int, device: torch.device) -> bool:
    """Whether this kernel runs on ``device`` here and decodes both formats at ``head_dim``."""
    return (serves("_paged_prefill_kernel", device)
            and _fields(fmt_k, head_dim) is not None and _fields(fmt_v, head_dim) is not None)


@lru_cache(maxsize=None)
def _lut(fmt, head_dim: int, device: str) -> torch.Tensor:
    """The format's code values (32, zero-padded), then its ladder's rungs (32, zero-padded), on the
    kernel's device (``_codecs.decode_tile``'s ``lut``; zeros where the format has none)."""
    fields = codec_fields(fmt, head_dim)
    tables = [torch.zeros(32) if t is None else t for t in (fields.lut, fields.ladder)]
    return torch.cat(tables).to(device)


@lru_cache(maxsize=None)                  # per format, not per launch: the table checks run torch ops
def _codec_args(fmt, head_dim: int, prefix: str, codecs: str = "units") -> dict:
    """A side's layout as the kernel's constexprs, with how it reads its codes: LOOKUP, the way
    its code table is read (``_lookup_mode``), and PHASES, codes per 2-byte load (``_phases``).
    ``codecs="per-value"``: session 31's reading, a load per value, K's table by a compare and
    select per entry, V's by a gather (kept for side-by-side timings: ``gpu_decode.py --sweep``)."""
    f = _fields(fmt, head_dim)
    if codecs == "per-value":
        lookup, phases = (SELECT if prefix == "K" else GATHER), 1
    else:
        phases = _phases(f, head_dim)
        lookup = _lookup_mode(f, prefix, phases)
    return {f"{prefix}_KIND": f.kind, f"{prefix}_BITS": f.bits, f"{prefix}_VALUES": f.block_values,
            f"{prefix}_BYTES": f.block_bytes, f"{prefix}_HEADER": f.header_bytes, f"{prefix}_OFFSET": f.offset_at,
            f"{prefix}_SUB": f.sub_values, f"{prefix}_SUB_BITS": f.sub_bits, f"{prefix}_LOOKUP": lookup,
            f"{prefix}_PHASES": phases}


def _lookup_mode(f: CodecFields, prefix: str, phases: int) -> int:
    """How a side reads its code table (``_codecs._lookup``), from the table's values and how its
    codes come (``phases``): integer steps (q4_0's c - 8) by arithmetic (AFFINE, exact); codes
    read in units from the table held in registers (TABLE, ``tl.gather``); codes read one by one
    (head_dims that are not powers of two, the nls rows), on K by a tree of selects (over half
    of a mirrored table and a sign: turbo's Lloyd-Max tables), on V by a gather from memory.
    Counted in sm_90 SASS at decode's launch (docs/gpu.md): under Triton 3.6, TABLE took
    turbo4/turbo4 from 150 registers (one program per SM) and 1,777 instructions a block of keys
    to 80 registers (three) and 1,374; on codes read one by one it failed to compile (3.6, turbo3)."""
    if f.lut is None:
        return GATHER
    lut = f.lut[:1 << f.bits].double()
    step = torch.arange(len(lut), dtype=torch.float64) * (lut[1] - lut[0])
    if torch.equal(lut, lut.round()) and lut.abs().max() < 2**24 and torch.equal(lut, lut[0] + step):
        return AFFINE
    if phases > 1:
        return TABLE
    if prefix == "V":
        return GATHER
    return MIRROR if torch.equal(lut.flip(0), -lut) else TREE


def _phases(f: CodecFields, head_dim: int) -> int:
    """Codes per group of 2-byte loads where a row's codes can be read in units: 4-, 3-, 2- and
    1-bit codes that fill their block's bytes (q4_0, iq4_nl, q4_1, turbo4, turbo3, turbo2),
    whole blocks and a power-of-two head_dim (the tile's columns then permute the row's values
    exactly). A group is one unit (4 codes of 4 bits, 8 of 2, 16 of 1) or three (16 of 3 bits);
    else 1, a load per value. A unit is 2 bytes because every block starts with an f16: the rows
    are 2-byte aligned, no more."""
    phases = 16 if f.bits == 3 else 16 // f.bits                        # codes per group
    code_bytes = f.block_bytes - f.header_bytes
    codes = (f.kind == NIBBLE and f.bits == 4) or (f.kind == PACKED and f.bits in (1, 2, 3, 4))
    fills = code_bytes * 8 == f.block_values * f.bits and code_bytes % (phases * f.bits // 8) == 0  # whole groups
    whole = head_dim == pow2(head_dim) and head_dim % f.block_values == 0
    return phases if codes and fills and whole and not f.sub_values else 1


# What a caller may override per call (benchmarks/gpu_decode.py --sweep): keys per block, warps,
# software-pipelining stages and how products are taken ("ieee": tl.dot in float32 FMAs;
# "tf32x3": three tensor-core products, float32's accuracy to ~1e-6; "tf32": one, ~1e-3; "f16":
# f16 operands with float32 sums on tensor cores, as llama.cpp and vLLM take them; "fma":
# broadcast products without tl.dot, whose tiles need not be 16 wide, so a decode tile holds
# just its query rows); WIDE: 64-bit row offsets, which the launcher turns on by itself where
# a KV head's pool reaches 2 GB; CODECS: "units" (the default) or "per-value" (``_codec_args``);
# PREFETCH: 1 (or True), each block's pool rows read from the block table a block ahead; 2, its
# packed codes (f16 rows with f16 products) also loaded a block ahead into registers (both off by
# default, untimed); KERNEL "warps": decode by ``_decode_warps_kernel`` (each warp its own keys,
# products on CUDA cores), with KP keys a warp a step and num_warps warps; RESCALE_AT, with one warp:
# how far a row's max grows before its sums are rescaled (8; the tests' 1e30: at the first step only);
# PREFETCH 1 (its default), each step's rows loaded a step ahead; 0, at use. KERNEL "mma": decode by
# ``_decode_mma_kernel`` (one warp a program, the packed codes decoded into tensor-core operands,
# Gluon), N keys a step, and EARLY 1: every load of a step issued before its decoding. COLUMNS:
# where the tile kernel puts a group of units' codes, "adjacent" (the default since session 45:
# side by side) or "strided" (W columns apart, as sessions 32-44 did; ``_codecs.columns``), for a
# lease to time.
CODECS = ("units", "per-value")
COLUMNS = ("adjacent", "strided")
TUNABLE = ("BLOCK_N", "num_warps", "num_stages", "DOT", "WIDE", "CODECS", "PREFETCH", "KERNEL", "KP", "RESCALE_AT",
           "COLUMNS", "N", "EARLY", "L2_AHEAD", "maxnreg")
WARPS_TUNABLE = ("KERNEL", "KP", "num_warps", "WIDE", "RESCALE_AT", "PREFETCH")
WARPS_ROWS = 8            # the warps kernel's most query rows: each lane holds all of them, and their sums
KERNELS = ("tiles", "warps", "mma")
MMA_TUNABLE = ("KERNEL", "N", "WIDE", "PREFETCH", "EARLY", "L2_AHEAD", "maxnreg")
MMA_ROWS = 8              # KERNEL "mma": the GQA group is the products' narrow side, 8 wide
MMA_BLOCK = 128           # ... and it reads blocks of 128 codes with one f16 scale each
DOTS = ("ieee", "tf32x3", "tf32", "f16", "fma")


def _launch_config(fmt_k, fmt_v, n_rows: int, head_dim: int, tune: dict | None = None,
                   page_size: int = 256) -> dict:
    """The kernel's constexprs and warps for one call (``page_size``: the pool's; where an offline
    compile has no pool, the cache's default, ``cache.kv.DEFAULT_PAGE_SIZE``, restated here since
    gpu sits below cache: a test holds the two equal). The page size is a constexpr: finding a key's page
    and row divided by it at run time, about 35 instructions a block of keys (sm_90 SASS, decode's
    launch: turbo4/turbo4 675 -> 609 a block of 16 keys, f16/f16 345 -> 310), a shift and a mask
    for a power of two; a cache has one page size, so one compile. The query tile and its sum (BLOCK_M x
    head_dim floats each) live in registers beside one block of decoded K and V: (rows, warps) =
    (32, 4) at head_dim 64, (32, 8) at 128 and (16, 8) at 256, chosen from spill counts
    (benchmarks/gpu_resources.py); at head_dim 256, 16 keys a block and 8 warps were the
    fastest that session 30's H200 sweep timed (docs/gpu.md). ``tune``: TUNABLE overrides."""
    unknown = set(tune or ()) - set(TUNABLE)
    if unknown:
        raise ValueError(f"not a launch setting: {', '.join(sorted(unknown))} (tunable: {', '.join(TUNABLE)})")
    kernel = (tune or {}).get("KERNEL", "tiles")
    if kernel == "mma":
        return _mma_config(fmt_k, fmt_v, n_rows, head_dim, tune, page_size)
    if kernel != "tiles":
        return _warps_config(fmt_k, fmt_v, n_rows, head_dim, tune, page_size)
    block_m = 16 if head_dim > 128 else 32
    config = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_D=pow2(head_dim),
                  BLOCK_M=min(block_m, max(MIN_DOT, pow2(n_rows))),
                  BLOCK_N=32 if head_dim <= 64 else MIN_DOT, DOT="ieee", WIDE=False,
                  **_codec_args(fmt_k, head_dim, "K"), **_codec_args(fmt_v, head_dim, "V"),
                  num_warps=4 if head_dim <= 64 else 8)
    if F16 in (config["K_KIND"], config["V_KIND"]):
        # f16 rows load 16 bytes at a time, which Triton's software pipelining turns into async
        # copies staged in registers: 255 registers with 168-184 B of spills and one program per
        # SM at head_dim 256 (170-201 registers at 64 and 128). Unpipelined: 48-96 registers, no
        # spills, 4-6 programs per SM (sm_90 cubins, Triton 3.9, benchmarks/gpu_resources.py)
        config["num_stages"] = 1
    for name, owner in (("KP", "warps"), ("RESCALE_AT", "warps"), ("N", "mma"), ("maxnreg", "mma")):
        if name in (tune or {}):
            raise ValueError(f"{name} is a setting of KERNEL='{owner}'")
    tune = dict(tune or {})
    tune.pop("KERNEL", None)
    codecs = tune.pop("CODECS", "units")
    if codecs not in CODECS:
        raise ValueError(f"CODECS={codecs!r}: expected one of {', '.join(CODECS)}")
    order = tune.pop("COLUMNS", "adjacent")
    if order not in COLUMNS:
        raise ValueError(f"COLUMNS={order!r}: expected one of {', '.join(COLUMNS)}")
    config["ADJACENT"] = order == "adjacent"
    if codecs != "units":
        config.update(_codec_args(fmt_k, head_dim, "K", codecs), **_codec_args(fmt_v, head_dim, "V", codecs))
    config.update(tune)
    if config["DOT"] not in DOTS:
        raise ValueError(f"DOT={config['DOT']!r}: expected one of {', '.join(DOTS)}")
    if config.get("PREFETCH", 0) not in (0, 1, 2):                   # False and True are 0 and 1
        raise ValueError(f"PREFETCH={config['PREFETCH']!r}: expected 0 (off), 1 (table rows) or 2 (rows and codes)")
    if config["DOT"] == "fma":                                        # no tl.dot: rows unpadded
        config["BLOCK_M"] = min(block_m, pow2(n_rows))
    return config


@lru_cache(maxsize=None)                  # per format, not per launch (a decode step's switch asks every step)
def _warps_args(fmt, head_dim: int, prefix: str) -> dict | None:
    """A side's constexprs for ``_decode_warps_kernel``, or None where it cannot read the rows:
    f16 and bf16 values, q8_0's bytes, 4-, 3-, 2- and 1-bit codes in 2-byte units (``_phases``;
    3-bit codes half a group of 16 a lane), at a power-of-two head_dim whose row fills a multiple
    of 32 lanes (4-bit codes at head_dim 128 and up, turbo3 and turbo2 at 256)."""
    f = _fields(fmt, head_dim)
    if f is None or f.sub_values or head_dim != pow2(head_dim):
        return None
    if f.kind in (F16, BF16):
        ph = 1
    elif f.kind == Q8 and f.bits == 8 and head_dim % f.block_values == 0 and (f.block_bytes - f.header_bytes) % 2 == 0:
        ph = 2
    elif _phases(f, head_dim) > 1:
        ph = 8 if f.bits == 3 else 16 // f.bits                         # 3-bit: half a group of 16 a lane
    else:
        return None
    if (head_dim // ph) % 32:
        return None
    lookup = _lookup_mode(f, prefix, ph)
    return {f"{prefix}_KIND": f.kind, f"{prefix}_BITS": f.bits, f"{prefix}_VALUES": f.block_values,
            f"{prefix}_BYTES": f.block_bytes, f"{prefix}_HEADER": f.header_bytes, f"{prefix}_OFFSET": f.offset_at,
            f"{prefix}_LOOKUP": lookup, f"{prefix}_PH": ph, f"{prefix}_B2": head_dim // ph // 32}


def reads_by_warps(fmt_k, fmt_v, head_dim: int, n_rows: int) -> bool:
    """Whether KERNEL "warps" decodes these formats at ``head_dim`` for ``n_rows`` query rows a KV head."""
    return (_warps_args(fmt_k, head_dim, "K") is not None and _warps_args(fmt_v, head_dim, "V") is not None
            and pow2(n_rows) <= WARPS_ROWS)


def _warps_config(fmt_k, fmt_v, n_rows: int, head_dim: int, tune: dict, page_size: int) -> dict:
    """The warps kernel's constexprs and warps (``tune`` holds KERNEL "warps"; WARPS_TUNABLE).
    Defaults one warp a program (its sums rescaled only when a row's max grows), one key a warp a
    step (the fewest instructions a key in sm_90 SASS) and rows loaded a step ahead (PREFETCH 1:
    two steps' loads in flight a warp for 2 registers more, turbo4/turbo4 under Triton 3.6):
    untimed; a lease's sweep chooses."""
    if tune["KERNEL"] != "warps":
        raise ValueError(f"KERNEL={tune['KERNEL']!r}: expected one of {', '.join(KERNELS)}")
    other = set(tune) - set(WARPS_TUNABLE)
    if other:
        raise ValueError(f"not a setting of KERNEL='warps': {', '.join(sorted(other))} "
                         f"(it takes {', '.join(WARPS_TUNABLE)})")
    sides = _warps_args(fmt_k, head_dim, "K"), _warps_args(fmt_v, head_dim, "V")
    for fmt, side in zip((fmt_k, fmt_v), sides):
        if side is None:
            raise ValueError(f"KERNEL='warps' does not read {fmt.name} rows at head_dim {head_dim}")
    if pow2(n_rows) > WARPS_ROWS:
        raise ValueError(f"KERNEL='warps' holds at most {WARPS_ROWS} query rows a KV head, not {n_rows}")
    if tune.get("PREFETCH", 0) not in (0, 1):
        raise ValueError(f"PREFETCH={tune['PREFETCH']!r} with KERNEL='warps': expected 0 (off) or 1 (a step ahead)")
    warps, keys = tune.get("num_warps", 1), tune.get("KP", 1)
    return dict(KERNEL="warps", HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=pow2(n_rows), KP=keys, NW=warps,
                WIDE=tune.get("WIDE", False), TIES_UP=_ties_up(), RESCALE_AT=float(tune.get("RESCALE_AT", 8.0)),
                PREFETCH=int(tune.get("PREFETCH", 1)), **sides[0], **sides[1], num_warps=warps)


# KERNEL "mma"'s rows: (codec kind, bits) -> values a block, each block an f16 then its codes (f16
# rows: values as they lie)
MMA_LAYOUTS = {(F16, 16): 1, (Q8, 8): 32, (NIBBLE, 4): 32, (PACKED, 4): MMA_BLOCK, (PACKED, 3): MMA_BLOCK,
               (PACKED, 2): MMA_BLOCK}


@lru_cache(maxsize=None)                  # per format: a decode step's launch asks every step
def _mma_side(fmt, head_dim: int) -> dict | str:
    """A side's constexprs for ``_decode_mma_kernel`` (BITS, BYTES a block, NIBBLES: q4_0's and
    iq4_nl's nibble order), or why it cannot read the format's rows at ``head_dim``: it reads f16,
    q8_0, q4_0 and iq4_nl rows and 4-, 3- and 2-bit codes packed in order through a table after
    one f16 scale a block of 128 (turbo4, turbo3, turbo2), at head_dim 128 or 256."""
    if head_dim not in (MMA_BLOCK, 2 * MMA_BLOCK):
        return f"KERNEL='mma' reads head_dim {MMA_BLOCK} or {2 * MMA_BLOCK}, not {head_dim}"
    f = _fields(fmt, head_dim)
    values = None if f is None else MMA_LAYOUTS.get((f.kind, f.bits))
    if values is None or (f.kind in (PACKED, NIBBLE) and f.lut is None):
        return (f"KERNEL='mma' reads f16, q8_0, q4_0 and iq4_nl rows and 4-, 3- and 2-bit codes through a table "
                f"(turbo4, turbo3, turbo2), not {fmt.name} rows")
    framed = f.kind == F16 or (f.header_bytes, f.block_bytes) == (2, 2 + values * f.bits // 8)
    if f.block_values != values or f.offset_at or f.sub_values or not framed:
        return f"KERNEL='mma' reads blocks of {values} codes after one f16 scale, not {fmt.name}'s layout"
    return {"BITS": f.bits, "BYTES": f.block_bytes, "NIBBLES": f.kind == NIBBLE}


def _mma_refusal(fmt, head_dim: int) -> str | None:
    """Why KERNEL "mma" cannot read a format's rows at ``head_dim`` (``_mma_side``), or None."""
    side = _mma_side(fmt, head_dim)
    return side if isinstance(side, str) else None


def reads_by_mma(fmt_k, fmt_v, head_dim: int, n_rows: int) -> bool:
    """Whether KERNEL "mma" decodes these formats at ``head_dim`` for ``n_rows`` query rows a KV head."""
    return _mma_refusal(fmt_k, head_dim) is None and _mma_refusal(fmt_v, head_dim) is None and n_rows <= MMA_ROWS


def _mma_config(fmt_k, fmt_v, n_rows: int, head_dim: int, tune: dict, page_size: int) -> dict:
    """``_decode_mma_kernel``'s constexprs (``tune`` holds KERNEL "mma"; MMA_TUNABLE): N keys a step
    (16 by default: turbo4/turbo4 172 registers at head_dim 256 in sm_90 SASS, 248 at 32), one warp,
    PREFETCH 0 (the default: table entries read at use) or 1 (a step ahead, as the other kernels'
    PREFETCH 1: 210 registers, 9 programs an SM instead of 11; untimed, the sweep times both).
    maxnreg (a launch option): registers a thread at most, ptxas spilling the rest to local memory
    (128: 16 programs an SM instead of 11, 248 bytes of stack and 22% more instructions a key for
    turbo4/turbo4 at head_dim 256); for the sweep to weigh occupancy against spills. EARLY 0 (the
    default) loads each block of codes where it is decoded; 1, every load of a step first (K's and
    V's codes and norms), so that with PREFETCH 1 a step waits on memory once: 251 registers for
    turbo4/turbo4, 8 programs an SM (untimed). L2_AHEAD 2, 4 or 8: each step asks L2 for the rows
    of the step that many on (untimed; 0, the default, none)."""
    other = set(tune) - set(MMA_TUNABLE)
    if other:
        raise ValueError(f"not a setting of KERNEL='mma': {', '.join(sorted(other))} "
                         f"(it takes {', '.join(MMA_TUNABLE)})")
    for why in (_mma_refusal(fmt_k, head_dim), _mma_refusal(fmt_v, head_dim)):
        if why:
            raise ValueError(why)
    if n_rows > MMA_ROWS:
        raise ValueError(f"KERNEL='mma' holds at most {MMA_ROWS} query rows a KV head, not {n_rows}")
    keys = tune.get("N", 16)
    if keys not in (16, 32, 64):
        raise ValueError(f"N={keys!r} with KERNEL='mma': expected 16, 32 or 64 keys a step")
    if tune.get("PREFETCH", 0) not in (0, 1):
        raise ValueError(f"PREFETCH={tune['PREFETCH']!r} with KERNEL='mma': expected 0 (off) or 1 (table rows a step "
                         "ahead)")
    if tune.get("EARLY", 0) not in (0, 1):
        raise ValueError(f"EARLY={tune['EARLY']!r} with KERNEL='mma': expected 0 (each block's loads where it is "
                         "decoded) or 1 (every load of a step before its decoding)")
    if tune.get("L2_AHEAD", 0) not in (0, 2, 4, 8):
        raise ValueError(f"L2_AHEAD={tune['L2_AHEAD']!r} with KERNEL='mma': expected 0 (off), 2, 4 or 8 (steps on whose "
                         "rows each step asks L2 for)")
    cap = {"maxnreg": tune["maxnreg"]} if "maxnreg" in tune else {}
    if cap and cap["maxnreg"] not in (96, 128, 168):
        raise ValueError(f"maxnreg={cap['maxnreg']!r} with KERNEL='mma': expected 96, 128 or 168 registers a thread")
    sides = {f"{prefix}_{name}": value for prefix, fmt in (("K", fmt_k), ("V", fmt_v))
             for name, value in _mma_side(fmt, head_dim).items()}
    return dict(KERNEL="mma", HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=MMA_ROWS, N=keys,
                WIDE=tune.get("WIDE", False), PREFETCH=int(tune.get("PREFETCH", 0)), EARLY=int(tune.get("EARLY", 0)),
                L2_AHEAD=int(tune.get("L2_AHEAD", 0)), num_warps=1, **sides, **cap)


@lru_cache(maxsize=None)
def _ties_up() -> bool:
    """Whether this Triton orders a load's equally contiguous axes first to last (3.6, the lent
    GPUs'), not last to first (3.9, this machine's): ``_decode_warps_kernel._load`` loads so that
    either way its lanes and warps land where it sums. Read from a probe's compiled layout
    (``first_axis_first``, one small compile a process); where it does not compile (the
    interpreter, for which the order is moot, or a toolchain that refuses it: the order only
    moves time, never a result), from the version: before 3.9 as 3.6."""
    try:
        return kernels("_decode_warps_kernel").first_axis_first()
    except Exception:                   # noqa: BLE001 (any failure to probe: the version's order)
        import triton
        return tuple(int(n) for n in triton.__version__.split(".")[:2]) < (3, 9)


def prefill_state(fmt_k, fmt_v, q_code: torch.Tensor, q_pos: torch.Tensor | None, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                  split_keys: int = SPLIT_KEYS, tune: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_code (Hkv, S, R, D) float32, scaled, in K's code domain; q_pos (S, R) each row's absolute
    position (it sees keys at positions <= it), or None: every row at its sequence's last key
    (decode; nothing computed on the host side); pools (Hkv, pages, page_size, row bytes) uint8;
    table (S, P) int32 pages; lengths (S,) packed keys per sequence, any int type.
    -> m, l (Hkv, S, R, 1) and acc (Hkv, S, R, D), acc in V's code domain, not normalised; a row
    that sees no key gets m = -inf, l = 0, acc = 0. ``split_keys``: keys per program when R is at
    most SPLIT_ROWS; ``tune``: launch overrides (TUNABLE). The launch's sizes come from the shapes
    alone: no host sync."""
    return attend(fmt_k, fmt_v, q_code, q_pos, k_pool, v_pool, table, lengths,
                  split_keys=split_keys, tune=tune)


def attend(fmt_k, fmt_v, q: torch.Tensor, q_pos: torch.Tensor | None, k_pool: torch.Tensor, v_pool: torch.Tensor,
           table: torch.Tensor, lengths: torch.Tensor, scale: float = 1.0, slots: torch.Tensor | None = None,
           length_offset: int = 0, out: torch.Tensor | None = None, split_keys: int = SPLIT_KEYS,
           tune: dict | None = None, gate: torch.Tensor | None = None):
    """``prefill_state``'s launch, with what a decode step's caller can hand over as it lies:
    q (Hkv, S, R, D) of any float type with contiguous rows, at any other strides (a view of the
    layer's (S, H, D) queries), multiplied by ``scale`` as it is read; ``slots`` (S,): the
    table rows the sequences' pages are in (``table`` then the cache's whole table, read at its
    row stride), else row s; ``length_offset`` added to each of ``lengths`` (decode: positions
    + 1, with no launch to add it). ``out`` None: the state, as ``prefill_state``; a float32
    (Hkv, S, R, D) tensor (a view, any strides, contiguous rows): acc / l written into it (the
    softmax's output, the merge folded in), and ``out`` returned. ``gate``: with ``out``, gated
    attention's gate (Hkv, S, R, D) of any float type (contiguous rows, any other strides): the
    output times sigmoid(gate), written in ``out``'s type (``swiglu.sigmoid_mul``'s bits)."""
    n_kv, n_seq, n_rows, dim = q.shape
    page_size = k_pool.shape[2]
    config = _launch_config(fmt_k, fmt_v, n_rows, dim, tune, page_size)
    flags = {"BY_SLOT": slots is not None}
    name = config.pop("KERNEL", "tiles")
    if name != "tiles" and q_pos is not None:
        raise ValueError(f"KERNEL={name!r} decodes (every row at its sequence's last key): q_pos must be None")
    if name == "warps":
        kernel = kernels("_decode_warps_kernel").paged_decode_warps
    elif name == "mma":
        kernel = kernels("_decode_mma_kernel").paged_decode_mma
    else:
        kernel, flags["AT_END"] = _kernel().paged_prefill_tile, q_pos is None
    n_tiles = -(-n_rows // config["BLOCK_M"])
    keys = max(1, table.shape[1] * page_size)
    split_keys = split_keys if n_rows <= SPLIT_ROWS else keys          # many rows: one split, the tiles are enough
    n_splits = -(-keys // split_keys)
    if q.stride(-1) != 1:
        q = q.contiguous()
    table = table.to(torch.int32)
    if table.stride(1) != 1:                        # rows at any stride: a decode step's columns of the table
        table = table.contiguous()
    lengths = lengths.to(q.device).contiguous()
    if q_pos is not None:
        q_pos = q_pos.to(device=q.device, dtype=torch.int32).expand(n_seq, n_rows).contiguous()
    final = out is not None and n_splits == 1                          # the kernel writes the output itself
    if final:
        m = l = acc = out
    else:
        m = torch.empty(n_kv, n_seq, n_splits, n_rows, device=q.device)
        l, acc = torch.empty_like(m), torch.empty(n_kv, n_seq, n_splits, n_rows, dim, device=q.device)
    o_strides = out.stride()[:3] if final else (0, 0, 0)
    gate_args = _gate_args(gate, out, acc)
    luts = [_lut(f, dim, str(q.device)) for f in (fmt_k, fmt_v)]
    head_bytes = k_pool.shape[1] * k_pool.shape[2] * max(k_pool.shape[3], v_pool.shape[3])
    config["WIDE"] |= head_bytes >= 2**31                               # a head's pool past 32-bit offsets
    kernel[(n_kv, n_seq, n_tiles * n_splits)](
        q, lengths if q_pos is None else q_pos, k_pool.contiguous(), v_pool.contiguous(), table, lengths, *luts,
        m, l, acc, n_seq, n_rows, k_pool.shape[1], k_pool.shape[3], v_pool.shape[3], table.stride(0),
        n_splits, split_keys, *q.stride()[:3], scale, lengths if slots is None else slots, length_offset,
        *o_strides, *gate_args, NORMALISE=final, GATED=final and gate is not None, **flags, **config, **FP_FUSION,
        **({} if name == "mma" else pdl(q.device)))         # (the Gluon kernel takes no PDL: launched plainly)
    if final:
        return out
    if n_splits == 1:                                                   # nothing to merge
        return m[:, :, 0, :, None], l[:, :, 0, :, None], acc[:, :, 0]
    return merged(m, l, acc, out=out, gate=gate)


def _gate_args(gate: torch.Tensor | None, out: torch.Tensor | None, stand_in: torch.Tensor) -> tuple:
    """The gate's pointer and (head, sequence, row) strides for a launch, or a stand-in pointer."""
    if gate is None:
        return stand_in, 0, 0, 0
    if out is None or gate.shape != out.shape or gate.stride(-1) != 1 or not gate.is_floating_point():
        raise ValueError(f"a gate of the output's shape {None if out is None else tuple(out.shape)} with contiguous "
                         f"rows expected, got {tuple(gate.shape)} {gate.stride()} {gate.dtype}")
    return gate, *gate.stride()[:3]


# The merge's tile on a GPU: a row a program, 32 splits a step, 64 columns (decode at 128K,
# batch 1, 2 KV heads x 8 rows: 64 programs of 8 steps). The interpreter pays per program, not
# per element (about 6 ms a program), so there the tile is the whole of a head's rows and
# columns: a prompt test's 1,024 programs (32 rows x 4 column tiles x 8) became 8.
MERGE_TILE = {"BLOCK_S": 32, "BLOCK_R": 1, "BLOCK_D": 64}


def _merge_tile(n_splits: int, n_rows: int, dim: int) -> dict:
    if not _kernel().INTERPRETED:
        return dict(MERGE_TILE, BLOCK_D=min(MERGE_TILE["BLOCK_D"], pow2(dim)))
    return {"BLOCK_S": min(64, pow2(n_splits)), "BLOCK_R": pow2(n_rows), "BLOCK_D": pow2(dim)}


def merged(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, tile: dict | None = None,
           out: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """``merge_splits`` in one launch (the torch form launches 10: at 32K keys, 64 splits, every
    decode step's attention layer ran them). ``tile``: BLOCK_S, BLOCK_R, BLOCK_D (``_merge_tile``'s
    by default). ``out``: a (Hkv, S, R, D) tensor (any strides, contiguous rows) to write acc / l
    into, in its type, returned instead of the state; ``gate``: as ``attend``'s."""
    n_kv, n_seq, n_splits, n_rows, dim = acc.shape
    if out is None:
        m_out, l_out = (torch.empty(n_kv, n_seq, n_rows, 1, device=acc.device) for _ in range(2))
        acc_out, o_strides = torch.empty(n_kv, n_seq, n_rows, dim, device=acc.device), (0, 0, 0)
    else:
        m_out = l_out = acc_out = out
        o_strides = out.stride()[:3]
    if acc_out.numel():
        tile = tile or _merge_tile(n_splits, n_rows, dim)
        grid = (n_kv * n_seq, -(-n_rows // tile["BLOCK_R"]), -(-dim // tile["BLOCK_D"]))
        _kernel().merge_splits[grid](m, l, acc, m_out, l_out, acc_out, n_splits, n_rows, n_seq, *o_strides,
                                     *_gate_args(gate, out, acc), HEAD_DIM=dim, **tile, NORMALISE=out is not None,
                                     GATED=gate is not None, num_warps=4, **FP_FUSION, **pdl(acc.device))
    return out if out is not None else (m_out, l_out, acc_out)


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits' states m, l (Hkv, S, n, R) and acc (Hkv, S, n, R, D) -> one state per row,
    m, l (Hkv, S, R, 1) and acc (Hkv, S, R, D): each split rescaled to the common max.
    A split without keys has m = -inf and weighs 0; a row without any keys keeps -inf, 0, 0."""
    top = m.amax(2, keepdim=True)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(m - safe)                                        # (Hkv, S, n, R)
    l_all = (l * weight).sum(2)
    acc_all = (acc * weight.unsqueeze(-1)).sum(2)
    return top.squeeze(2).unsqueeze(-1), l_all.unsqueeze(-1), acc_all
