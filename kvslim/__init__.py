"""kvslim: long-context LLM inference with compressed KV caches on local hardware."""
__version__ = "0.1.0"

from . import formats  # noqa: E402,F401
from .engine import LLM, load  # noqa: E402,F401
