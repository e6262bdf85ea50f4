"""Decode launches tuned on a GPU: per device, the launch setting a lease's sweep timed fastest.

``benchmarks/gpu_decode.py --sweep --tuned-out FILE`` times every launch setting of the decode
kernels (the tile kernel's keys a block, warps, products and prefetch; decode by warps; KERNEL
"mma", codes decoded into tensor-core operands, f16 products, which only the bf16 backend takes) against
the attention backend's default launch, and writes to FILE, per K/V pair, head_dim, query rows
a KV head and backend, the setting whose step took the least time over the batches it timed
(their times' geometric mean) where that beat the default's, with its output within TOLERANCE
of the torch loop's. A lease's file is committed as ``kvslim/gpu/tuned/<device name>.json``
(vLLM keeps its fused-MoE launch configs per device the same way) and read on that device by
``attention.paged_decode``; nothing is chosen by batch, so a sequence's bits stay the same
whatever its batch (as SPLIT_KEYS keeps them).

Which file serves: KVSLIM_DECODE_TUNED unset, the packaged one named for the device, if any;
"0", none (the defaults, for A/B runs); a path, that file whatever device it names (a lease's
own sweep, before it is committed). The float32 backend takes only settings with float32
products; the bf16 backend's products are f16 on tensor cores, and it takes either kind.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .. import formats
from . import paged_prefill, pow2

DIR = Path(__file__).with_name("tuned")
BACKENDS = {"f32": None, "bf16": {"DOT": "f16"}}   # a backend's default launch (cache.attention.KERNEL_DOTS')
TOLERANCE = 0.02          # largest difference from the torch loop's output, of its largest |value|: a
                          # gross error's mark (f16 products differ by ~0.3% at 128K), not parity's
ENV = "KVSLIM_DECODE_TUNED"


@dataclass(frozen=True)
class Entry:
    """One tuned launch: what it serves, its launch overrides and keys a split, and what the
    sweep measured (ms a step by "depth x batch", for it and the backend's default)."""
    k: str
    v: str
    head_dim: int
    rows: int
    backend: str
    tune: dict = field(hash=False)
    split_keys: int = paged_prefill.SPLIT_KEYS
    ms: dict = field(default_factory=dict, hash=False)
    default_ms: dict = field(default_factory=dict, hash=False)

    @property
    def key(self) -> tuple:
        return self.k, self.v, self.head_dim, self.rows, self.backend

    def as_json(self) -> dict:
        return {"k": self.k, "v": self.v, "head_dim": self.head_dim, "rows": self.rows, "backend": self.backend,
                "tune": self.tune, "split_keys": self.split_keys,
                "ms": {p: round(t, 4) for p, t in sorted(self.ms.items())},
                "default_ms": {p: round(t, 4) for p, t in sorted(self.default_ms.items())}}


def file_for(device_name: str) -> Path:
    """The packaged file for a device, from its name as torch gives it ("NVIDIA H200")."""
    return DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def float32_products(tune: dict | None) -> bool:
    """Whether a launch takes its products in float32 (FMAs or tl.dot's "ieee"/"tf32x3"), which
    the float32 backend requires; decode by warps always does, KERNEL "mma" never (f16 operands)."""
    tune = tune or {}
    kernel = tune.get("KERNEL", "tiles")
    return kernel == "warps" or (kernel == "tiles" and tune.get("DOT", "ieee") in ("ieee", "tf32x3", "fma"))


def _entry(raw, where: str) -> Entry:
    """An entry from its JSON, checked: known formats and backend, a launch the kernels accept."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: an object expected, got {type(raw).__name__}")
    missing = {"k", "v", "head_dim", "rows", "backend", "tune"} - set(raw)
    if missing:
        raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
    try:
        fmt_k, fmt_v = formats.get(raw["k"], role="k"), formats.get(raw["v"], role="v")
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if raw["backend"] not in BACKENDS:
        raise ValueError(f"{where}: backend {raw['backend']!r}, expected one of {', '.join(BACKENDS)}")
    head_dim, rows, split = raw["head_dim"], raw["rows"], raw.get("split_keys", paged_prefill.SPLIT_KEYS)
    for name, value in (("head_dim", head_dim), ("rows", rows), ("split_keys", split)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} {value!r} is not a positive integer")
    if not isinstance(raw["tune"], dict):
        raise ValueError(f"{where}: tune {raw['tune']!r} is not an object")
    if raw["backend"] == "f32" and not float32_products(raw["tune"]):
        raise ValueError(f"{where}: the f32 backend takes float32 products, not those of "
                         f"KERNEL={raw['tune'].get('KERNEL', 'tiles')!r} DOT={raw['tune'].get('DOT')!r}")
    try:
        paged_prefill._launch_config(fmt_k, fmt_v, rows, head_dim, raw["tune"])   # the kernels' own checks
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    times = {key: {str(p): float(t) for p, t in raw.get(key, {}).items()} for key in ("ms", "default_ms")}
    return Entry(fmt_k.name, fmt_v.name, head_dim, pow2(rows), raw["backend"], dict(raw["tune"]), split, **times)


def load(path: str | Path) -> dict[tuple, Entry]:
    """A tuned file's entries by what they serve; a malformed file is a ValueError naming it and
    the entry."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tuned decode launches {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("decode"), list):
        raise ValueError(f"tuned decode launches {path}: an object with a 'decode' list expected")
    entries = [_entry(raw, f"tuned decode launches {path}, entry {i}") for i, raw in enumerate(doc["decode"])]
    return {e.key: e for e in entries}


def save(path: str | Path, entries: list[Entry], device: str, source: str) -> None:
    """Entries into ``path``, over those of the same key already there (the others kept), with the
    device, Triton's version and the command that measured them."""
    path = Path(path)
    kept = load(path) if path.exists() else {}
    kept.update({e.key: e for e in entries})
    import triton
    doc = {"device": device, "triton": triton.__version__, "torch": torch.__version__, "measured": source,
           "decode": [e.as_json() for _, e in sorted(kept.items())]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)                   # a run cut by its time limit leaves the last whole file


@lru_cache(maxsize=None)
def _entries(device_type: str, index: int | None) -> dict[tuple, Entry]:
    """The entries that serve a device: KVSLIM_DECODE_TUNED's file, or the packaged one for its name."""
    chosen = os.environ.get(ENV)
    if chosen == "0":
        return {}
    if chosen:
        return load(chosen)
    if device_type != "cuda":
        return {}
    path = file_for(torch.cuda.get_device_name(index))
    return load(path) if path.exists() else {}


def reload() -> None:
    """Read the files again at the next launch (after KVSLIM_DECODE_TUNED changed in-process)."""
    _entries.cache_clear()


def decode_launch(fmt_k, fmt_v, head_dim: int, n_rows: int, backend: str,
                  device: torch.device) -> tuple[dict | None, int]:
    """(tune, keys a split) for a decode step's launch: the tuned entry for these formats, head_dim,
    query rows a KV head and backend on this device, else the backend's default launch."""
    entry = _entries(device.type, device.index).get((fmt_k.name, fmt_v.name, head_dim, pow2(n_rows), backend))
    if entry is None:
        return BACKENDS[backend], paged_prefill.SPLIT_KEYS
    return entry.tune, entry.split_keys


def same_launch(fmt_k, fmt_v, head_dim: int, n_rows: int, a: tuple[dict | None, int],
                b: tuple[dict | None, int]) -> bool:
    """Whether two (tune, keys a split) come to the same launch, the kernels' defaults filled in."""
    def config(tune):
        c = paged_prefill._launch_config(fmt_k, fmt_v, n_rows, head_dim, tune)
        return {**c, "PREFETCH": int(c.get("PREFETCH") or 0)}          # unset, False and 0 are one launch
    return a[1] == b[1] and config(a[0]) == config(b[0])


def best(trials: list[tuple[dict, int, dict, float]], default: int, backend: str) -> tuple | None:
    """The sweep's choice for one pair and backend. ``trials``: (tune, keys a split, ms by point
    (a "depth x batch" label), largest difference from the torch loop's output over its largest
    |value|); ``default``: the index of the backend's default launch among them. -> (tune,
    split, its ms, the default's ms) of the fastest trial the backend may take, within TOLERANCE
    and timed at every point the default was, by the geometric mean of those times, where it
    beat the default's; else None."""
    base = trials[default][2]
    if not base:
        return None
    points = sorted(base)
    mean = lambda ms: math.exp(sum(math.log(ms[p]) for p in points) / len(points))   # noqa: E731
    fit = [t for t in trials if (backend == "bf16" or float32_products(t[0])) and t[3] <= TOLERANCE
           and all(p in t[2] for p in points)]
    top = min(fit, key=lambda t: mean(t[2]), default=None)
    if top is None or top is trials[default] or mean(top[2]) >= mean(base):
        return None
    return top[0], top[1], {p: top[2][p] for p in points}, {p: base[p] for p in points}
