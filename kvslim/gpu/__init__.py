"""GPU kernels (Triton, and fla-core's for DeltaNet), beside the torch paths and C kernels they mirror.

``paged_prefill`` / ``paged_decode``: attention on the packed pages (one kernel); ``kv_append``:
new K/V rows encoded into the pool; ``quant_matmul``: GGUF weights' GEMV/GEMM; ``delta_rule``:
fla-core's gated delta rule. Nothing here imports triton until a kernel runs, so kvslim imports
without it; each kernel module has ``supports(...)`` saying whether it can serve a call and a
torch reference it is tested against (tests/test_triton_*.py, under Triton's CPU interpreter;
docs/gpu.md).
"""
import os
from functools import lru_cache

import torch

# Whether the kernels (these and fla-core's) serve where they can. Off by default until a GPU
# run has held them to the torch paths (docs/gpu.md: written and checked under Triton's
# interpreter, not yet run compiled on a GPU); KVSLIM_TRITON=1 turns them on. Benchmarks flip
# it in-process to time both paths.
TRITON = os.environ.get("KVSLIM_TRITON", "0") == "1"


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether triton imports (it is not a dependency of kvslim)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): Triton's block shapes."""
    return 1 << max(0, n - 1).bit_length()


def runs_on(kernel_module, device: torch.device) -> bool:
    """Whether a kernel module's kernels run on ``device`` here: compiled ones on CUDA tensors,
    interpreted ones (TRITON_INTERPRET=1, numpy) on CPU tensors. Triton fixes which when a
    kernel is decorated: the module's ``INTERPRETED``; ``RUNNABLE`` says whether triton.language's
    own functions (decorated when triton was first imported) agree with it."""
    return kernel_module.RUNNABLE and device.type == ("cpu" if kernel_module.INTERPRETED else "cuda")
