"""Every layer's cache of a model as one object: bytes, clear, rewind, snapshots, files.

Attention layers (``KVCache``) can be cut back to any length; DeltaNet layers
(``RecurrentStateCache``) only exist at the length they absorbed, so going
back means restoring a checkpoint taken at exactly that length. ``rewind``
does both, so prefix reuse, benchmark repetitions and file restores share one
path and one byte counter.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .kv import KVCache
from .recurrent import RecurrentStateCache


@dataclass
class Checkpoint:
    """The recurrent layers' state of one slot after ``n_tokens`` tokens."""

    n_tokens: int
    states: dict[int, dict[str, torch.Tensor]]         # layer index -> that layer's state

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.states.values() for t in s.values())


class ModelCache:
    """The per-layer caches of one model for ``n_slots`` sequences (indexable like a list)."""

    def __init__(self, layers: list, config=None):
        self.layers, self.config = list(layers), config
        self.kv_layers = [c for c in self.layers if isinstance(c, KVCache)]
        self.recurrent = [i for i, c in enumerate(self.layers) if isinstance(c, RecurrentStateCache)]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    @property
    def n_slots(self) -> int:
        return self.layers[0].n_slots

    def offset(self, slot: int) -> int:
        """Tokens ``slot`` holds (every layer has absorbed the same tokens)."""
        return self.layers[0].offset(slot)

    # ----- bytes --------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.kv_layers)

    @property
    def state_bytes(self) -> int:
        return sum(self.layers[i].nbytes for i in self.recurrent)

    @property
    def reserved_kv_bytes(self) -> int:
        return sum(c.reserved_bytes for c in self.kv_layers)

    def slot_kv_bytes(self, slot: int) -> int:
        return sum(c.slot_nbytes(slot) for c in self.kv_layers)

    def slot_state_bytes(self, slot: int) -> int:
        return sum(self.layers[i].slot_nbytes(slot) for i in self.recurrent)

    # ----- decode steps whose host work is done apart (the compiled path) ---------------
    @property
    def static_decode(self) -> bool:
        """Whether every layer accepts a DecodeBatch (no layer needs host work mid-step)."""
        return all(getattr(c, "static_decode", True) for c in self.layers)

    def prepare_decode(self, slots: list[int], positions: list[int]) -> None:
        """Before a DecodeBatch's forward: positions checked once, then every layer reserves
        room (nothing changes when a check fails). A slot may come several times, at consecutive
        positions from its length (a drafted chunk through the C step)."""
        expected = {}
        for slot, pos in zip(slots, positions):
            want = expected.setdefault(slot, self.offset(slot))
            if pos != want:
                raise ValueError(f"slot {slot}: the step writes position {pos} but the cache holds "
                                 f"{self.offset(slot)} tokens" + (f" (and {want - self.offset(slot)} earlier in this step)"
                                                                  if want != self.offset(slot) else ""))
            expected[slot] = want + 1
        for layer in self.layers:
            layer.prepare_decode(slots, positions)

    def commit_decode(self, slots: list[int]) -> None:
        """After it: every layer records one more token per slot."""
        for layer in self.layers:
            layer.commit_decode(slots)

    def decode_pages(self, positions: list[int]) -> int:
        """Pages attention must read per sequence for queries at ``positions`` (0 without KV layers)."""
        if not self.kv_layers:
            return 0
        return self.kv_layers[0].pages_for(max(positions) + 1)

    # ----- slots ------------------------------------------------------------------
    def clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """``dst`` holds exactly what ``src`` holds (sequences that share a prompt read it once)."""
        if src == dst:
            raise ValueError(f"copy_slot: source and destination are both slot {src}")
        for layer in self.layers:
            layer.copy_slot(src, dst)

    def checkpoint(self, slot: int) -> Checkpoint:
        """The recurrent state of ``slot`` at its current length (attention KV needs none)."""
        return Checkpoint(self.offset(slot), {i: self.layers[i].state(slot) for i in self.recurrent})

    def can_rewind(self, slot: int, n_tokens: int, checkpoint: Checkpoint | None = None) -> bool:
        if not 0 <= n_tokens <= self.offset(slot):
            return False
        return not self.recurrent or n_tokens in (0, self.offset(slot)) or \
            (checkpoint is not None and checkpoint.n_tokens == n_tokens)

    def rewind(self, slot: int, n_tokens: int, checkpoint: Checkpoint | None = None) -> None:
        """Bring ``slot`` back to its first ``n_tokens``: KV is trimmed, recurrent layers are
        kept (same length), cleared (0) or restored from ``checkpoint`` (taken at n_tokens)."""
        if not self.can_rewind(slot, n_tokens, checkpoint):
            have = "no checkpoint" if checkpoint is None else f"a checkpoint at {checkpoint.n_tokens}"
            raise ValueError(f"slot {slot}: cannot rewind from {self.offset(slot)} to {n_tokens} tokens "
                             f"with {have}")
        if n_tokens == 0:
            self.clear(slot)
            return
        if self.recurrent and n_tokens != self.offset(slot):
            for i in self.recurrent:
                self.layers[i].load_state(slot, checkpoint.states[i], n_tokens)
        for layer in self.kv_layers:
            layer.trim(slot, n_tokens)

    # ----- whole-slot state -----------------------------------------------------------
    def state(self, slot: int) -> list[dict[str, torch.Tensor]]:
        return [layer.state(slot) for layer in self.layers]

    def load_state(self, slot: int, states: list[dict[str, torch.Tensor]], lengths: list[int]) -> None:
        """Replace ``slot`` with saved per-layer states, all or nothing: every layer checks its
        part before any changes, and a failure part-way puts the slot back as it was."""
        if len(states) != len(self.layers) or len(lengths) != len(self.layers):
            raise ValueError(f"slot {slot}: {len(states)} saved layers for a model of {len(self.layers)}")
        for layer, tensors, n in zip(self.layers, states, lengths):
            layer.check_state(slot, tensors, n)
        before, before_len = self.state(slot), [layer.offset(slot) for layer in self.layers]
        try:
            for layer, tensors, n in zip(self.layers, states, lengths):
                layer.load_state(slot, tensors, n)
        except Exception:
            for layer, tensors, n in zip(self.layers, before, before_len):
                layer.load_state(slot, tensors, n)
            raise

    def save(self, path: str | Path, slots: list[int] | None = None) -> None:
        from .io import save_cache
        save_cache(path, self.layers, slots)

    def load(self, path: str | Path, slots: list[int] | None = None, into: list[int] | None = None) -> list[int]:
        from .io import load_cache
        return load_cache(path, self, slots, into)

    # ----- bad values -------------------------------------------------------------------
    def take_overflow(self) -> list[int]:
        """Slots whose K/V held NaN/inf or out-of-range values since the last call (one host read)."""
        if not self.kv_layers:
            return []
        flags = torch.stack([c.take_overflow() for c in self.kv_layers]).amax(0)
        return [s for s, bad in enumerate(flags.tolist()) if bad]
