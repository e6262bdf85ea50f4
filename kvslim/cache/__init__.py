"""Caches: packed KV pages for attention layers, fixed-size state for DeltaNet layers."""
from .attention import attend, attend_reference
from .io import load_cache, save_cache
from .kv import KVCache
from .protocol import LayerCache
from .recurrent import RecurrentStateCache
from .spec import KVLayerSpec, StateLayerSpec

__all__ = ["KVCache", "RecurrentStateCache", "LayerCache", "KVLayerSpec", "StateLayerSpec",
           "attend", "attend_reference", "save_cache", "load_cache"]
