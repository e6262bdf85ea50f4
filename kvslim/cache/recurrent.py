"""The linear-attention (Gated DeltaNet) layer's state: fixed size per slot.

Per slot: the conv state (the last ``kernel - 1`` inputs of the depthwise
causal conv) and the recurrent state (one k_head_dim x v_head_dim matrix per
value head), both fp32 whatever the model's dtype. Its size does not depend on
the context length; that is the point of the hybrid architecture.

A recurrent state cannot be rewound: ``trim`` accepts only 0 (forget) or the
current length. The server restores earlier states from checkpoints instead.
"""
from __future__ import annotations

from dataclasses import asdict

import torch

from .spec import StateLayerSpec


class RecurrentStateCache:
    """Conv and recurrent state for one DeltaNet layer and ``n_slots`` sequences."""

    def __init__(self, spec: StateLayerSpec, n_slots: int = 1, device: torch.device | str = "cpu"):
        if n_slots < 1:
            raise ValueError(f"n_slots must be at least 1, got {n_slots}")
        self.spec, self.n_slots, self.device = spec, n_slots, torch.device(device)
        # Allocated once: the whole point is that this never grows.
        self.conv = torch.zeros(n_slots, *spec.conv_shape, dtype=torch.float32, device=self.device)
        self.recurrent = torch.zeros(n_slots, *spec.recurrent_shape, dtype=torch.float32, device=self.device)
        self._len = [0] * n_slots

    def offset(self, slot: int) -> int:
        self._check_slot(slot)
        return self._len[slot]

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()

    def slot_nbytes(self, slot: int) -> int:
        self._check_slot(slot)
        return self.spec.bytes_per_slot

    def describe(self) -> dict:
        return {"cache": type(self).__name__, **asdict(self.spec)}

    def advance(self, slot: int, n_tokens: int) -> None:
        """Record that the layer absorbed ``n_tokens`` more tokens into ``slot``'s state."""
        self._check_slot(slot)
        self._len[slot] += n_tokens

    def prepare_decode(self, slots: list[int], positions: list[int]) -> None:
        """Nothing to reserve: the state has a fixed size (positions are checked by ModelCache)."""

    def commit_decode(self, slots: list[int]) -> None:
        for slot in slots:
            self._len[slot] += 1

    def trim(self, slot: int, n_tokens: int) -> None:
        self._check_slot(slot)
        if n_tokens == self._len[slot]:
            return
        if n_tokens != 0:
            raise ValueError(f"slot {slot}: a recurrent state cannot be rewound from {self._len[slot]} to "
                             f"{n_tokens} tokens; restore a checkpoint or clear it")
        self.clear(slot)

    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()
        self._len[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        self._check_slot(src)
        self._check_slot(dst)
        self.conv[dst], self.recurrent[dst] = self.conv[src], self.recurrent[src]
        self._len[dst] = self._len[src]

    def state(self, slot: int) -> dict[str, torch.Tensor]:
        self._check_slot(slot)
        return {"conv": self.conv[slot].cpu().clone(), "recurrent": self.recurrent[slot].cpu().clone()}

    def check_state(self, slot: int, tensors: dict[str, torch.Tensor], n_tokens: int) -> None:
        """Raise ValueError unless ``load_state`` would accept these tensors (nothing changes)."""
        self._check_slot(slot)
        for name, dst in (("conv", self.conv), ("recurrent", self.recurrent)):
            src = tensors.get(name)
            if src is None or tuple(src.shape) != tuple(dst.shape[1:]):
                got = "nothing" if src is None else f"shape {tuple(src.shape)}"
                raise ValueError(f"slot {slot}: saved {name} state has {got}, "
                                 f"this layer needs {tuple(dst.shape[1:])}")
        if n_tokens < 0:
            raise ValueError(f"slot {slot}: saved state length {n_tokens} is negative")

    def load_state(self, slot: int, tensors: dict[str, torch.Tensor], n_tokens: int) -> None:
        self.check_state(slot, tensors, n_tokens)
        self.conv[slot].copy_(tensors["conv"])
        self.recurrent[slot].copy_(tensors["recurrent"])
        self._len[slot] = n_tokens

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot!r} does not exist; this cache has slots 0..{self.n_slots - 1}")
