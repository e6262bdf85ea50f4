"""The step loop: continuous batching over cache slots.

Each ``step`` builds one flattened batch: every decoding sequence contributes
its newest token, then sequences still reading their prompt contribute a chunk
of it, within a budget of ``n_ubatch`` tokens (llama.cpp's ``-ub``). One forward
pass serves them all; sequences whose pending tokens are all in the cache get
a new token sampled. New sequences may join between any two steps.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..devices import to_device
from ..models import Batch
from ..models.base import CausalLM
from ..tokenizer import Tokenizer
from .config import EngineConfig
from .decode_step import DecodeStep
from .prefix import PrefixCache
from .sampling import Sampler, SamplingParams, sample_rows
from .speculative import PromptLookup
from .text import TextStream


OVERFLOW = "the model produced NaN or infinite keys/values for this sequence"


def sampling_failed(err: Exception) -> str:
    return f"sampling failed: {type(err).__name__}: {err}"


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
    error: str | None = None                               # why it ended, when finish_reason is "error"
    ignore_eos: bool = False                               # end-of-generation tokens are never sampled
    lookup: PromptLookup | None = field(default=None, repr=False)   # drafts, with speculative decoding
    n_drafted: int = 0                                     # draft tokens proposed, and kept
    n_draft_accepted: int = 0
    # A sequence submitted with the same prompt as one still reading it waits for that one and
    # then takes a copy of its cache and its last logits: n choices read their prompt once.
    leader: "Sequence | None" = field(default=None, repr=False)

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
        n_gen, n_read = len(self.generated), len(self.prompt) - self.cached_tokens
        # llama-server's split: cache_n prompt tokens reused, prompt_n read (the rate is of those)
        out = {"cache_n": self.cached_tokens, "prompt_n": n_read, "prompt_ms": 1000 * self.prompt_s,
               "prompt_per_second": n_read / self.prompt_s if self.prompt_s else 0.0,
               "predicted_n": n_gen, "predicted_ms": 1000 * self.gen_s,
               # the first token comes from the prefill's logits; decode steps made the rest
               "predicted_per_second": (n_gen - 1) / self.gen_s if self.gen_s and n_gen > 1 else 0.0}
        if self.n_drafted:                                 # llama-server's names
            out.update(draft_n=self.n_drafted, draft_n_accepted=self.n_draft_accepted)
        return out


class Engine:
    """Owns the model's cache and the slots; ``submit`` then ``step`` until sequences are done.

    With ``prefix_cache`` a released slot keeps its contents, and a new prompt
    goes to the slot sharing its longest reusable prefix (see ``prefix.py``).
    Everything outside ``engine/`` uses the public methods below, never the fields.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 eog_ids: set[int] = frozenset()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.cache = model.make_cache(config.cache)
        self.decode_step = DecodeStep(model, self.cache, compile=config.compile, native=config.native,
                                      cuda_graphs=config.cuda_graphs)
        self.eog_ids = set(eog_ids)
        self._free = list(range(config.n_parallel))
        self.prefix = PrefixCache(self.cache, config.max_checkpoints, config.checkpoint_bytes) \
            if config.prefix_cache else None
        self.running: list[Sequence] = []
        self._next_id = 0

    # ----- what the tools and the server read ------------------------------------
    @property
    def ctx(self) -> int:
        return self.config.ctx

    @property
    def n_parallel(self) -> int:
        return self.config.n_parallel

    @property
    def n_ubatch(self) -> int:
        return self.config.n_ubatch

    @property
    def type_k(self) -> str:
        return self.config.cache.type_k.name

    @property
    def type_v(self) -> str:
        return self.config.cache.type_v.name

    @property
    def device(self) -> torch.device:
        return self.config.device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def kv_bytes(self) -> int:
        return self.cache.kv_bytes

    @property
    def state_bytes(self) -> int:
        return self.cache.state_bytes

    @property
    def checkpoint_bytes(self) -> int:
        return self.prefix.nbytes if self.prefix is not None else 0

    @property
    def n_free_slots(self) -> int:
        return len(self._free)

    def cached_tokens(self, slot: int | None = None) -> int:
        """Tokens held in the cache by ``slot`` (None: all slots)."""
        slots = range(self.n_parallel) if slot is None else [slot]
        return sum(self.cache.offset(s) for s in slots)

    def slot_info(self, slot: int) -> dict:
        """What ``/slots`` shows of one slot."""
        return {"n_cached_tokens": self.cache.offset(slot), "kv_bytes": self.cache.slot_kv_bytes(slot),
                "checkpoints": self.prefix.checkpoint_lengths(slot) if self.prefix is not None else [],
                "is_free": slot in self._free}

    def with_cache_types(self, type_k, type_v) -> "Engine":
        """A new engine over the same weights with other K/V formats (its own, empty cache)."""
        return Engine(self.model, self.tokenizer, self.config.with_cache_types(type_k, type_v), self.eog_ids)

    # ----- slots -----------------------------------------------------------------
    def acquire_slot(self) -> int:
        """Take a free slot, emptied (raises RuntimeError when every slot is busy)."""
        if not self._free:
            raise RuntimeError("no free slot: all n_parallel sequences are busy")
        slot = self._free.pop(0)
        self.clear_slot(slot)
        return slot

    def release_slot(self, slot: int) -> None:
        """Give back a slot taken with ``acquire_slot`` (its contents are dropped)."""
        self.clear_slot(slot)
        if slot not in self._free:
            self._free.append(slot)

    @contextmanager
    def borrowed_slot(self) -> Iterator[int]:
        """``with engine.borrowed_slot() as slot:`` an empty slot, emptied and freed afterwards."""
        slot = self.acquire_slot()
        try:
            yield slot
        finally:
            self.release_slot(slot)

    def clear_slot(self, slot: int) -> None:
        self.cache.clear(slot)
        if self.prefix is not None:
            self.prefix.forget(slot)

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
        if not self._free:
            raise RuntimeError("no free slot: all n_parallel sequences are busy")
        ignore_eos = bool(sampling and sampling.ignore_eos)          # as llama-server: EOG tokens never drawn
        seq = Sequence(self._next_id, list(prompt), max_tokens, Sampler(sampling, banned=self.eog_ids if ignore_eos else ()),
                       TextStream(self.tokenizer, stop or []), tokens=list(prompt), ignore_eos=ignore_eos)
        self._next_id += 1
        self._assign_slot(seq)
        seq.leader = next((s for s in self.running if s.leader is None and not s.done and s.prompt == seq.prompt
                           and s.n_cached < len(s.prompt)), None)
        self.running.append(seq)
        return seq

    def _assign_slot(self, seq: Sequence) -> None:
        if self.prefix is None:
            seq.slot = self._free.pop(0)
            self.cache.clear(seq.slot)
            return
        seq.slot, _ = self.prefix.pick(self._free, seq.prompt)
        self._free.remove(seq.slot)
        seq.n_cached = seq.cached_tokens = self.prefix.restore(seq.slot, seq.prompt)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's slot (its cache contents are dropped unless prefix reuse keeps them)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.finish_reason is None:
            seq.finish_reason = "cancelled"
            self._record_memory(seq)
        if seq.slot >= 0 and seq.slot not in self._free:
            if self.prefix is not None and seq.finish_reason != "error":   # keep the contents for the next request
                self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=False)
            else:
                self.clear_slot(seq.slot)
            self._free.append(seq.slot)

    def step(self) -> list[Sequence]:
        """One forward pass over all running sequences; returns those that got a new token or
        ended with an error (``finish_reason == "error"``, ``error`` says why)."""
        plan = self._plan()
        if not plan:
            return []
        try:
            drafts = self._drafts(plan)
            drafting = {id(seq) for seq, _ in drafts}
            advanced = self._step_plan([(seq, chunk) for seq, chunk in plan if id(seq) not in drafting])
            for seq, draft in drafts:
                self._speculate(seq, draft)
                advanced.append(seq)
        except Exception as err:
            self._fail_step(plan, err)
            raise
        return advanced

    def _fail_step(self, plan: list[tuple[Sequence, list[int]]], err: Exception) -> None:
        """A step that raised may have written part of its tokens (the DeltaNet layers before the
        one that failed, some pages): its sequences, and those forking from them, end with an
        error, so that releasing them clears their slots. Kept for prefix reuse, a slot whose
        cache no longer matches its history made every later prompt sharing it fail to restore."""
        touched = {id(seq) for seq, _ in plan}
        for seq in self.running:
            if not seq.done and (id(seq) in touched or id(seq.leader) in touched):
                self._fail(seq, f"the step failed: {type(err).__name__}: {err}")

    def _step_plan(self, plan: list[tuple[Sequence, list[int]]]) -> list[Sequence]:
        if not plan:
            return []
        t0 = time.perf_counter()
        logits = self._forward(plan)
        bad = set(self.cache.take_overflow())                       # the one host read of the step
        elapsed = time.perf_counter() - t0
        advanced, rows = [], []                                     # got a token, or ended with an error
        for row, (seq, chunk) in enumerate(plan):
            self._account(seq, chunk, elapsed)
            if seq.slot in bad:
                self._fail(seq, OVERFLOW)
                advanced.append(seq)
            elif not seq.pending:                                   # everything read: predict
                for follower in [s for s in self.running if s.leader is seq]:
                    self._fork(seq, follower)
                    rows.append((follower, row))
                rows.append((seq, row))
        self._sample(rows, logits)
        return advanced + [seq for seq, _ in rows]

    # ----- speculative decoding (speculative.py) ---------------------------------------
    def _drafts(self, plan: list[tuple[Sequence, list[int]]]) -> list[tuple[Sequence, list[int]]]:
        """(sequence, draft) for the decoding sequences whose context offers a prompt-lookup draft,
        no longer than their max_tokens and the context leave room for. A prompt's last token is
        never drafted after: it goes through ``_step_plan``, which forks the sequences waiting on
        this prompt (n > 1) and checkpoints the prompt's end; a speculative step does neither, and
        a follower forked at a later step would copy a cache already past the prompt."""
        if not self.config.draft_max:
            return []
        out = []
        for seq, _ in plan:
            room = min(self.config.draft_max, seq.max_tokens - len(seq.generated) - 1, self.ctx - seq.n_cached - 2)
            if len(seq.pending) != 1 or seq.n_cached < len(seq.prompt) or room < 1:
                continue
            seq.lookup = seq.lookup or PromptLookup()
            draft = seq.lookup.draft(seq.tokens, room)
            if draft:
                out.append((seq, draft))
        return out

    def _speculate(self, seq: Sequence, draft: list[int]) -> None:
        """One forward over the pending token and ``draft``; the sampler draws from each
        position's logits in turn, and the draft's tokens stand while it draws them. The cache
        then holds the pending token and the kept draft tokens: attention is trimmed, DeltaNet
        state goes back to a checkpoint taken before and reads the kept tokens again."""
        n0, chunk = seq.n_cached, seq.pending + draft
        checkpoint = self.cache.checkpoint(seq.slot) if self.cache.recurrent else None
        t0 = time.perf_counter()
        logits = self.decode_step.chunk(seq.slot, chunk, n0)
        if seq.slot in self.cache.take_overflow():
            self._fail(seq, OVERFLOW)
            return
        drawn, window = [], seq.sampler.params.repeat_last_n          # what penalties can see of the history
        recent = seq.tokens[-window:] if window else []
        for j in range(len(chunk)):
            token = sample_rows([seq.sampler], logits[j:j + 1], [recent + drawn])[0]
            if isinstance(token, Exception):
                self._fail(seq, sampling_failed(token))
                return
            drawn.append(token)
            if j == len(draft) or token != draft[j]:
                break
        seq.n_drafted += len(draft)
        for i, token in enumerate(drawn):
            seq.n_cached = n0 + 1 + i                 # the tokens the cache should hold when this one is drawn
            seq.n_draft_accepted += i < len(draft) and token == draft[i]
            self._accept(seq, token, record=False)
            if seq.done:
                break
        if seq.n_cached < n0 + len(chunk):
            self._rewind_draft(seq, n0, chunk, checkpoint)
        seq.gen_s += time.perf_counter() - t0
        if seq.done and self.prefix is not None:
            self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=True)

    def _rewind_draft(self, seq: Sequence, n0: int, chunk: list[int], checkpoint) -> None:
        """The cache back to ``seq.n_cached`` tokens after a forward over ``chunk`` from ``n0``."""
        if checkpoint is None:
            self.cache.rewind(seq.slot, seq.n_cached)
            return
        self.cache.rewind(seq.slot, n0, checkpoint)
        self.decode_step.chunk(seq.slot, chunk[:seq.n_cached - n0], n0, all_logits=False)

    def _sample(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        """Every predicting sequence's next token in one pass (a follower samples from its leader's row)."""
        if not rows:
            return
        index = [row for _, row in rows]
        picked = logits if index == list(range(logits.shape[0])) else logits[to_device(index, logits.device)]
        tokens = sample_rows([seq.sampler for seq, _ in rows], picked, [seq.tokens for seq, _ in rows])
        for (seq, _), token in zip(rows, tokens):
            try:
                if isinstance(token, Exception):
                    raise token
                self._accept(seq, token)
            except Exception as err:                                # a failure ends this request alone
                self._fail(seq, sampling_failed(err))

    def _fork(self, leader: Sequence, seq: Sequence) -> None:
        """``seq`` (same prompt) takes a copy of the leader's cache; it samples its own first
        token from the leader's last logits: the distribution it would have computed itself."""
        self.cache.copy_slot(leader.slot, seq.slot)
        seq.leader = None
        seq.n_cached = seq.cached_tokens = len(seq.prompt)
        seq.prompt_s = leader.prompt_s
        if self.prefix is not None:
            self._checkpoint_prompt(seq)

    def _forward(self, plan: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        """Logits of each plan entry's last token. With a native or compiled decode step, the
        decoding sequences always go through it, and each prompt chunk through a Batch of its
        own beside it: a sequence's numbers then come from the same code whether or not another
        request is decoding or reading its prompt (the two paths round differently, and the
        prompt GEMMs' sums depend on how many rows they hold: two prompts in one Batch gave the
        bundled model first-token logits up to 0.09 away from each read alone, and a greedy reply
        would depend on what else the server was doing). Without one, one Batch."""
        if not self.decode_step.static:
            return self._batch_forward(plan)
        n_decoding = sum(len(seq.pending) == 1 for seq, _ in plan)       # _plan puts them first
        parts = []
        if n_decoding:
            parts.append(self.decode_step([seq.slot for seq, _ in plan[:n_decoding]],
                                          [chunk[0] for _, chunk in plan[:n_decoding]],
                                          [seq.n_cached for seq, _ in plan[:n_decoding]]))
        parts += [self._batch_forward([entry]) for entry in plan[n_decoding:]]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _batch_forward(self, plan: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        batch = Batch.build([(seq.slot, chunk, seq.n_cached) for seq, chunk in plan], device=self.device)
        return self.model(batch, self.cache)

    def _account(self, seq: Sequence, chunk: list[int], elapsed: float) -> None:
        if seq.n_cached < len(seq.prompt):                          # this step read (part of) its prompt
            seq.prompt_s += elapsed
        else:
            seq.gen_s += elapsed
        seq.n_cached += len(chunk)
        if self.prefix is not None and seq.n_cached <= len(seq.prompt):
            self._checkpoint_prompt(seq)

    def _fail(self, seq: Sequence, message: str) -> None:
        """End one sequence with an error; its slot is cleared when it is released."""
        seq.finish_reason, seq.error = "error", message
        seq.text.finish()
        self._record_memory(seq)

    def _plan(self) -> list[tuple[Sequence, list[int]]]:
        """Decoding sequences first (one token each; ``_forward`` relies on that order), then
        prompt chunks within the budget. With a native or compiled decode step, decoding rows run apart (``_forward``) and take
        none of the budget, and a prompt is read in whole chunks of n_ubatch from where it
        started: one that does not fit in what is left waits for the next step, so its
        chunks, each forwarded alone, give the numbers of the prompt read alone."""
        budget, plan = self.n_ubatch, []
        for seq in self.running:                                    # a leader that failed: read it alone
            if seq.leader is not None and (seq.leader.done or seq.leader not in self.running):
                seq.leader = None
        active = [s for s in self.running if not s.done and s.leader is None]
        apart = self.decode_step.static
        for seq in sorted(active, key=lambda s: len(s.pending) > 1):
            if apart and len(seq.pending) == 1:
                plan.append((seq, seq.pending))
                continue
            if budget == 0:
                break
            chunk = seq.pending[:budget]
            if apart and len(chunk) < min(len(seq.pending), self.n_ubatch):
                continue                                            # a whole chunk next step
            plan.append((seq, chunk))
            budget -= len(chunk)
        return plan

    def _accept(self, seq: Sequence, token: int, record: bool = True) -> None:
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
            if self.prefix is not None and record:                  # end of a reply: a message boundary
                self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=True)

    def _checkpoint_prompt(self, seq: Sequence) -> None:
        """At the end of the prompt (a message boundary) and every checkpoint_interval tokens."""
        last = max(self.prefix.checkpoint_lengths(seq.slot), default=0)
        if seq.n_cached == len(seq.prompt) or seq.n_cached - last >= self.config.checkpoint_interval:
            self.prefix.record(seq.slot, seq.tokens[:seq.n_cached], checkpoint=True)

    def _record_memory(self, seq: Sequence) -> None:
        seq.kv_bytes = self.cache.slot_kv_bytes(seq.slot)
        seq.state_bytes = self.cache.slot_state_bytes(seq.slot)

    def run(self, seqs: list[Sequence]) -> None:
        """Step until all of ``seqs`` are done (others in flight advance too)."""
        while not all(s.done for s in seqs):
            self.step()

    def warm_up(self) -> float:
        """Compile the decode step, or record its CUDA graphs, now (batch 1, and 2 when there are
        two slots) rather than in the first requests' steps; seconds spent. Nothing to do without
        ``compile`` or ``cuda_graphs``."""
        if not (self.decode_step.compiled or self.decode_step.graphed):
            return 0.0
        before = self.decode_step.setup_s
        slots = [self.acquire_slot() for _ in range(min(2, len(self._free)))]
        try:
            for n in range(1, len(slots) + 1):
                batch = Batch.build([(slot, [0], 0) for slot in slots[:n]], device=self.device)
                self.model(batch, self.cache)                        # one token of prompt in each slot
                self.decode_step(slots[:n], [0] * n, [1] * n)
                for slot in slots[:n]:
                    self.cache.clear(slot)
        finally:
            for slot in slots:
                self.release_slot(slot)
        return self.decode_step.setup_s - before

    # ----- scoring ----------------------------------------------------------------
    def iter_scores(self, token_ids: list[int], first: int = 0, progress=None) -> Iterator[tuple[int, torch.Tensor]]:
        """Fresh prefill of ``token_ids`` in a borrowed slot, in ubatches; yields ``(row, logits)``
        for rows >= ``first``: float32 (n, vocab) on the CPU starting at ``row``. Memory is bounded
        by one ubatch; the slot is freed when the generator ends or is closed."""
        if len(token_ids) > self.ctx:
            raise ValueError(f"{len(token_ids)} tokens do not fit the context of {self.ctx}; raise -c")
        with self.borrowed_slot() as slot:
            for start in range(0, len(token_ids), self.n_ubatch):
                part = token_ids[start:start + self.n_ubatch]
                logits = self.model(Batch.build([(slot, part, start)], device=self.device), self.cache,
                                    all_logits=True)
                if self.cache.take_overflow():
                    raise ValueError("the model produced NaN or infinite keys/values while scoring")
                if progress:
                    progress(len(part))
                if start + len(part) > first:
                    skip = max(0, first - start)
                    yield start + skip, logits[skip:].float().cpu()

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits (T, vocab) float32 at every position of a fresh prefill of ``token_ids``."""
        return torch.cat([logits for _, logits in self.iter_scores(token_ids)])
