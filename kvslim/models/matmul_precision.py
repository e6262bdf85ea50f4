"""float32 matmuls of a forward on the CPU in oneDNN's bf16 mode, where that is both faster and
as exact as float32.

With ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, oneDNN splits each float32
operand into bf16 parts and sums their products in float32 (bf16x3): the CPU's bf16 dot
instructions do the work, and the result keeps float32's accuracy. Measured here (AMD EPYC with
AVX512_BF16, 2 threads, torch 2.13):
- (512 x 2048) @ (2048 x 2048): 20.8 ms -> 9.4 ms (2.2x); from 4 rows up 1.6-3.4x; at 1 row
  slower (0.6-0.9x), hence MIN_ROWS.
- Relative error against float64: 2.5e-7 (ieee) -> 5.7e-7; 1 + 2^-12, which bf16 cannot hold,
  times ones sums exactly: not bf16 rounding.
- ``kvslim bench -p 512`` on the bundled model at f32: pp512 7.3K -> 11.2K t/s, q4_0 weights
  6.2K -> 8.9K; tg unchanged (decode takes the C kernels).

The setting is made and undone around each forward (about 1 us) rather than once for the
process: after the per-backend API is used, torch refuses its legacy getter
(``torch.get_float32_matmul_precision()`` raises), which would break a host program that
imported kvslim. It applies only where it pays: the CPU, at least MIN_ROWS tokens, a CPU with
native bf16 dot products (``avx512_bf16`` or ``amx_bf16``; elsewhere oneDNN would emulate them),
and no precision chosen by the user (the backend reads "none"). ``KVSLIM_F32_MATMUL=ieee``
keeps plain float32.

oneDNN does not promise bf16x3: on an Intel Xeon with AMX (the GPU machine's host, session 31)
the same setting rounds the inputs to bf16 once, a relative error of 2.3e-3 on a (297 x 256) by
(256 x 776) product, and every CPU forward there drifted by 5e-3 in its logits. So the mode is
taken only after ``bf16x3_measured`` has seen it keep float32's accuracy on this CPU, on each
kind of product a prompt takes (``PROBES``).
"""
from __future__ import annotations

import contextlib
import os
from functools import lru_cache

import torch

MIN_ROWS = 4


@lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (Linux's cpuinfo flags) and oneDNN is built in."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags)) and torch.backends.mkldnn.is_available()


BF16X3_MAX_ERROR = 1e-5     # bf16x3 measures ~5e-7 on a 256-long dot, one bf16 rounding ~2e-3


# The products the probe takes, as a prompt's forward takes them: a small matmul, a prompt chunk's
# (M, K) @ (K, N), and a batched one (attention's scores). torch 2.11's CPU build on an AMX Xeon
# (session 41) kept float32's accuracy on the first two up to ~300 rows (3e-7) but rounded once
# (4.7e-3) on every bmm and on a 512-row product: a probe of the small one alone took the mode,
# and its prompts' logits moved 5e-3 from plain float32's.
PROBES = ((1, 32, 256, 32), (1, 512, 256, 512), (4, 64, 256, 64))      # (batch, M, K, N)


def product_error(mode: str) -> float:
    """The largest relative error against float64 of the PROBES' float32 products (fixed values)
    on the CPU with oneDNN's ``fp32_precision`` set to ``mode`` for the calls."""
    gen = torch.Generator().manual_seed(0)
    backend, before = torch.backends.mkldnn.matmul, torch.backends.mkldnn.matmul.fp32_precision
    worst = 0.0
    for batch, m, k, n in PROBES:
        a, b = torch.randn(batch, m, k, generator=gen), torch.randn(batch, k, n, generator=gen)
        backend.fp32_precision = mode
        try:
            got = (a[0] @ b[0] if batch == 1 else torch.bmm(a, b)).double()
        finally:
            backend.fp32_precision = before
        exact = (a.double() @ b.double()).reshape(got.shape)
        worst = max(worst, ((got - exact).norm() / exact.norm()).item())
    return worst


@lru_cache(maxsize=None)
def bf16x3_measured() -> bool:
    """Whether oneDNN's bf16 mode keeps float32's accuracy here (the PROBES, a few ms, once)."""
    return product_error("bf16") < BF16X3_MAX_ERROR


MODES = ("bf16x3", "ieee")      # KVSLIM_F32_MATMUL's values


def prompt_mode(device: torch.device | str = "cpu") -> str:
    """How a prompt's float32 matmuls run on ``device``: "bf16x3" or "ieee" (benchmark records).
    A KVSLIM_F32_MATMUL that is neither is refused, not read as the default."""
    asked = os.environ.get("KVSLIM_F32_MATMUL", "bf16x3")
    if asked not in MODES:
        raise ValueError(f"KVSLIM_F32_MATMUL={asked!r}: expected one of {', '.join(MODES)}")
    on = (torch.device(device).type == "cpu" and asked == "bf16x3" and native_bf16()
          and torch.backends.mkldnn.matmul.fp32_precision == "none" and bf16x3_measured())
    return "bf16x3" if on else "ieee"


def applies(tokens: torch.Tensor) -> bool:
    """Whether a forward over ``tokens`` (its ids) takes the bf16x3 matmuls."""
    return tokens.numel() >= MIN_ROWS and prompt_mode(tokens.device) == "bf16x3"


@contextlib.contextmanager
def prompt_matmuls(tokens: torch.Tensor):
    """Within: float32 matmuls in bf16x3 where ``applies``; the setting restored on exit."""
    if not applies(tokens):
        yield
        return
    backend = torch.backends.mkldnn.matmul
    backend.fp32_precision = "bf16"
    try:
        yield
    finally:
        backend.fp32_precision = "none"
