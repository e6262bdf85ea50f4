"""``kvslim serve``: an OpenAI-compatible server with parallel slots and prefix reuse."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..server import serve
from .common import add_model_args, apply_threads, warn_context
from .engine_args import add_draft_args, engine_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim serve", description=__doc__)
    add_model_args(p)
    ctx = next(a for a in p._actions if "--ctx-size" in a.option_strings)
    ctx.help = "total context (tokens), split evenly over the -np slots as llama-server does"
    backend = next(a for a in p._actions if "--attn-backend" in a.option_strings)
    backend.default = "bf16"      # prompt attention ~2x faster at depth for a KLD of ~1e-6 (docs/speed.md)
    backend.help += "; default bf16: prompts' attention with bf16 operands where the CPU has AVX512_BF16"
    p.add_argument("-np", "--parallel", type=int, default=4, help="sequences decoded together (slots)")
    add_draft_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'X-Api-Key: KEY' (comma-separated: several keys)")
    p.add_argument("--api-key-file", default=None, help="file of accepted API keys, one per line")
    p.add_argument("--allowed-host", action="append", default=[],
                   help="Host name accepted besides loopback names when bound to loopback without a key")
    p.add_argument("-a", "--alias", default=None, help="model name clients must send (default: folder name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503")
    p.add_argument("--ctx-checkpoints", type=int, default=8, help="recurrent-state checkpoints kept per slot")
    p.add_argument("--checkpoint-mib", type=float, default=256, help="memory cap for all checkpoints (MiB)")
    p.add_argument("--checkpoint-interval", type=int, default=4096,
                   help="also checkpoint every N prompt tokens within long prompts")
    p.add_argument("--max-body-mib", type=float, default=8, help="largest request body accepted (MiB)")
    p.add_argument("--read-timeout", type=float, default=30,
                   help="seconds a client has to send a request's headers and body (streams are not limited)")
    p.add_argument("--max-connections", type=int, default=512, help="open connections before answering 503")
    p.add_argument("--grace", type=float, default=8,
                   help="on SIGTERM/SIGINT, seconds until the process has exited: running requests may "
                        "finish until shortly before (min(0.75, grace/2) s are kept for ending them)")
    p.add_argument("--chat-template-file", default=None, help="Jinja chat template to use instead of the model's")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='extra template variables for every request, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--reasoning-format", default="auto", choices=["auto", "none", "deepseek"],
                   help="none: thinking stays in content; deepseek (= auto): <think> blocks go to "
                        "reasoning_content (thinking blocks on /v1/messages)")
    p.add_argument("--strict", action="store_true", help="refuse unknown request fields instead of ignoring them")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    return p


def api_keys(args) -> list[str]:
    """Keys from --api-key (comma-separated) and --api-key-file (one per line); empty keys are refused."""
    keys = []
    if args.api_key is not None:
        keys += [k.strip() for k in args.api_key.split(",")]
        if not all(keys):
            raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without auth")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"--api-key-file {args.api_key_file}: {err.strerror}") from None
        found = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        keys += found
    return keys


def options_from(args) -> dict:
    checks = [(args.parallel >= 1, "-np must be at least 1"), (args.max_queue >= 0, "--max-queue must be >= 0"),
              (args.ctx_checkpoints >= 0, "--ctx-checkpoints must be >= 0"),
              (0 < args.port < 65536, "--port must be in 1..65535"), (args.ctx_size >= 1, "-c must be >= 1"),
              (args.max_body_mib > 0, "--max-body-mib must be > 0"), (args.read_timeout > 0, "--read-timeout must be > 0"),
              (args.max_connections >= 1, "--max-connections must be >= 1"), (args.grace >= 0, "--grace must be >= 0")]
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
            "api_keys": api_keys(args), "alias": args.alias, "max_queue": args.max_queue, "verbose": args.verbose,
            "weights": args.weights, "allow_dequant": args.allow_dequant,
            "max_body": int(args.max_body_mib * (1 << 20)), "read_timeout": args.read_timeout,
            "max_connections": args.max_connections, "grace": args.grace, "strict": args.strict,
            "allowed_hosts": [h.lower() for h in args.allowed_host], "reasoning_format": args.reasoning_format,
            **template_options(args)}


def template_options(args) -> dict:
    """--chat-template-file and --chat-template-kwargs, read and checked before the server starts."""
    out = {}
    if args.chat_template_file:
        try:
            out["chat_template"] = Path(args.chat_template_file).read_text()
        except OSError as err:
            raise ValueError(f"--chat-template-file {args.chat_template_file}: {err.strerror}") from None
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"--chat-template-kwargs is not valid JSON: {err}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object")
        out["chat_template_kwargs"] = kwargs
    return out


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from .. import formats
    formats.get(args.cache_type_k), formats.get(args.cache_type_v)     # refuse bad names before binding
    from ..loading import check_model_path
    check_model_path(args.model)                                        # and a model path that cannot load
    apply_threads(args)
    warn_context(args.model, args.ctx_size // max(args.parallel, 1))
    options = options_from(args)

    def listening():
        print(f"kvslim serve: listening on http://{args.host}:{args.port}/v1 (model loading; /health says when "
              f"ready)", flush=True)
    try:
        return serve(options, args.host, args.port, on_listening=listening)
    except OSError as err:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {err.strerror}") from None
