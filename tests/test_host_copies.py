"""No forward copies host data to the device synchronously, nor reads the device back.

On a GPU, ``torch.tensor(values, device="cuda")`` or a CPU tensor's ``.to("cuda")`` is a
synchronous copy from pageable memory: the host waits for every queued kernel, so done per
layer it drains the GPU's queue dozens of times a token, and it breaks a CUDA graph
recording. Without a GPU this is checked on the meta device: the model and its caches live
there, so any CPU tensor that meets the forward is host data a GPU run would copy, and any read
of a meta tensor (``.item()``, ``.tolist()``, ``bool``) is a device-to-host sync. Allowed: copies
through ``kvslim.devices.to_device`` (pinned memory, asynchronous on a GPU), and constants copied
the first time a device asks for them (the first forward here is a warm-up, then one is watched).
The CUDA tests (tests/test_runtime.py, under ``torch.cuda.set_sync_debug_mode("error")``) check
the same on a GPU.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvslim.devices import to_device
from kvslim.formats.klt import KVCalibration, random_calibration
from kvslim.models import Batch, DecodeBatch, build_on_meta, config_from_dict
from kvslim.models.layers import Experts

from .conftest import LINEAR, MOE, TINY

CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5_text", **TINY, **LINEAR),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", **TINY, **LINEAR, **MOE),
    "llama": dict(model_type="llama", **TINY),
    "gemma": dict(model_type="gemma", **TINY),
}
DEVICE_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/kvslim/" in f.filename]
    return " < ".join(f"{f.filename.split('/kvslim/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))


def _through_to_device() -> bool:
    return any(f.filename.endswith("kvslim/devices.py") for f in traceback.extract_stack())


class HostTraffic(TorchFunctionMode):
    """Notes host data sent to the meta device, and reads of meta tensors, with where they happen."""

    def __init__(self):
        super().__init__()
        self.found = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in ("tensor", "as_tensor") and _is_meta(kwargs.get("device")):
            self.found[f"torch.{name}(host values, device=...) at {_where()}"] += 1
        elif name == "to" and isinstance(first, torch.Tensor) and first.device.type == "cpu" \
                and any(_is_meta(a) for a in (*args[1:], *kwargs.values())) and not _through_to_device():
            self.found[f"a CPU tensor's .to(device) at {_where()}"] += 1
        elif name in ("copy_", "index_copy_") and isinstance(first, torch.Tensor) and first.device.type == "meta" \
                and any(isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() for a in args[1:]):
            self.found[f"{name} from a CPU tensor at {_where()}"] += 1
        elif name in ("__getitem__", "__setitem__", "index_select", "index_add_") and isinstance(first, torch.Tensor) \
                and first.device.type == "meta" and _host_index(args[1:]):
            self.found[f"{name} with host indices at {_where()}"] += 1
        elif name in DEVICE_READS and isinstance(first, torch.Tensor) and first.device.type == "meta":
            self.found[f"{name}() of a device tensor at {_where()}"] += 1
        return func(*args, **kwargs)


def _host_index(args) -> bool:
    """Whether an index holds a list (advanced indexing by host values) or a CPU tensor: either is
    copied to the device first. Ints and slices, alone or in a tuple, are basic indexing."""
    index = args[0] if args else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) or (isinstance(i, torch.Tensor) and i.device.type == "cpu" and i.dim() > 0)
               for i in parts)


def _is_meta(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "meta"


def _step(model, cache, decode_batch: bool, i: int, watch=None) -> None:
    """Step ``i`` after the prompts, its forward inside ``watch``: a DecodeBatch step for both
    slots (inputs made as DecodeStep makes them), or a flat batch mixing a prompt chunk of slot 0
    (at depth) with a decode token of slot 1 (Batch.build inside: it is part of every step)."""
    watch = watch or contextlib.nullcontext()
    if decode_batch:
        positions = [10 + i, 4 + i]
        cache.prepare_decode([0, 1], positions)
        inputs = [to_device(x, "meta") for x in ([5, 6], positions, [0, 1])]
        with watch:
            model.run(DecodeBatch(*inputs, 2), cache)
        cache.commit_decode([0, 1])
    else:
        with watch:
            model.run(Batch.build([(0, list(range(5, 25)), 10 + 20 * i), (1, [7], 4 + i)], device="meta"), cache)


@functools.lru_cache(maxsize=None)
def _calibration(n_heads: int, head_dim: int):
    """klt3 fitted once per shape (1 s a fit; the cases only read it)."""
    return random_calibration("klt3", n_heads, head_dim)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("type_k,type_v,window", [("f16", "f16", 0), ("q8_0", "turbo4", 0), ("turbo3", "q5_0", 0),
                                                  ("iq4_nl", "q4_0", 8), ("q8_0", "klt3", 0)])
@pytest.mark.parametrize("decode_batch", [True, False], ids=["decode-step", "flat-batch"])
def test_forward_sends_no_host_data_synchronously(kind, type_k, type_v, window, decode_batch, monkeypatch):
    if decode_batch and window:
        pytest.skip("the f16 window keeps the flat batch (DecodeStep refuses it)")
    # a mixture routes on the device where the GPU path does (Experts.groups: CUDA); the meta
    # device stands for it here
    monkeypatch.setattr(Experts, "groups", lambda self, x, experts: True)
    klt = type_v == "klt3"                     # rows of 64 at least, and a calibration on random rows
    model = build_on_meta(config_from_dict({**CONFIGS[kind], **({"head_dim": 64} if klt else {})}))
    if klt:
        c = model.config
        model.kv_calibration = KVCalibration([_calibration(c.num_key_value_heads, c.head_dim)] * 4)
    cache = model.make_cache(256, 2, type_k, type_v, device="meta", page_size=16, f16_window=window)
    with torch.inference_mode():
        model.run(Batch.build([(0, list(range(3, 13)), 0), (1, [4, 5, 6, 7], 0)], device="meta"), cache)
        _step(model, cache, decode_batch, 0)                     # warm-up: constants reach the device once
        watch = HostTraffic()
        _step(model, cache, decode_batch, 1, watch)
    assert not watch.found, "\n".join(f"{n} x {what}" for what, n in watch.found.items())
