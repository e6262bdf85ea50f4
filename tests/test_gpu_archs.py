"""The kernels kvslim's users' GPUs run, compiled for them without one: RTX 4090 (sm_89) and RTX
5090 (sm_120), the 24-32 GB cards the project is for; the other tests compile
for the H100/H200 (sm_90), the lent GPUs. These cards have no wgmma (Triton takes mma.sync for
tl.dot) and allow a program 99 KB of shared memory where an H100 allows 227 KB (the CUDA
programming guide's table; a launch past it fails with Triton's OutOfResources), so each
kernel's launch settings must compile there and fit. One launch setting each, as the model's
decode and prefill steps take them: decode attention with f16 products (the bf16 backend's),
decode by mma (Gluon, mma.sync: its default launch and every load first),
prefill attention with float32 products, the 1-row Q4_0 GEMV on 8-bit activations (dp4a), the
Q4_K GEMM on bf16 tensor cores, the append and the rotation.
"""
from __future__ import annotations

import pytest

from kvslim import formats, weights
from kvslim.gpu import kv_append, paged_prefill, quant_matmul
from kvslim.gpu import rotation as gpu_rotation

from .triton_harness import compile_for_sm90

tl = pytest.importorskip("triton.language", reason="triton is not installed")

# sm_86 (RTX 3090) lowers these kernels as sm_89 does (they take no fp8): compiled once by hand
# (session 41, Triton 3.6 and 3.9: the same shared memory), not in the suite
CARDS = {89: "RTX 4090", 120: "RTX 5090"}
SHARED_LIMIT = 99 * 1024           # bytes a program may take on compute capability 8.6, 8.9 and 12.0


def _attention(rows: int, pair: str, dot: str) -> tuple:
    from kvslim.gpu import _paged_prefill_kernel as kernel
    fmt_k, fmt_v = (formats.get(name, role=role) for name, role in zip(pair.split("/"), "kv"))
    config = paged_prefill._launch_config(fmt_k, fmt_v, rows, 256, {"DOT": dot})
    if rows <= paged_prefill.SPLIT_ROWS:                               # a decode step's launch
        config.update(AT_END=True, BY_SLOT=True)
    pointers = dict(paged_prefill.POINTER_ARGS, q_ptr="*bf16")
    return kernel.paged_prefill_tile, pointers, config, paged_prefill.aligned_args(fmt_k, fmt_v, 256)


def _mma(pair: str, tune: dict) -> tuple:
    from kvslim.gpu import _decode_mma_kernel as kernel
    fmt_k, fmt_v = (formats.get(name, role=role) for name, role in zip(pair.split("/"), "kv"))
    config = paged_prefill._launch_config(fmt_k, fmt_v, 8, 256, {"KERNEL": "mma", **tune})
    config.pop("KERNEL")
    return (kernel.paged_decode_mma, dict(paged_prefill.POINTER_ARGS, q_ptr="*bf16"), dict(config, BY_SLOT=True),
            paged_prefill.aligned_args(fmt_k, fmt_v, 256))


def _q8_gemv() -> tuple:
    from kvslim.gpu import _quant_matmul_kernel as kernel
    q4_0 = weights.get("q4_0").ggml_type
    config = quant_matmul.gemv_config(1, q4_0)
    assert quant_matmul.q8_config(config, q4_0, 1, True)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "grid_ptr": "*i8", "y_ptr": "*bf16", "parts_ptr": "*fp32",
                "count_ptr": "*i32"}
    return kernel.quant_gemv, pointers, dict(config, TYPE=int(q4_0), Q8=2), ()


def _gemm() -> tuple:
    from kvslim.gpu import _quant_matmul_kernel as kernel
    pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "grid_ptr": "*fp32", "y_ptr": "*bf16"}
    return kernel.quant_gemm, pointers, dict(quant_matmul.gemm_config(4096), TYPE=int(weights.get("q4_k").ggml_type),
                                             DOT_DTYPE=tl.bfloat16, PRECISION="ieee"), ("K", "row_bytes")


def _append() -> tuple:
    from kvslim.gpu import _kv_append_kernel as kernel
    fmt = formats.get("turbo4", role="k")
    pointers = {"x_ptr": "*bf16", "pool": "*u8", "x2_ptr": "*bf16", "pool2": "*u8", "table_ptr": "*i32",
                "slots_ptr": "*i64", "pos_ptr": "*i64", "flags_ptr": "*u8", "rot_m": "*fp32", "bounds": "*fp32",
                "cents": "*fp32", "tries": "*fp32", "ladder": "*fp32", "limit": "fp32", "rot_scale": "fp32"}
    config = kv_append.kernel_config(kv_append._launch_config(fmt.kernel_encoder(256), 256, fmt.row_bytes(256)), 2, 16)
    return kernel.kv_append_rows, pointers, config, ()


def _rotation() -> tuple:
    from kvslim.gpu import _rotation_kernel as kernel
    pointers = {"x_ptr": "*fp32", "m_ptr": "*fp32", "out_ptr": "*fp32", "rot_scale": "fp32"}
    return kernel.rotate_rows, pointers, gpu_rotation.launch_config(256, 128, None, False), ()


KERNELS = {"decode attention turbo4/turbo4 f16 dots": lambda: _attention(8, "turbo4/turbo4", "f16"),
           "decode by mma turbo4/turbo4": lambda: _mma("turbo4/turbo4", {}),
           "decode by mma q8_0/turbo3, loads early": lambda: _mma("q8_0/turbo3", {"PREFETCH": 1, "EARLY": 1}),
           "prefill attention q8_0/turbo4": lambda: _attention(512, "q8_0/turbo4", "ieee"),
           "q4_0 gemv on 8-bit activations": _q8_gemv, "q4_k gemm bf16": _gemm,
           "append turbo4": _append, "rotation": _rotation}


@pytest.mark.parametrize("capability", CARDS, ids=lambda c: CARDS[c].replace(" ", "-"))
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_compile_and_fit_the_rtx_cards(kernel, capability):
    fn, pointers, config, divisible = KERNELS[kernel]()
    config = dict(config)
    num_warps = config.pop("num_warps", 4)
    compiled = compile_for_sm90(fn, pointers, config, num_warps, divisible, capability=capability)
    assert compiled.asm["cubin"] and compiled.metadata.shared <= SHARED_LIMIT, compiled.metadata.shared
    if kernel.startswith("q4_0 gemv"):
        assert "dp4a.s32.s32" in compiled.asm["ptx"]
    if kernel.startswith("decode by mma"):       # the Ampere mma these cards have, and nothing shared
        assert "mma.sync.aligned.m16n8k16" in compiled.asm["ptx"] and compiled.metadata.shared == 0
