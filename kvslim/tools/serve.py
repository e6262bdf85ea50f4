"""``kvslim serve``: an OpenAI-compatible server with parallel slots and prefix reuse."""
from __future__ import annotations

import argparse
import time

from ..server import start
from .common import add_model_args, warn_context
from .engine_args import engine_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim serve", description=__doc__)
    add_model_args(p)
    p.add_argument("-np", "--parallel", type=int, default=4, help="sequences decoded together (slots)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("-a", "--alias", default=None, help="model name clients must send (default: folder name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503")
    p.add_argument("--ctx-checkpoints", type=int, default=8, help="recurrent-state checkpoints kept per slot")
    p.add_argument("--checkpoint-mib", type=float, default=256, help="memory cap for all checkpoints (MiB)")
    p.add_argument("--checkpoint-interval", type=int, default=4096,
                   help="also checkpoint every N prompt tokens within long prompts")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    return p


def options_from(args) -> dict:
    checks = [(args.parallel >= 1, "-np must be at least 1"), (args.max_queue >= 0, "--max-queue must be >= 0"),
              (args.ctx_checkpoints >= 0, "--ctx-checkpoints must be >= 0"),
              (0 < args.port < 65536, "--port must be in 1..65535"), (args.ctx_size >= 1, "-c must be >= 1")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if args.ctx_size // args.parallel < 1:
        raise ValueError(f"-c {args.ctx_size} split over -np {args.parallel} slots leaves no context per slot")
    # -c is the total context, split evenly over the slots, as llama-server does
    config = engine_config(args, ctx=args.ctx_size // args.parallel, n_parallel=args.parallel, prefix_cache=True,
                           max_checkpoints=args.ctx_checkpoints, checkpoint_bytes=int(args.checkpoint_mib * (1 << 20)),
                           checkpoint_interval=args.checkpoint_interval)
    return {"model": args.model, "engine_config": config, "dtype": args.dtype,
            "api_key": args.api_key, "alias": args.alias, "max_queue": args.max_queue, "verbose": args.verbose,
            "weights": args.weights, "allow_dequant": args.allow_dequant}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from .. import formats
    formats.get(args.cache_type_k), formats.get(args.cache_type_v)     # refuse bad names before binding
    warn_context(args.model, args.ctx_size // max(args.parallel, 1))
    try:
        server = start(options_from(args), args.host, args.port)
    except OSError as err:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
    print(f"kvslim serve: listening on http://{args.host}:{args.port}/v1 (model loading; /health says when ready)",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0
