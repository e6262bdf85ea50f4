"""Save and restore a whole model cache (every layer, all slots or some) as safetensors.

The file records each layer's ``describe()``, each saved slot's length and a
SHA-256 of every tensor's bytes. A restore into a cache whose formats or shapes
differ is refused with the differences spelled out; a file whose bytes changed
since it was written is refused before anything is touched; and a restore that
fails part-way leaves every destination slot as it was.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

MAGIC = "kvslim-cache-v2"
READABLE = ("kvslim-cache-v2",)


def save_cache(path: str | Path, layers, slots: list[int] | None = None) -> None:
    """Write ``layers`` (a ModelCache or one LayerCache per model layer) to ``path``.

    Args:
        path: destination ``.safetensors`` file.
        layers: the model's per-layer caches.
        slots: which slots to save (default: all).
    """
    layers = list(layers)
    slots = list(range(layers[0].n_slots)) if slots is None else list(slots)
    tensors, lengths = {}, {}
    for s in slots:
        lengths[str(s)] = [layer.offset(s) for layer in layers]
        for i, layer in enumerate(layers):
            for name, t in layer.state(s).items():
                tensors[f"slot{s}.layer{i}.{name}"] = t.contiguous()
    meta = {"format": MAGIC, "layers": json.dumps([layer.describe() for layer in layers]),
            "lengths": json.dumps(lengths), "sha256": checksum(tensors)}
    save_file(tensors, str(path), metadata=meta)


def load_cache(path: str | Path, layers, slots: list[int] | None = None,
               into: list[int] | None = None) -> list[int]:
    """Restore slots saved in ``path`` into ``layers`` (a ModelCache or a list of layer caches).

    Args:
        slots: saved slots to restore (default: all in the file).
        into: destination slot for each (default: the same ids).
    Returns:
        The destination slots restored.
    """
    from .model_cache import ModelCache
    cache = layers if isinstance(layers, ModelCache) else ModelCache(list(layers))
    tensors, meta = _read(path)
    _check_compatible(json.loads(meta["layers"]), cache.layers, path)
    lengths = {int(k): v for k, v in json.loads(meta["lengths"]).items()}
    slots = sorted(lengths) if slots is None else list(slots)
    into = slots if into is None else list(into)
    missing = [s for s in slots if s not in lengths]
    if missing or len(into) != len(slots):
        raise ValueError(f"{path}: slots {missing or slots} cannot be restored; the file holds slots {sorted(lengths)}")
    parts = {src: _slot_states(tensors, src, len(cache)) for src in slots}
    for src, dst in zip(slots, into):                                   # check everything first
        for layer, state, n in zip(cache.layers, parts[src], lengths[src]):
            layer.check_state(dst, state, n)
    backups = {dst: (cache.state(dst), [layer.offset(dst) for layer in cache.layers]) for dst in into}
    try:
        for src, dst in zip(slots, into):
            cache.load_state(dst, parts[src], lengths[src])
    except Exception:
        for dst, (state, n) in backups.items():
            cache.load_state(dst, state, n)
        raise
    return into


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _slot_states(tensors: dict[str, torch.Tensor], slot: int, n_layers: int) -> list[dict[str, torch.Tensor]]:
    states = []
    for i in range(n_layers):
        prefix = f"slot{slot}.layer{i}."
        states.append({k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)})
    return states


def _read(path) -> tuple[dict[str, torch.Tensor], dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cache file {path} does not exist")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    if meta.get("format") not in READABLE:
        raise ValueError(f"{path} is not a kvslim cache file this version reads (format {meta.get('format')!r}; "
                         f"readable: {', '.join(READABLE)})")
    if meta.get("sha256") != checksum(tensors):
        raise ValueError(f"{path} is corrupted: its tensors' checksum does not match the one written with them")
    return tensors, meta


def _check_compatible(saved: list[dict], layers: list, path) -> None:
    if len(saved) != len(layers):
        raise ValueError(f"{path}: the file has {len(saved)} layers, this model has {len(layers)}")
    diffs = []
    for i, (want, layer) in enumerate(zip(saved, layers)):
        have = layer.describe()
        for key in sorted(set(want) | set(have)):
            if key != "ctx" and want.get(key) != have.get(key):
                diffs.append(f"layer {i}: {key} is {want.get(key)!r} in the file, {have.get(key)!r} in this cache")
    if diffs:
        raise ValueError(f"{path} was written with other formats or shapes:\n  " + "\n  ".join(diffs[:12]))
