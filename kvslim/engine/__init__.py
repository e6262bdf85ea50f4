"""Prefill, decode, sampling and scheduling over the model and its caches."""
from .config import EngineConfig, default_device, resolve_device
from .engine import ContextLengthExceeded, Engine, Sequence
from .llm import LLM, Chunk, Completion, load
from .sampling import Sampler, SamplingParams

__all__ = ["EngineConfig", "default_device", "resolve_device", "Engine", "Sequence", "ContextLengthExceeded", "LLM", "Chunk", "Completion", "load", "Sampler",
           "SamplingParams"]
