"""One thread drives the engine; the HTTP event loop hands it jobs and reads events back.

Jobs wait in a bounded queue until a slot frees; each engine step serves
every running job in one forward pass (continuous batching). A cancelled job
(its client went away) leaves at the next step boundary and frees its slot.
A job whose sampling fails ends alone with an error; the others go on.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine import Engine, SamplingParams, Sequence


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class SequenceFailed(Exception):
    """Generation of one request failed (e.g. its sampling values overflowed); others are unaffected."""


# ----- the engine's slots, as the server reads them (the one place to switch to the engine's public API) -----
def n_free_slots(engine: Engine) -> int:
    return engine.n_free_slots


def engine_status(engine: Engine) -> dict:
    """What /metrics and /slots show of the engine's slots (its public API only)."""
    infos = [engine.slot_info(slot) for slot in range(engine.n_parallel)]
    return {"free_slots": [slot for slot, info in enumerate(infos) if info["is_free"]],
            "slots": [{"n_cached": info["n_cached_tokens"], "checkpoints": info["checkpoints"],
                       "kv_bytes": info["kv_bytes"]} for info in infos],
            "checkpoint_bytes": engine.checkpoint_bytes}


@dataclass
class Job:
    """One sequence to generate. ``emit`` receives ("text", str, logprobs) ... then ("done", Sequence)
    or ("error", Exception); it is called from the scheduler thread."""
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    emit: Callable[[tuple], None]
    constraint: object | None = None
    index: int = 0                                       # the choice this job answers (n > 1)
    seq: Sequence | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    logprobs_sent: int = 0
    abort: str | None = None                             # why the server ended it (shutdown), if it did

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64):
        self.engine, self.max_queue = engine, max_queue
        self.waiting: list[Job] = []
        self.active: list[Job] = []
        self.lock = threading.Condition()
        self.stats = Stats()
        self.closing = False
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="kvslim-scheduler", daemon=True)
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs together (all or none); raises QueueFull or ShuttingDown."""
        with self.lock:
            if self.closing:
                raise ShuttingDown("the server is shutting down")
            # the queue bound counts requests beyond those a free slot takes at once
            free = n_free_slots(self.engine)
            if len(self.waiting) + len(jobs) > self.max_queue + free:
                raise QueueFull(f"{len(self.waiting)} requests already waiting")
            self.waiting.extend(jobs)
            self.lock.notify()

    def idle(self) -> bool:
        with self.lock:
            return not self.waiting and not self.active

    # ----- shutdown ------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new jobs and end the queued ones with an error; running jobs go on."""
        with self.lock:
            self.closing = True
            for job in self.waiting:
                job.emit(("error", ShuttingDown("the server is shutting down")))
            self.waiting.clear()

    def abort_active(self, reason: str) -> None:
        """End every running job with an error now; their slots free at the next step boundary.

        The error is sent at once, not by the engine thread: it may be inside a long step
        (a prefill chunk, the first steps on a busy machine), and a client waits on it."""
        with self.lock:
            for job in self.active:
                job.abort = reason
                job.cancel()
                job.emit(("error", ShuttingDown(reason)))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread; waits up to ``timeout`` s for the step it is in (it is a daemon)."""
        self.close()
        with self.lock:
            self._stop = True
            self.lock.notify()
        self.thread.join(timeout)

    # ----- the loop -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not self.waiting and not self.active:
                    self.lock.wait()
                if self._stop:
                    return
                self._admit()
            self._drop_cancelled()
            if self.active:
                self._step()

    def _admit(self) -> None:
        """Move waiting jobs into free slots (called with the lock held)."""
        # a job whose client left while queued goes now, not when a slot frees: it holds a queue place
        self.waiting = [job for job in self.waiting if not job.cancelled.is_set()]
        while self.waiting and n_free_slots(self.engine):
            job = self.waiting.pop(0)
            try:
                job.seq = self.engine.submit(job.prompt, job.max_tokens, job.sampling, job.stop)
            except ValueError as err:                                   # e.g. prompt longer than ctx
                job.emit(("error", err))
                continue
            job.seq.sampler.constraint = job.constraint
            self.stats.on_admit(job.seq)
            self.active.append(job)

    def _drop_cancelled(self) -> None:
        with self.lock:
            gone = [j for j in self.active if j.cancelled.is_set()]
        for job in gone:
            self._finish(job, quiet=job.abort is not None)        # an aborted job had its error already

    def _step(self) -> None:
        try:
            advanced = set(id(s) for s in self.engine.step())
        except Exception as err:                                       # the forward pass itself failed
            for job in list(self.active):
                self._finish(job, ("error", err))
            return
        for job in list(self.active):
            if id(job.seq) in advanced:
                self._advance(job)

    def _advance(self, job: Job) -> None:
        seq = job.seq
        if job.first_token_s is None:
            job.first_token_s = time.monotonic() - job.submitted
        if seq.finish_reason == "error":
            self._finish(job, ("error", SequenceFailed(f"generation failed: {seq.error}")))
            return
        text = seq.text.new_text()
        if text or seq.done:
            job.emit(("text", text, self._new_logprobs(job)))
        if seq.done:
            self._finish(job)

    def _new_logprobs(self, job: Job) -> list:
        """Logprobs of tokens generated since the last event (none for a trailing EOG token)."""
        entries = job.seq.sampler.logprobs[job.logprobs_sent:len(job.seq.generated)]
        job.logprobs_sent += len(entries)
        return entries

    def _finish(self, job: Job, event: tuple | None = None, quiet: bool = False) -> None:
        self.engine.release(job.seq)
        with self.lock:
            self.active.remove(job)
        self.stats.on_finish(job.seq)
        if not quiet:
            job.emit(event or ("done", job.seq))

    # ----- views -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            return {"running": len(self.active), "waiting": len(self.waiting)}


class Stats:
    """Counters behind /metrics (written by the scheduler thread only)."""

    def __init__(self):
        self.prompt_tokens = self.predicted_tokens = self.requests = 0
        self.prompt_seconds = self.predicted_seconds = 0.0
        self.prefix_hits = self.cached_tokens = self.failed = 0

    def on_admit(self, seq: Sequence) -> None:
        self.requests += 1
        if seq.cached_tokens:
            self.prefix_hits += 1
            self.cached_tokens += seq.cached_tokens

    def on_finish(self, seq: Sequence) -> None:
        self.prompt_tokens += len(seq.prompt) - seq.cached_tokens
        self.predicted_tokens += len(seq.generated)
        self.prompt_seconds += seq.prompt_s
        self.predicted_seconds += seq.gen_s
        self.failed += seq.finish_reason == "error"
