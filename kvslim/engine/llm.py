"""The public Python API: ``llm = kvslim.load(...)``; ``llm.generate(...)``; ``llm.logits(...)``."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..loading import load_model
from .config import EngineConfig
from .engine import Engine, Sequence
from .sampling import SamplingParams


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str            # "stop" (EOG token or stop string), "length", "cancelled"
    prompt_tokens: int
    timings: dict
    kv_bytes: int
    state_bytes: int

    @property
    def prompt_tps(self) -> float:
        return self.timings["prompt_per_second"]

    @property
    def gen_tps(self) -> float:
        return self.timings["predicted_per_second"]


@dataclass
class Chunk:
    """One streamed piece: new text (possibly empty), and the completion on the last chunk."""
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion: Completion | None = None


class LLM:
    """A loaded model, its tokenizer and an engine: what ``kvslim.load`` returns."""

    def __init__(self, model, tokenizer, eos_ids: set[int], config: EngineConfig, path: Path | None = None):
        self.model, self.tokenizer, self.path, self.config = model, tokenizer, path, config
        self.engine = Engine(model, tokenizer, config, tokenizer.eog_ids(sorted(eos_ids)))

    def with_cache_types(self, type_k, type_v) -> "LLM":
        """The same weights with other K/V formats (a new, empty cache)."""
        llm = LLM.__new__(LLM)
        llm.model, llm.tokenizer, llm.path = self.model, self.tokenizer, self.path
        llm.engine = self.engine.with_cache_types(type_k, type_v)
        llm.config = llm.engine.config
        return llm

    # ----- tokens ---------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    @property
    def ctx(self) -> int:
        return self.engine.ctx

    @property
    def kv_bytes(self) -> int:
        return self.engine.kv_bytes

    @property
    def state_bytes(self) -> int:
        return self.engine.state_bytes

    # ----- scoring ----------------------------------------------------------------
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits (T, vocab) of a fresh prefill; attention reads K/V through the
        configured cache formats, so the cache types change these logits."""
        return self.engine.score(self._check_ids(token_ids))

    # ----- generation -----------------------------------------------------------
    def generate(self, prompt: str | list[int], max_tokens: int = 128, *, stream: bool = False,
                 stop: list[str] | str | None = None, **sampling) -> Completion | Iterator[Chunk]:
        """Complete ``prompt`` (text or token ids). Sampling keywords: temperature, top_k,
        top_p, min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed."""
        seq = self._submit(prompt, max_tokens, stop, sampling)
        return self._stream(seq) if stream else self._finish(seq)

    def generate_batch(self, prompts: list[str | list[int]], max_tokens: int = 128,
                       stop: list[str] | str | None = None, **sampling) -> list[Completion]:
        """Several prompts decoded together, one forward pass per step (up to n_parallel at once)."""
        if len(prompts) > self.engine.n_parallel:
            raise ValueError(f"{len(prompts)} prompts but n_parallel={self.engine.n_parallel}")
        seqs = []
        try:
            for i, p in enumerate(prompts):
                params = dict(sampling)
                if params.get("seed") is not None:
                    params["seed"] += i                                  # distinct streams per sequence
                seqs.append(self._submit(p, max_tokens, stop, params))
        except Exception:
            for s in seqs:
                self.engine.release(s)
            raise
        return [self._finish(s) for s in seqs]

    def chat(self, messages: list[dict], max_tokens: int = 128, **kw) -> Completion | Iterator[Chunk]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(self.tokenize(prompt, add_special=False), max_tokens, **kw)

    # ----- internals ----------------------------------------------------------------
    def _submit(self, prompt, max_tokens: int, stop, sampling: dict) -> Sequence:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_ids(prompt)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        try:
            params = SamplingParams(**sampling)
        except TypeError as err:
            raise ValueError(f"unknown sampling option: {err}") from None
        return self.engine.submit(ids, max_tokens, params, stops)

    def _finish(self, seq: Sequence) -> Completion:
        try:
            self.engine.run([seq])
        finally:
            self.engine.release(seq)
        return self._completion(seq)

    def _stream(self, seq: Sequence) -> Iterator[Chunk]:
        try:
            while not seq.done:
                before = len(seq.generated)
                self.engine.step()
                text = seq.text.new_text()
                if text or len(seq.generated) > before:
                    yield Chunk(text, seq.generated[before:])
        finally:
            self.engine.release(seq)                                 # also when the consumer stops early
        yield Chunk(seq.text.new_text(), [], seq.finish_reason, self._completion(seq))

    def _completion(self, seq: Sequence) -> Completion:
        return Completion(seq.text.text, seq.generated, seq.finish_reason, len(seq.prompt), seq.timings(),
                          seq.kv_bytes, seq.state_bytes)

    def _check_ids(self, token_ids) -> list[int]:
        ids = [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]
        if not ids:
            raise ValueError("no tokens given")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range 0..{vocab - 1}: {bad[:5]}")
        return ids


def load(path: str | Path | None = None, ctx: int = 4096, cache_type_k: str = "f16", cache_type_v: str = "f16",
         n_parallel: int = 1, n_ubatch: int = 512, dtype=None, device: str | torch.device | None = None,
         weights: str | None = None, allow_dequant: bool = False, config: EngineConfig | None = None,
         **cache_options) -> LLM:
    """Load a Hugging Face folder or GGUF file (default: the bundled model) into an :class:`LLM`.

    Args:
        path: model folder or .gguf file; None for the bundled model.
        ctx: context size per sequence (tokens).
        cache_type_k, cache_type_v: KV formats (see ``kvslim quant``), chosen independently.
        n_parallel: sequences that can run at once (cache slots).
        n_ubatch: tokens per forward pass during prefill (llama.cpp's -ub).
        dtype: weights' dtype (default: as stored).
        device: cpu, cuda, cuda:N or mps (default: cuda when available, else cpu).
        weights: keep a Hugging Face folder's weight matrices in this type: a block type quantized
            at load ("q8_0", "q4_0", ...) or "f16"/"bf16" (half of f32's bytes, computed in ``dtype``).
        allow_dequant: expand GGUF tensors of types that cannot stay quantized instead of refusing.
        config: a ready :class:`EngineConfig` (then ctx ... n_ubatch, device and cache_options are ignored).
        cache_options: ``page_size``, ``f16_window``, ``backend``, and the engine's prefix-cache options.
    """
    if config is None:
        config = EngineConfig.build(ctx, n_parallel, cache_type_k, cache_type_v, device=device, n_ubatch=n_ubatch,
                                    **cache_options)
    model, tokenizer, eos_ids = load_model(path, dtype, config.device, weights, allow_dequant)
    return LLM(model, tokenizer, eos_ids, config, path=path)
