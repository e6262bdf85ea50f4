"""GPU kernels (Triton), beside the torch path and the C kernels they mirror.

Nothing here imports triton until a kernel runs, so kvslim imports without it; each kernel
module has ``supports(...)`` saying whether it can serve a call and a torch reference it is
tested against (tests/test_triton_attention.py, under Triton's CPU interpreter).
"""
import os

# Whether the kernels (these and fla-core's) serve where they can. Off by default until a GPU
# run has held them to the torch paths (docs/gpu.md: written and checked under Triton's
# interpreter, not yet run compiled on a GPU); KVSLIM_TRITON=1 turns them on. Benchmarks flip
# it in-process to time both paths.
TRITON = os.environ.get("KVSLIM_TRITON", "0") == "1"
