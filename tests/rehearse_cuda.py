"""A pytest plugin that runs the CUDA-marked kernel tests' own code without a GPU.

The tests that call the compiled kernels on CUDA tensors skip here, so their code first runs
in a lease's few minutes; session 38 found that ``test_compiled_kernels_on_cuda_...`` handed
the bf16-rounding cases' list of outputs to a check that wants one tensor, which would have
failed on the GPU. With this plugin (and TRITON_INTERPRET=1, so the kernels run interpreted
on CPU tensors) ``torch.cuda.is_available()`` says True, ``.cuda()`` leaves a tensor where it
is and ``compiled_process`` no longer skips: what the tests check is exercised, what the
compiled kernels do is not (the bf16 GEMM's tl.dot is wrong in the interpreter: those cases
fail here and are deselected). ``bash benchmarks/gpu_session.sh rehearse`` runs it; not part
of the suite.
"""
import torch

import tests.triton_harness as harness

torch.cuda.is_available = lambda: True
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.nn.Module.cuda = lambda self, *args, **kwargs: self
harness.compiled_process = lambda: None
try:                  # fla-core's autotuned kernels: no device to time configs on, so every config times the same
    from triton.runtime.autotuner import Autotuner
    Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]
except ImportError:
    pass
