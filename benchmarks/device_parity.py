"""Where two devices part ways: one prompt's forward on the CPU and on a GPU, module by module.

    python benchmarks/device_parity.py [-m MODEL] [-ctk f16] [-ctv f16] [-n 297] [--device cuda]

Loads the model (default: the bundled one) in float32 on both devices, records every module's
output during one prefill (`LLM.logits`), and prints, in the order the CPU ran them, each
module's largest difference relative to the CPU's largest value. Errors carry forward, so the
first module whose row jumps is where the devices start to differ; the decoder layers' rows
show how it grows. Before that, what could make float32 inexact on the GPU: torch's precision
settings, TF32 environment variables, and the relative error of a float32 matmul and of a
depthwise conv1d against float64. Then the logits again with TF32 switched off everywhere.
A diagnosis for the GPU session (benchmarks/gpu_session.sh), not a test: the parity tests are
tests/test_runtime.py::test_cuda_matches_cpu_end_to_end and tests/test_models.py. With
KVSLIM_TRITON=1 the GPU side runs the kernels (the CPU side keeps its own paths): the first
module to part shows which kernel does.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvslim  # noqa: E402
from gpu_timing import check_lists  # noqa: E402


def norm_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative error of ``got`` (any device, any float) against a float64 ``exact``."""
    got = got.cpu().double()
    return ((got - exact).norm() / exact.norm()).item()


def precision_report(device: str) -> None:
    """torch's float32 settings on ``device`` and measured errors of a matmul and a conv1d."""
    b = torch.backends
    print("cuda.matmul.allow_tf32", b.cuda.matmul.allow_tf32, "| cudnn.allow_tf32", b.cudnn.allow_tf32,
          "| fp32_precision: matmul", getattr(b.cuda.matmul, "fp32_precision", "-"),
          "cudnn.conv", getattr(getattr(b.cudnn, "conv", None), "fp32_precision", "-"))
    print("environment:", {k: v for k, v in os.environ.items() if "TF32" in k or "CUBLAS" in k} or "none")
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(512, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    exact = a.double() @ w.double()
    print(f"float32 matmul on {device}: relative error {norm_error(a.to(device) @ w.to(device), exact):.1e} "
          "(ieee ~1e-7, tf32 ~1e-4)")
    x, k = torch.randn(1, 1024, 300, generator=gen), torch.randn(1024, 1, 4, generator=gen)
    exact = F.conv1d(x.double(), k.double(), groups=1024)
    got = F.conv1d(x.to(device), k.to(device), groups=1024)
    print(f"depthwise conv1d on {device}: relative error {norm_error(got, exact):.1e}")


def linear_probes(model, rows: int, device: str) -> None:
    """Every distinct float weight shape of ``model`` (fused projections included): a random
    (rows, in) input through ``F.linear`` with that weight on ``device``, against float64. Session
    30 traced the CPU/GPU drift to layer 0's fused projection, with an error of bf16-rounded
    inputs, while a large probe matmul was exact: this shows which shapes."""
    from kvslim.models.layers import Fused
    seen = {}
    for m in model.modules():
        for w in [getattr(m, "weight", None)] + [getattr(f, "weight", None) for f in vars(m).values()
                                                  if isinstance(f, Fused)]:
            if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_floating_point():
                seen.setdefault(tuple(w.shape), w)
    gen = torch.Generator().manual_seed(1)
    for shape, w in sorted(seen.items()):
        x = torch.randn(rows, shape[1], generator=gen)
        exact = x.double() @ w.detach().cpu().double().t()
        got = F.linear(x.to(device, w.dtype), w.to(device))                  # the weight's dtype, whatever it is
        print(f"F.linear ({rows} x {shape[1]}) by ({shape[0]} x {shape[1]})^T, {w.dtype} on {w.device}: "
              f"relative error {norm_error(got, exact):.1e}")


def module_outputs(llm, ids: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every module's outputs over one prefill (first tensor of a tuple, calls concatenated), in
    call order, and the logits."""
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def record(module, args, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                seen.setdefault(name, []).append(t.detach().float().cpu().flatten())
        return record
    handles = [m.register_forward_hook(hook(n)) for n, m in llm.engine.model.named_modules() if n]
    calls = {}

    def tap(owner, name, label=None):   # functions inside a module's forward: recorded per call
        original, label = getattr(owner, name), label or name

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            calls[label] = calls.get(label, 0) + 1
            hook(f"{label}#{calls[label]}")(None, args, out)
            return out
        setattr(owner, name, recorded)
        return owner, name, original
    from kvslim.cache.kv import KVCache
    from kvslim.models import delta_rule, qwen3_5
    from kvslim.models.layers import Fused
    taps = [tap(Fused, "__call__", "fused"), tap(qwen3_5, "causal_conv"), tap(KVCache, "forward"),
            tap(delta_rule, "chunk_gated_delta_rule", "delta_chunk"), tap(delta_rule, "_native_chunk", "delta_chunk")]
    try:
        logits = llm.logits(ids).cpu()
    finally:
        for h in handles:
            h.remove()
        for owner, name, original in taps:
            setattr(owner, name, original)
    return {n: torch.cat(ts) for n, ts in seen.items()}, logits


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def parse(argv=None) -> argparse.Namespace:
    """The command line, checked before anything loads (a lease's command is checked here too:
    tests/test_gpu_session.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="folder or .gguf (default: the bundled model)")
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("-n", "--tokens", type=int, default=297)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=60, help="modules to print")
    args = ap.parse_args(argv)
    check_lists(ap, {}, ("-ctk/-ctv", f"{args.cache_type_k}/{args.cache_type_v}"))
    if args.tokens < 1 or args.rows < 0:
        ap.error("-n must be at least 1 and --rows at least 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here")
    from kvslim import gpu
    print(f"K/V {args.cache_type_k}/{args.cache_type_v}, {args.tokens} tokens; the Triton kernels and fla-core "
          f"{'on' if gpu.TRITON else 'off'} (KVSLIM_TRITON) on {args.device}")
    precision_report(args.device)
    ids = list(range(3, 3 + args.tokens))
    opts = dict(ctx=max(512, args.tokens + 16), cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                dtype="f32")
    ref, ref_logits = module_outputs(kvslim.load(args.model, device="cpu", **opts), ids)
    llm = kvslim.load(args.model, device=args.device, **opts)
    linear_probes(llm.engine.model, len(ids), args.device)
    got, logits = module_outputs(llm, ids)
    print(f"\nlogits: max |diff| {(logits - ref_logits).abs().max().item():.3e}, relative {relative(logits, ref_logits):.1e}")
    print("\n| module (or function#call) | relative max diff | |\n|---|---:|---|")
    first = None
    for i, (name, t) in enumerate(ref.items()):
        other = got.get(name)
        if other is None or other.shape != t.shape:
            print(f"| {name} | not comparable ({None if other is None else tuple(other.shape)} vs {tuple(t.shape)}) | |")
            continue
        rel = relative(other, t)
        if first is None and rel > 1e-4:
            first = name
        if i < args.rows or name.count(".") <= 2 or name == first:
            print(f"| {name} | {rel:.1e} | {'<- first above 1e-4' if name == first else ''} |")
    # plain float32 everywhere, by both of torch's APIs: the per-backend settings (torch >= 2.9,
    # where cudnn.conv reads "tf32" by default) may win over the legacy flags, and session 30's
    # lease set only the legacy ones (which changed nothing)
    b = torch.backends
    b.cuda.matmul.allow_tf32 = b.cudnn.allow_tf32 = False
    for backend in (b.cuda.matmul, getattr(b.cudnn, "conv", None), getattr(b.cudnn, "rnn", None)):
        if hasattr(backend, "fp32_precision"):
            backend.fp32_precision = "ieee"
    _, no_tf32 = module_outputs(llm, ids)
    print(f"\nfloat32 everywhere (matmul {getattr(b.cuda.matmul, 'fp32_precision', '-')}, cudnn.conv "
          f"{getattr(getattr(b.cudnn, 'conv', None), 'fp32_precision', '-')}): logits max |diff| "
          f"{(no_tf32 - ref_logits).abs().max().item():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
