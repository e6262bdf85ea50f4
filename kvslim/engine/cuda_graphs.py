"""Decode steps replayed from CUDA graphs: one launch per step instead of thousands.

An eager decode step on a GPU is bound by its launches, not its bytes: a 40-layer
hybrid model issues a few thousand kernels a token, each costing the host ~5-10 us
to dispatch from Python, while the GPU finishes most of them faster. A CUDA graph
records the step's kernels once and replays them with one call.

A graph fixes every shape and every address, so the step runs on a ``DecodeBatch``
(the caches' host work, page allocation included, done around it: ``decode_step.py``)
whose inputs are copied into static tensors before each replay. The graphs are keyed
by the batch size and by the pages attention reads per sequence, rounded up to a
bucket (``page_bucket``: 2, 3, 4, 6, 8, 12, ...): the pages past a sequence's end
are the null page or masked by its position, so a bucket reads at most 1.5x the
pages it needs (the Triton kernel's splits past the end stop before reading), and
a context of 128K tokens in pages of 256 needs 17 graphs per batch size, made as
they are first met.

The first step of each key runs eagerly on the capture stream, then the graph is
recorded. That eager run is the step itself (a recurrent state must advance once,
so no separate warm-up step is taken) and it leaves every lazily made table and
every compiled Triton kernel in place before capture, where making them would
fail. All graphs share one memory pool: they are replayed one at a time, and each
holds only its own output between replays.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from ..devices import to_device

log = logging.getLogger(__name__)


def page_bucket(n_pages: int, limit: int) -> int:
    """The pages a graph reads for ``n_pages`` needed: the smallest of 2, 3, 4, 6, 8, 12, 16, ...
    (2^k and 3 * 2^(k-1)) that is at least ``n_pages``, and never more than ``limit`` (a slot's
    block-table width), but at least 2 so that one page is not a special case."""
    n = max(2, n_pages)
    bucket = 2
    while bucket < n:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return min(bucket, max(2, limit))


class GraphedDecode:
    """``run(tokens, positions, slots, n_pages)`` -> float32 logits (B, vocab), by replaying the
    graph of ``forward(tokens, positions, slots, n_pages)`` (device tensors, an int) recorded for
    this batch size and page bucket, or by recording it first.

    ``graph`` makes the recorder (``torch.cuda.CUDAGraph``); ``capture(graph, pool, stream)``
    enters its recording (``torch.cuda.graph``). Tests pass stand-ins to check the bookkeeping
    on a machine without a GPU."""

    def __init__(self, forward: Callable, device: torch.device, max_batch: int, max_pages: int,
                 graph: Callable | None = None, capture: Callable | None = None):
        self.forward, self.device, self.max_pages = forward, torch.device(device), max_pages
        self._new_graph = graph or torch.cuda.CUDAGraph
        self._capture = capture or (lambda g, pool, stream: torch.cuda.graph(g, pool=pool, stream=stream))
        self._inputs = torch.zeros(3, max_batch, dtype=torch.long, device=self.device)  # tokens, positions, slots
        self._graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        on_cuda = self.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if on_cuda else None    # every graph records into it
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.capture_s = 0.0                                  # seconds spent recording graphs
        self.why_eager: str | None = None                     # set when a recording failed: steps run eagerly

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def run(self, tokens: list[int], positions: list[int], slots: list[int], n_pages: int) -> torch.Tensor:
        n = len(tokens)
        if not 0 < n <= self._inputs.shape[1]:
            raise ValueError(f"a graphed decode step takes 1..{self._inputs.shape[1]} sequences, got {n}")
        key = (n, page_bucket(n_pages, self.max_pages))
        self._inputs[:, :n].copy_(to_device([tokens, positions, slots], self.device))   # into the static buffer
        args = (self._inputs[0, :n], self._inputs[1, :n], self._inputs[2, :n], key[1])
        if self.why_eager is not None:
            return self.forward(*args)
        if key in self._graphs:
            graph, out = self._graphs[key]
            graph.replay()
            return out.clone()                                # the next replay overwrites ``out``
        return self._record(key, args)

    def _record(self, key, args) -> torch.Tensor:
        """This step eagerly (on the capture stream: what it makes lazily is made for that stream),
        then the same call recorded. Recording runs nothing, so the step is taken once."""
        with self._on_capture_stream():
            logits = self.forward(*args).clone()
        t0 = time.perf_counter()
        graph = self._new_graph()
        try:
            with self._capture(graph, self._pool, self._stream):
                out = self.forward(*args)
        except RuntimeError as err:          # an op that cannot be recorded: keep decoding, eagerly
            self.why_eager = f"recording a CUDA graph failed ({str(err).splitlines()[0]})"
            log.warning("%s; decode steps run eagerly from now on", self.why_eager)
            return logits
        self._graphs[key] = (graph, out)
        self.capture_s += time.perf_counter() - t0
        return logits

    @contextmanager
    def _on_capture_stream(self):
        """Run on the capture stream, ordered after the current stream's work and before its next."""
        if self._stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)
