"""One thread drives the engine; HTTP threads hand it jobs and read events back.

Jobs wait in a bounded queue until a slot frees; each engine step serves
every running job in one forward pass (continuous batching). A cancelled job
(its client went away) leaves at the next step boundary and frees its slot.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import Engine, Sequence, SamplingParams


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    events: queue.Queue = field(default_factory=queue.Queue)   # ("text", str) ... ("done", Sequence)
    seq: Sequence | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64):
        self.engine, self.max_queue = engine, max_queue
        self.waiting: list[Job] = []
        self.active: list[Job] = []
        self.lock = threading.Condition()
        self.stats = Stats()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="kvslim-scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> Job:
        with self.lock:
            # the queue bound counts requests beyond those a free slot takes at once
            if len(self.waiting) >= self.max_queue + self.engine.n_free_slots:
                raise QueueFull(f"{len(self.waiting)} requests already waiting")
            self.waiting.append(job)
            self.lock.notify()
        return job

    def shutdown(self) -> None:
        with self.lock:
            self._stop = True
            self.lock.notify()
        self.thread.join(timeout=5)

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
        while self.waiting and self.engine.n_free_slots:
            job = self.waiting.pop(0)
            if job.cancelled.is_set():
                continue
            try:
                job.seq = self.engine.submit(job.prompt, job.max_tokens, job.sampling, job.stop)
            except ValueError as err:                                   # e.g. prompt longer than ctx
                job.events.put(("error", err))
                continue
            self.stats.on_admit(job.seq)
            self.active.append(job)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.active if j.cancelled.is_set()]:
            self._finish(job)

    def _step(self) -> None:
        try:
            advanced = set(id(s) for s in self.engine.step())
        except Exception as err:                                       # never take the server down
            for job in list(self.active):
                job.events.put(("error", err))
                self._finish(job)
            return
        for job in list(self.active):
            if id(job.seq) not in advanced:
                continue
            if job.first_token_s is None:
                job.first_token_s = time.monotonic() - job.submitted
            text = job.seq.text.new_text()
            if text:
                job.events.put(("text", text))
            if job.seq.done:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        self.engine.release(job.seq)
        self.active.remove(job)
        self.stats.on_finish(job.seq)
        job.events.put(("done", job.seq))

    # ----- views -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            return {"running": len(self.active), "waiting": len(self.waiting)}


class Stats:
    """Counters behind /metrics (written by the scheduler thread only)."""

    def __init__(self):
        self.prompt_tokens = self.predicted_tokens = self.requests = 0
        self.prompt_seconds = self.predicted_seconds = 0.0
        self.prefix_hits = self.cached_tokens = 0

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
