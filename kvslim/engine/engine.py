"""The step loop: continuous batching over cache slots.

Each ``step`` builds one flattened batch: every decoding sequence contributes
its newest token, then sequences still reading their prompt contribute a chunk
of it, within a budget of ``n_ubatch`` tokens (llama.cpp's ``-ub``). One forward
pass serves them all; sequences whose pending tokens are all in the cache get
a new token sampled. New sequences may join between any two steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..models import Batch
from ..models.base import CausalLM
from ..tokenizer import Tokenizer
from .prefix import PrefixCache
from .sampling import Sampler, SamplingParams
from .text import TextStream


class ContextLengthExceeded(ValueError):
    def __init__(self, n_prompt: int, ctx: int):
        super().__init__(f"the prompt has {n_prompt} tokens but the context holds {ctx}; "
                         f"shorten the prompt or raise -c")
        self.n_prompt, self.ctx = n_prompt, ctx


@dataclass
class Sequence:
    """One request's state as it moves through the engine."""

    id: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    text: TextStream
    slot: int = -1
    tokens: list[int] = field(default_factory=list)      # prompt + generated
    n_cached: int = 0                                      # tokens already in the cache
    finish_reason: str | None = None
    prompt_s: float = 0.0
    gen_s: float = 0.0
    cached_tokens: int = 0                                 # prompt tokens reused from the slot's cache
    kv_bytes: int = 0                                      # this sequence's cache bytes when it finished
    state_bytes: int = 0
    error: str | None = None                               # why sampling failed (finish_reason "error")

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.n_cached:]

    def timings(self) -> dict:
        n_gen = len(self.generated)
        return {"prompt_n": len(self.prompt), "prompt_ms": 1000 * self.prompt_s,
                "prompt_per_second": len(self.prompt) / self.prompt_s if self.prompt_s else 0.0,
                "predicted_n": n_gen, "predicted_ms": 1000 * self.gen_s,
                # the first token comes from the prefill's logits; decode steps made the rest
                "predicted_per_second": (n_gen - 1) / self.gen_s if self.gen_s and n_gen > 1 else 0.0}


class Engine:
    """Owns the caches and the slots; ``submit`` then ``step`` until sequences are done.

    With ``prefix_cache`` a released slot keeps its contents, and a new prompt
    goes to the slot sharing its longest reusable prefix (see ``prefix.py``).
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, ctx: int, n_parallel: int = 1,
                 type_k: str = "f16", type_v: str = "f16", n_ubatch: int = 512, eog_ids: set[int] = frozenset(),
                 prefix_cache: bool = False, max_checkpoints: int = 8, checkpoint_bytes: int = 256 << 20,
                 checkpoint_interval: int = 4096, **kv_options):
        if ctx < 1 or n_parallel < 1 or n_ubatch < 1:
            raise ValueError(f"ctx, n_parallel and n_ubatch must be >= 1 (got {ctx}, {n_parallel}, {n_ubatch})")
        self.model, self.tokenizer = model, tokenizer
        self.ctx, self.n_parallel, self.n_ubatch = ctx, n_parallel, n_ubatch
        self.type_k, self.type_v = type_k, type_v
        self.caches = model.make_cache(ctx, n_parallel, type_k, type_v, **kv_options)
        self.eog_ids = set(eog_ids)
        self.free_slots = list(range(n_parallel))
        self.prefix = PrefixCache(self.caches, n_parallel, max_checkpoints, checkpoint_bytes) if prefix_cache else None
        self.checkpoint_interval = checkpoint_interval
        self.running: list[Sequence] = []
        self._next_id = 0

    # ----- memory ---------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches if c.kind == "kv")

    @property
    def state_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches if c.kind == "recurrent")

    # ----- sequences ------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: list[str] | None = None) -> Sequence:
        """Start a sequence in a free slot (raises when the prompt cannot fit or no slot is free)."""
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt) >= self.ctx:
            raise ContextLengthExceeded(len(prompt), self.ctx)
        if not self.free_slots:
            raise RuntimeError("no free slot: all n_parallel sequences are busy")
        seq = Sequence(self._next_id, list(prompt), max_tokens, Sampler(sampling),
                       TextStream(self.tokenizer, stop or []), tokens=list(prompt))
        self._next_id += 1
        self._assign_slot(seq)
        self.running.append(seq)
        return seq

    def _assign_slot(self, seq: Sequence) -> None:
        if self.prefix is None:
            seq.slot = self.free_slots.pop(0)
            for cache in self.caches:
                cache.clear(seq.slot)
            return
        seq.slot, _ = self.prefix.pick(self.free_slots, seq.prompt)
        self.free_slots.remove(seq.slot)
        seq.n_cached = seq.cached_tokens = self.prefix.restore(seq.slot, seq.prompt)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot (its cache contents are dropped)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.finish_reason is None:
            seq.finish_reason = "cancelled"
            self._record_memory(seq)
        if seq.slot >= 0 and seq.slot not in self.free_slots:
            if self.prefix is not None:                             # keep the contents for the next request
                self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=False)
            else:
                for cache in self.caches:
                    cache.clear(seq.slot)
            self.free_slots.append(seq.slot)

    def step(self) -> list[Sequence]:
        """One forward pass over all running sequences; returns those that got a new token."""
        plan = self._plan()
        if not plan:
            return []
        t0 = time.perf_counter()
        batch = Batch.build([(seq.slot, chunk, seq.n_cached) for seq, chunk in plan],
                            device=self.model.output_weight.device)
        logits = self.model(batch, self.caches)
        elapsed = time.perf_counter() - t0
        advanced = []
        for row, (seq, chunk) in enumerate(plan):
            if seq.n_cached < len(seq.prompt):                      # this step read (part of) its prompt
                seq.prompt_s += elapsed
            else:
                seq.gen_s += elapsed
            seq.n_cached += len(chunk)
            if self.prefix is not None and seq.n_cached <= len(seq.prompt):
                self._checkpoint_prompt(seq)
            if not seq.pending:                                     # everything read: predict
                try:
                    self._accept(seq, seq.sampler(logits[row], seq.tokens))
                except Exception as err:                            # this request's failure ends it alone
                    seq.error, seq.finish_reason = f"{type(err).__name__}: {err}", "error"
                    seq.text.finish()
                advanced.append(seq)
        return advanced

    def _plan(self) -> list[tuple[Sequence, list[int]]]:
        """Decoding sequences first (one token each), then prompt chunks within the budget."""
        budget, plan = self.n_ubatch, []
        active = [s for s in self.running if not s.done]
        for seq in sorted(active, key=lambda s: len(s.pending) > 1):
            if budget == 0:
                break
            chunk = seq.pending[:budget]
            plan.append((seq, chunk))
            budget -= len(chunk)
        return plan

    def _accept(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        if token in self.eog_ids:
            seq.tokens.pop()                                        # the EOG token is not part of the text
            seq.finish_reason = "stop"
        elif seq.text.push(token):
            seq.finish_reason = "stop"                              # a stop string appeared
        elif len(seq.generated) >= seq.max_tokens or len(seq.tokens) >= self.ctx:
            seq.finish_reason = "length"
        if seq.done:
            seq.text.finish()
            self._record_memory(seq)
            if self.prefix is not None:                             # end of a reply: a message boundary
                self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=True)

    def _checkpoint_prompt(self, seq: Sequence) -> None:
        """At the end of the prompt (a message boundary) and every checkpoint_interval tokens."""
        last = max((cp.n_tokens for cp in self.prefix.slots[seq.slot].checkpoints), default=0)
        if seq.n_cached == len(seq.prompt) or seq.n_cached - last >= self.checkpoint_interval:
            self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=True)

    def _record_memory(self, seq: Sequence) -> None:
        seq.kv_bytes = sum(c.slot_nbytes(seq.slot) for c in self.caches if c.kind == "kv")
        seq.state_bytes = sum(c.slot_nbytes(seq.slot) for c in self.caches if c.kind == "recurrent")

    def run(self, seqs: list[Sequence]) -> None:
        """Step until all of ``seqs`` are done (others in flight advance too)."""
        while not all(s.done for s in seqs):
            self.step()

    def clear_slot(self, slot: int) -> None:
        for cache in self.caches:
            cache.clear(slot)
        if self.prefix is not None:
            self.prefix.forget(slot)

    # ----- scoring ----------------------------------------------------------------
    def prefill_logits(self, token_ids: list[int], slot: int) -> torch.Tensor:
        """Logits at every position of a fresh prefill of ``token_ids`` in ``slot``, in chunks of n_ubatch."""
        self.clear_slot(slot)
        rows = []
        for start in range(0, len(token_ids), self.n_ubatch):
            chunk = token_ids[start:start + self.n_ubatch]
            batch = Batch.build([(slot, chunk, start)], device=self.model.output_weight.device)
            rows.append(self.model(batch, self.caches, all_logits=True))
        return torch.cat(rows)
