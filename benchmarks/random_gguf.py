"""A GGUF of a catalog model's real shape with random quantized weights: what
benchmarks/gpu_model.py builds in kvslim's memory, as a file llama.cpp loads.

    python benchmarks/random_gguf.py /tmp/a3b.gguf [--model qwen3.6-35b-a3b] [-t q4_0] [--seed 0]
    python benchmarks/random_gguf.py /tmp/small.gguf --shrink 16 --layers 4     # a dry run here

It is issue 18's side-by-side with llama.cpp built with CUDA (benchmarks/gpu_session.sh
`llama`): the same dims, layer pattern and weight types as gpu_model.py's model (every matrix
``-t``, the output matrix q6_k as llama-quantize gives it, rows that are not whole blocks in
llama-quantize's fallback type), so the two engines read the same bytes a token. Nothing can be
downloaded to the GPU machine and 35B-A3B at q4_0 is about 20 GB, so the file is made there, in
about a minute, tensor by tensor (never whole in memory):

- Names, shapes and llama.cpp's layouts come from kvslim's GGUF writer run on the model's
  parameters on the meta device (``writer.mapped_tensors``): the file has every tensor
  llama.cpp's loader asks for, in its shape.
- A quantized matrix is POOL_BLOCKS valid blocks (gpu_model.block_pool: the type's encoder on
  N(0, 0.02) values, or random codes under small scales for the K-quants) drawn at random. The
  values are meaningless; the speed does not depend on them, but finite, small weights keep the
  activations finite, and so the routers' choices spread over the experts as trained ones do.
- The tensors llama.cpp keeps in F32 (norms, routers' biases, DeltaNet's decay and conv) get
  N(0, 0.02) values through the writer's conventions (zero-centred norms stored as 1 + w,
  A_log as -exp(A_log)).
- The vocabulary is the bundled model's tokenizer, padded to the config's vocab_size.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_model import OUTPUT_TYPE, block_pool, shrunk_config  # noqa: E402
from kvslim import weights as W  # noqa: E402
from kvslim.gguf import names as N  # noqa: E402
from kvslim.gguf import writer  # noqa: E402
from kvslim.loading import default_model  # noqa: E402
from kvslim.models import parameter_shapes  # noqa: E402
from kvslim.plan.weight_size import fit_type  # noqa: E402

F32 = gguf.GGMLQuantizationType.F32


def plan_tensors(arch: str, config, weights: str, shapes: dict | None = None) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(HF name, GGUF name, GGUF tensor's shape (rows last), type) for every tensor of the file:
    ``f32`` for those llama.cpp keeps in F32, else a weight type name. ``shapes``: the model's
    ``parameter_shapes``, where the caller has them."""
    plan = []
    for hf_name, shape in (shapes or parameter_shapes(config)).items():
        meta = {hf_name: torch.empty(shape, device="meta")}
        for name, t in writer.mapped_tensors(arch, config, meta):
            shape = tuple(t.shape)
            if N.stays_f32(name, t.ndim):
                kind = "f32"
            else:
                kind = fit_type(OUTPUT_TYPE if name == "output.weight" else weights, shape[-1])
            plan.append((hf_name, name, shape, kind))
    return plan


def nbytes(shape: tuple[int, ...], kind: str) -> int:
    if kind == "f32":
        return 4 * int(np.prod(shape))
    return int(np.prod(shape[:-1])) * W.get(kind).row_bytes(shape[-1])


def f32_values(arch: str, config, hf_name: str, shape: tuple[int, ...], name: str, seed: int) -> np.ndarray:
    """The F32 tensor ``name``: N(0, 0.02) values for its Hugging Face tensor, through the
    writer's conventions (the HF tensor of an F32 one is small: a norm, a bias, a conv)."""
    gen = torch.Generator().manual_seed(seed)
    hf = {hf_name: torch.randn(shape, generator=gen) * 0.02}
    return dict(writer.mapped_tensors(arch, config, hf))[name].contiguous().numpy().astype(np.float32)


def random_rows(pool: np.ndarray, shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """(…, row bytes) uint8 of ``shape``'s blocks, each drawn from ``pool``."""
    wtype = W.get(kind)
    n_blocks = int(np.prod(shape)) // wtype.block_size
    return pool[rng.integers(len(pool), size=n_blocks)].reshape(*shape[:-1], -1)


def write(hf_config: dict, out: Path, weights: str, seed: int) -> tuple[int, int]:
    """Write the file; (tensors, bytes of tensor data)."""
    w, arch, config = writer.open_writer(hf_config, default_model(), out, weights)
    shapes = parameter_shapes(config)
    plan = plan_tensors(arch, config, weights, shapes)
    if writer.rope_factors(config) is not None:
        raise ValueError("llama3 rope factors are not written by this script (no catalog model needs them yet)")
    for _, name, shape, kind in plan:
        if kind == "f32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind))
        else:
            byte_shape = (*shape[:-1], W.get(kind).row_bytes(shape[-1]))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes(shape, kind),
                              raw_dtype=W.get(kind).ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(seed)
    pools = {kind: block_pool(W.get(kind), "cpu", gen).numpy() for kind in {k for *_, k in plan if k != "f32"}}
    rng = np.random.default_rng(seed)
    for i, (hf_name, name, shape, kind) in enumerate(plan):
        if kind == "f32":
            data = f32_values(arch, config, hf_name, shapes[hf_name], name, seed + i)
        else:
            data = random_rows(pools[kind], shape, kind, rng)
        w.write_tensor_data(data)
    w.close()
    return len(plan), sum(nbytes(shape, kind) for *_, shape, kind in plan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="qwen3.6-35b-a3b", help="a planner catalog name (kvslim plan --list)")
    ap.add_argument("-t", "--type", default="q4_0", choices=[t for t in writer.QTYPE if t != "f32"],
                    help="the matrices' type (the output matrix: q6_k); the K-quant mixes are not written yet")
    ap.add_argument("--shrink", type=int, default=1, help="divide the widths by this (a dry run)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (a dry run)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        hf_config = shrunk_config(args.model, args.shrink, args.layers)
        n, size = write(hf_config, args.out, args.type, args.seed)
    except ValueError as e:                            # an unknown model, a type llama.cpp has no file type for
        args.out.unlink(missing_ok=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {n} tensors, {size / 2**30:.2f} GiB of weights ({args.model}, {args.type}), "
          f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
