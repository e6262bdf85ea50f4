"""Decode steps: one new token for each of B sequences, native, graphed, compiled or eager.

Native (the default where it applies): the whole step in C, one call per token
(``native_step.py``; batches of more than 8 sequences as calls of 8); models, weights or
K/V formats it does not implement take one of the torch steps below.

Eager (the reference, and ``--no-compile``): a flattened ``Batch`` through the
model; every op is dispatched from Python, ~3,000 of them per step on the
bundled model, so on a CPU a step costs its dispatch overhead, not its FLOPs.

Compiled: the caches' host work (checks, page allocation, lengths) is done
around the step, so the forward pass on a ``DecodeBatch`` is pure tensor code
that ``torch.compile`` traces into one graph, and inductor turns into a few
fused C++ loops (attention's row decoding fused into its reductions, norms and
activations into their neighbours). Shapes are symbolic in the batch size and
in the pages read (at least two, so that one page is not a special case), so a
model compiles twice: for one sequence (torch specialises size 1) and for any
other batch size. ``Engine.warm_up`` does both before the first request;
inductor keeps the generated code in its on-disk cache, so a later process
skips the C++ compilation (dynamo's tracing is paid again).

Graphed (``--cuda-graphs``, CUDA devices): the same DecodeBatch forward (compiled or
not) recorded as CUDA graphs per batch size and page bucket and replayed
(``cuda_graphs.py``): one launch a step instead of one per kernel.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..devices import to_device
from ..models import Batch, DecodeBatch
from .cuda_graphs import GraphedDecode
from .native_step import NativeStep

# The decode graph's settings. Guards on the model's modules are skipped: dynamo checks every
# parameter's attributes before every call (~1 ms a step on the bundled model), and a loaded
# model's modules never change after the step is built. inductor's C++ wrapper measured no
# faster on the bundled model and took longer to compile.
# inductor's size/stride asserts on the graph's inputs (~230 a step on the bundled model, 0.24 ms
# in a 6 ms step) are off: the inputs are built by DecodeStep itself, with fixed layouts.
COMPILE_OPTIONS = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "size_asserts": False}


def default_cache_dir() -> Path:
    """Where inductor keeps compiled code between processes (``TORCHINDUCTOR_CACHE_DIR`` wins)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvslim" / "inductor"


def prime_formats(cache) -> None:
    """Build the K/V formats' constants (codebooks, rotations, tables) eagerly, once: traced,
    their construction (a Lloyd-Max iteration, say) would be unrolled into the graph."""
    for layer in cache.kv_layers:
        x = torch.zeros(1, layer.n_kv_heads, layer.head_dim, device=layer.device)     # a token's rows
        for fmt in (layer.fmt_k, layer.fmt_v):
            codes, _ = fmt.encode_flagged(x)
            heads_first = codes.transpose(0, 1)                     # the attention hooks' layout (klt3's heads)
            fmt.decode_code_domain_scaled(heads_first, layer.head_dim)
            fmt.from_code_domain(fmt.to_code_domain(x.transpose(0, 1)))


def use_cache_dir() -> None:
    """Point inductor at ``default_cache_dir()`` unless the user chose a folder. Importing torch's
    compiler pieces (kvslim's ops do) already sets TORCHINDUCTOR_CACHE_DIR to inductor's own
    default (/tmp/torchinductor_<user>), so that value counts as not chosen."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default
        unchosen = current is None or os.path.abspath(current) == os.path.abspath(inductor_default())
    except ImportError:                                   # a torch without that module: only fill a gap
        unchosen = current is None
    if unchosen:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(default_cache_dir())


class DecodeStep:
    """``step(slots, tokens, positions)`` -> float32 logits (B, vocab), caches advanced by one."""

    def __init__(self, model, cache, compile: bool = True, backend: str = "inductor", native: bool = True,
                 cuda_graphs: bool | None = None):
        """``backend``: torch.compile's; tests use "aot_eager" (the same traced, functionalised
        graph run by eager kernels: checks the tracing in seconds instead of minutes).
        ``native``: use the C step where it applies (``why_not_native`` says why it does not).
        ``cuda_graphs``: replay the step from CUDA graphs where it can (``why_not_graphs``); None:
        on a CUDA device (session 31's H200 held the graphed steps' greedy tokens to the eager ones)."""
        self.model, self.cache = model, cache
        self.device = model.model.embed_tokens.weight.device
        self.native, self.why_not_native = None, "turned off (--no-native)"
        if native:
            self.native, self.why_not_native = _native_step(model, cache)
        self.compiled = bool(compile) and cache.static_decode
        self.compile_s = 0.0                       # seconds spent in calls that compiled a graph
        if self.compiled:
            use_cache_dir()
            prime_formats(cache)
        options = COMPILE_OPTIONS if backend == "inductor" else None
        self._fn = torch.compile(self._forward, backend=backend, dynamic=True, options=options) \
            if self.compiled else None
        self._shapes_seen: set[bool] = set()
        self.graphed, self.why_not_graphs = None, "turned off (--no-cuda-graphs)"
        if cuda_graphs or (cuda_graphs is None and self.device.type == "cuda"):
            self.graphed, self.why_not_graphs = self._graphs()
        elif cuda_graphs is None:
            self.why_not_graphs = f"CUDA graphs need a CUDA device, the model is on {self.device}"

    def _graphs(self) -> tuple[GraphedDecode | None, str]:
        if self.native is not None:
            return None, "the C step serves this model's decode"
        if self.device.type != "cuda":
            return None, f"CUDA graphs need a CUDA device, the model is on {self.device}"
        if not self.cache.static_decode:
            return None, "the f16 window keeps decode steps eager (its tokens move on the host)"
        max_pages = max((kv.pages_per_slot for kv in self.cache.kv_layers), default=2)
        return GraphedDecode(self._fn or self._forward, self.device, self.cache.n_slots, max_pages), ""

    @property
    def static(self) -> bool:
        """Whether steps run apart from the flattened-Batch forward (native, graphed or compiled)."""
        return self.native is not None or self.graphed is not None or self.compiled

    @property
    def path(self) -> str:
        """Which step decodes: native, graphs (eager after a failed recording), compiled or eager."""
        if self.native is not None:
            return "native"
        if self.graphed is not None:
            return "graphs" if self.graphed.why_eager is None else "eager (graphs failed)"
        return "compiled" if self.compiled else "eager"

    @property
    def setup_s(self) -> float:
        """Seconds spent compiling graphs and recording CUDA graphs so far."""
        return self.compile_s + (self.graphed.capture_s if self.graphed is not None else 0.0)

    def __call__(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        if self.native is not None or self.graphed is not None:
            self.cache.prepare_decode(slots, positions)
            if self.native is not None:
                logits = self.native(slots, tokens, positions)
            else:
                with torch.inference_mode():
                    logits = self.graphed.run(tokens, positions, slots, self.cache.decode_pages(positions))
            self.cache.commit_decode(slots)
            return logits
        if not self.compiled:
            return self.model(Batch.build([(s, [t], p) for s, t, p in zip(slots, tokens, positions)],
                                          device=self.device), self.cache)
        self.cache.prepare_decode(slots, positions)
        n_pages = max(2, self.cache.decode_pages(positions))   # >= 2: one graph for every depth
        args = [to_device(x, self.device) for x in (tokens, positions, slots)]
        shape = len(slots) == 1                                    # torch specialises size 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self._fn(*args, n_pages)
        if shape not in self._shapes_seen:                      # first call of a shape: it compiled
            self._shapes_seen.add(shape)
            self.compile_s += time.perf_counter() - t0
        self.cache.commit_decode(slots)
        return logits

    def chunk(self, slot: int, tokens: list[int], start: int, all_logits: bool = True) -> torch.Tensor:
        """Logits (len(tokens), vocab) for ``tokens`` read into ``slot`` from position ``start``
        (a drafted chunk to verify; ``all_logits=False``: a re-read, whose logits only the C step
        makes). Through the C step as rows of one slot where it serves: the same bits as decoding
        the tokens one step at a time; else one prompt-style forward."""
        if self.native is not None and self.native.window is None:
            return self([slot] * len(tokens), tokens, list(range(start, start + len(tokens))))
        return self.model(Batch.build([(slot, tokens, start)], device=self.device), self.cache, all_logits=all_logits)

    def _forward(self, tokens, positions, slots, n_pages: int) -> torch.Tensor:
        return self.model.run(DecodeBatch(tokens, positions, slots, n_pages), self.cache)


def _native_step(model, cache) -> tuple[NativeStep | None, str]:
    """The C step for this model and cache, or (None, why not). The C step is the torch backend's
    decode; backends that decode otherwise (the reference, a GPU one) keep their own path."""
    other = {kv.backend.name for kv in cache.kv_layers if not kv.backend.torch_decode}
    if other:
        return None, f"attention backend {', '.join(sorted(other))}"
    return NativeStep.build(model, cache)
