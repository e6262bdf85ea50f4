"""Save and restore a whole model cache (every layer, all slots or some) as safetensors.

The file records each layer's ``describe()`` and each saved slot's length; a
restore into a cache whose formats or shapes differ is refused with the
differences spelled out.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MAGIC = "kvslim-cache-v1"


def save_cache(path: str | Path, layers: list, slots: list[int] | None = None) -> None:
    """Write ``layers`` (one LayerCache per model layer) to ``path``.

    Args:
        path: destination ``.safetensors`` file.
        layers: the model's per-layer caches.
        slots: which slots to save (default: all).
    """
    slots = list(range(layers[0].n_slots)) if slots is None else list(slots)
    tensors, lengths = {}, {}
    for s in slots:
        lengths[str(s)] = [layer.offset(s) for layer in layers]
        for i, layer in enumerate(layers):
            for name, t in layer.state(s).items():
                tensors[f"slot{s}.layer{i}.{name}"] = t.contiguous()
    meta = {"format": MAGIC, "layers": json.dumps([layer.describe() for layer in layers]),
            "lengths": json.dumps(lengths)}
    save_file(tensors, str(path), metadata=meta)


def load_cache(path: str | Path, layers: list, slots: list[int] | None = None,
               into: list[int] | None = None) -> list[int]:
    """Restore slots saved in ``path`` into ``layers``.

    Args:
        slots: saved slots to restore (default: all in the file).
        into: destination slot for each (default: the same ids).
    Returns:
        The destination slots restored.
    """
    tensors, meta = _read(path)
    _check_compatible(json.loads(meta["layers"]), layers, path)
    lengths = {int(k): v for k, v in json.loads(meta["lengths"]).items()}
    slots = sorted(lengths) if slots is None else list(slots)
    into = slots if into is None else list(into)
    missing = [s for s in slots if s not in lengths]
    if missing or len(into) != len(slots):
        raise ValueError(f"{path}: slots {missing or slots} cannot be restored; the file holds slots {sorted(lengths)}")
    for src, dst in zip(slots, into):
        for i, layer in enumerate(layers):
            prefix = f"slot{src}.layer{i}."
            parts = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
            layer.load_state(dst, parts, lengths[src][i])
    return into


def _read(path) -> tuple[dict[str, torch.Tensor], dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cache file {path} does not exist")
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    if meta.get("format") != MAGIC:
        raise ValueError(f"{path} is not a kvslim cache file (format {meta.get('format')!r})")
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
