"""What the tools share: the model/cache/sampling flags (llama.cpp's names) and context checks.
The output helpers (markdown tables, JSON, CSV) live one layer down, in ``kvslim.tables``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


# ----- flags several tools take -------------------------------------------------------------
def add_load_args(p: argparse.ArgumentParser, dtype: str | None = None) -> None:
    """How the model is loaded (every tool that loads one): -m, --dtype, --weights, --allow-dequant."""
    from ..weights import encodable_names

    p.add_argument("-m", "--model", default=None, help="HF folder or .gguf file (default: the bundled model)")
    p.add_argument("--dtype", default=dtype,
                   help=f"weights dtype: f32, bf16, f16 (default: {dtype or 'as stored'})")
    p.add_argument("--weights", default=None, choices=encodable_names(), type=str.lower,
                   help="keep a Hugging Face folder's weight matrices in this type: ggml blocks (quantized at "
                        "load) or f16/bf16 (computed in --dtype); a GGUF keeps its own types")
    p.add_argument("--allow-dequant", action="store_true",
                   help="expand GGUF tensors of types that cannot stay quantized instead of refusing the file")
    add_threads_arg(p)
    from .engine_args import add_device_args
    add_device_args(p)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """llama.cpp's -t: every CPU kernel kvslim runs (torch's and its own C kernels, which read torch's
    thread count) uses this many threads."""
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: torch's, one per core; on a machine busy with other work, "
                        "fewer are often faster)")


def apply_threads(args) -> None:
    """Set the thread count -t asked for, before anything loads; 0 or less is a mistake, not 'default'."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"-t must be at least 1, got {threads}")
    import torch
    torch.set_num_threads(threads)


def load_kwargs(args) -> dict:
    """``kvslim.load`` keywords from the flags of ``add_load_args``."""
    return dict(dtype=args.dtype, weights=args.weights, allow_dequant=args.allow_dequant)


def add_model_args(p: argparse.ArgumentParser, dtype: str | None = None,
                   ctx_help: str = "context size per sequence (tokens)") -> None:
    """The model/cache options of the tools that run one K/V pair (run, serve, eval), llama.cpp's names."""
    from .. import formats

    add_load_args(p, dtype)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help=ctx_help)
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="K cache type: " + ", ".join(formats.names()))
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="V cache type (same choices)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="tokens per forward pass in prefill")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from the logit of each token seen in the last --repeat-last-n")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted times each token's count in the last --repeat-last-n")
    p.add_argument("--ignore-eos", action="store_true", help="never end at an end-of-generation token")
    p.add_argument("-s", "--seed", type=int, default=None)


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                ignore_eos=args.ignore_eos, seed=args.seed)


def check_output(path: str | Path | None, what: str, make_folder: bool = False) -> None:
    """Refuse an output file that cannot be written before the work that fills it, not after;
    ``make_folder``: create its folder instead, as convert and imatrix do."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path}: it is a folder; give the output file's name")
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    elif not path.resolve().parent.is_dir():
        raise ValueError(f"{what} {path}: its folder does not exist")


# ----- context checks -------------------------------------------------------------------------
def context_warnings(model: str | None, ctx_per_seq: int) -> list[str]:
    """What llama.cpp warns about when a sequence's context passes what the model was made for:
    its position limit (config max_position_embeddings, GGUF context_length), and for the bundled
    model the 4096 tokens it was trained on. Reads the config only; a bad path is left to the loader."""
    from .. import plan
    from ..data import BUNDLED_TRAINED_CONTEXT
    from ..loading import BUNDLED

    try:
        config = plan.resolve_model(str(model or BUNDLED)).config
    except (ValueError, OSError):
        return []
    limit = plan.context_limit(config)
    if limit and ctx_per_seq > limit:
        return [f"-c {ctx_per_seq} per sequence is past the model's context limit of {limit} tokens "
                f"(max_position_embeddings): positions beyond it were never trained"]
    if model is None and ctx_per_seq > BUNDLED_TRAINED_CONTEXT:
        return [f"-c {ctx_per_seq}: the bundled model was trained on sequences of at most "
                f"{BUNDLED_TRAINED_CONTEXT} tokens; past that its retrieval falls off (its card: 86% at 8K, "
                f"36% at 16K)"]
    return []


def warn_context(model: str | None, ctx_per_seq: int) -> None:
    for line in context_warnings(model, ctx_per_seq):
        print(f"warning: {line}", file=sys.stderr, flush=True)
