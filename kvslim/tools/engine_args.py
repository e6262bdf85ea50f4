"""The engine flags every tool shares (--device, --attn-backend, --compile, --cuda-graphs, --native, --f16-window),
the generating tools' --draft-max, and the one place where
parsed arguments become an :class:`EngineConfig`."""
from __future__ import annotations

import argparse

from ..cache import backend_names
from ..engine.config import EngineConfig


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or mps (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--attn-backend", default="torch", choices=backend_names(),
                   help="attention backend over the paged KV pool (reference: the slow oracle; bf16: prompts' "
                        "attention with bf16 operands and float32 sums, on CPUs with AVX512_BF16)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="decode through torch.compile (the first steps compile, cached on disk under "
                        "~/.cache/kvslim/inductor; default: eager)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from CUDA graphs recorded per batch size (one launch a token "
                        "instead of thousands; default: on for CUDA devices)")
    p.add_argument("--f16-window", type=int, default=0, metavar="N",
                   help="keep each sequence's newest N tokens' K and V in f16 and pack a token only when it "
                        "leaves (KIVI's residual; 64 tokens cut nl3s's KLD by 37%% in docs/eval-kld-formats.md; "
                        "default 0)")
    p.add_argument("--native", action=argparse.BooleanOptionalAction, default=True,
                   help="decode steps in C where the model, weights and K/V formats allow "
                        "(--no-native: the torch steps, compiled with --compile)")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-max", "--draft", type=int, default=0, metavar="N",
                   help="speculative decoding with prompt-lookup drafts of up to N tokens (what followed the "
                        "context's last 2-3 tokens where they appeared before; vLLM's ngram method): faster "
                        "wherever the reply repeats its input, as code edits do; 0: off (default)")


def engine_config(args, *, ctx: int | None = None, n_parallel: int = 1, type_k: str | None = None,
                  type_v: str | None = None, **engine) -> EngineConfig:
    """An EngineConfig from a tool's parsed flags; keywords override what the flags say."""
    return EngineConfig.build(
        ctx if ctx is not None else args.ctx_size, n_parallel,
        type_k if type_k is not None else args.cache_type_k,
        type_v if type_v is not None else args.cache_type_v,
        device=getattr(args, "device", None), backend=getattr(args, "attn_backend", "torch"),
        f16_window=getattr(args, "f16_window", 0),
        n_ubatch=args.ubatch_size, compile=getattr(args, "compile", False),
        native=getattr(args, "native", True), cuda_graphs=getattr(args, "cuda_graphs", None),
        **{"draft_max": getattr(args, "draft_max", 0), **engine})
