"""GPU kernels (Triton), beside the torch path and the C kernels they mirror.

Nothing here imports triton until a kernel runs, so kvslim imports without it; each kernel
module has ``supports(...)`` saying whether it can serve a call and a torch reference it is
tested against (tests/test_triton_attention.py, under Triton's CPU interpreter).
"""
