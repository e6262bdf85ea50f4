"""``kvslim`` command: one thin sub-command per tool over the same library."""
from __future__ import annotations

import importlib
import sys

# sub-command -> (module under kvslim.tools, one-line help)
COMMANDS = {
    "demo": ("demo", "the bundled model end to end: generation and f16 vs compressed KV side by side"),
    "eval": ("eval", "quality per K/V pair: ppl, kld, depth, niah, ruler, sampling, attention"),
    "calibrate": ("calibrate", "measure a model's value vectors on text, for the klt V formats (-ctv klt3)"),
    "quant": ("quant", "measure KV formats on random vectors: bits, error, speed"),
    "plan": ("plan", "will a model, context and K/V cache fit on a machine? (before anything loads)"),
    "run": ("run", "complete a prompt; print timings and KV/state memory"),
    "bench": ("bench", "llama-bench-style pp/tg speed at depth, swept over K/V types"),
    "serve": ("serve", "OpenAI-compatible server: parallel slots, streaming, prefix reuse"),
    "convert": ("convert", "Hugging Face folder -> GGUF (f16, bf16, q8_0, q4_0, ..., K-quants via llama.cpp)"),
    "imatrix": ("imatrix", "a model's importance matrix on text, for llama.cpp's quantizer (IQ1/IQ2 need one)"),
}


def usage() -> str:
    lines = ["usage: kvslim COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvslim COMMAND -h' for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"kvslim: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"kvslim.tools.{COMMANDS[argv[0]][0]}")
    try:
        return module.main(argv[1:]) or 0
    except ValueError as err:  # users' mistakes surface as ValueError with a clear message
        print(f"kvslim {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except NotImplementedError as err:  # an op the device's torch backend lacks (MPS): name it
        message = missing_op_message(err)
        if message is None:
            raise
        print(f"kvslim {argv[0]}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (tools that stream print their timings first)
        print(f"\nkvslim {argv[0]}: interrupted", file=sys.stderr)
        return 130


def missing_op_message(err: NotImplementedError) -> str | None:
    """torch's "operator 'aten::x' is not currently implemented for the MPS device" as one line
    that names the op and the two ways out; None for any other NotImplementedError."""
    import re

    text = str(err)
    found = re.search(r"operator '([^']+)' is not currently implemented for the (\w+) device", text)
    if found is None:
        return None
    op, device = found.groups()
    import torch
    return (f"torch {torch.__version__} has no {device} kernel for {op}, which kvslim's torch backend uses; "
            f"run with PYTORCH_ENABLE_MPS_FALLBACK=1 to compute that op on the CPU, or use --device cpu")


if __name__ == "__main__":
    sys.exit(main())
