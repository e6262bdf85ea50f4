"""A Gated DeltaNet layer's decode step on a CUDA GPU: three ways, side by side in one run.

    python benchmarks/gpu_delta_step.py [-b 1,4,8] [--slots 8] [--shape 16x32x128x128] [-r 50] [--device cuda]

For one layer of Qwen3.6-35B-A3B's shape (16 key heads, 32 value heads, dk = dv = 128: a 2 MiB
float32 state a sequence) and B sequences among ``--slots`` cache slots (every other slot, so
the batch's slots are not consecutive, as in a server's batch or a CUDA graph's replay):

- ``torch``: ``gated_delta_decode`` on the gathered states, scattered back (the reference, and
  what a device without the kernels runs);
- ``fla-core``: the states gathered, fla-core's fused recurrent launch, its final state copied
  back and scattered (what kvslim ran up to session 36);
- ``delta_step``: kvslim's launch on the slots' states in place (``kvslim.gpu.delta_step``).

Each step is timed twice (``gpu_timing``): launched from Python ("eager ms": the host's launches
included) and replayed from a CUDA graph ("ms": the GPU's own time, as the engine's decode steps
run); medians of ``-r`` samples after a warm-up. Speed-ups and GB/s (of the state bytes a step
must read and write, 2 x B x 2 MiB: the floor of any in-place step) use the graph's. Session
41's figures (0.067 ms for ``delta_step`` at B = 1, 4 and 8 alike) were eager ones: the host's. Figures, not a test: parity is
tests/test_gpu_delta_step.py. Dry run on the CPU (a test runs it): ``TRITON_INTERPRET=1 python
benchmarks/gpu_delta_step.py --device cpu --shape 2x4x16x16 -b 1,2 --slots 4 -r 1`` (fla-core's
row is left out there unless it imports).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvslim.gpu import delta_rule as fla  # noqa: E402
from kvslim.gpu import delta_step as gpu  # noqa: E402
from kvslim.models.delta_rule import gated_delta_decode  # noqa: E402
from kvslim.tables import markdown_table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import check_device, progress, step_ms  # noqa: E402  (same folder)

HEADERS = ["step", "B", "eager ms", "ms", "speed-up on torch", "state GB/s"]


def _inputs(shape: str, batch: int, n_slots: int, device: str, dtype=torch.bfloat16):
    """A layer's raw decode inputs as the layer hands them over, every slot's state, B slots."""
    hk, hv, dk, dv = map(int, shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(batch, hk, dk, generator=gen) * 3).to(dtype) for _ in "qk")
    v = torch.randn(batch, hv, dv, generator=gen).to(dtype)
    a, b = (torch.randn(batch, hv, generator=gen).to(dtype) for _ in "ab")
    A_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    state = torch.randn(n_slots, hv, dk, dv, generator=gen) * 0.1
    slots = torch.arange(0, 2 * batch, 2) % n_slots
    return [t.to(device) for t in (q, k, v, a, b, A_log, dt_bias, state, slots)]


def _steps(inputs) -> dict:
    q, k, v, a, b, A_log, dt_bias, state, slots = inputs

    def gathered(decode):
        def step():
            held = state[slots]
            decode(q, k, v, a, b, A_log, dt_bias, held)
            state[slots] = held
        return step
    steps = {"torch": gathered(gated_delta_decode)}
    if fla._fla() is not None and state.is_cuda:
        steps["fla-core"] = gathered(fla.decode)
    steps["delta_step"] = lambda: gpu.delta_step(q, k, v, a, b, A_log, dt_bias, state, slots)
    return steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-b", "--batches", default="1,4,8")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--shape", default="16x32x128x128", help="key heads x value heads x dk x dv")
    parser.add_argument("-r", "--runs", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only with TRITON_INTERPRET=1 (a dry run)")
    args = parser.parse_args(argv)
    check_device(args.device)
    rows = []
    for batch in map(int, args.batches.split(",")):
        inputs = _inputs(args.shape, batch, max(args.slots, 2 * batch), args.device)
        state_bytes = 2 * batch * inputs[7][0].numel() * 4
        base = None
        for name, step in _steps(inputs).items():
            try:
                eager, ms = step_ms(step, args.runs, args.device)
            except RuntimeError as exc:                  # a launch the graph cannot capture: say so, go on
                rows.append(progress([name, batch, "", str(exc).splitlines()[0][:60], "", ""]))
                continue
            base = base or ms
            rows.append(progress([name, batch, f"{eager:.4f}", f"{ms:.4f}", f"{base / ms:.2f}",
                                  f"{state_bytes / ms / 1e6:.0f}"]))
    print(markdown_table(HEADERS, rows, ["l"] + ["r"] * 5))


if __name__ == "__main__":
    main()
