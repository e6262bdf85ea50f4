"""Caches: a paged pool of packed K/V per attention layer, fixed-size state per DeltaNet
layer, and ``ModelCache`` holding them all for one model."""
from .attention import attend, attend_batch, attend_reference
from .backends import backend_names, get_backend, register_backend
from .config import CacheConfig
from .io import load_cache, save_cache
from .kv import KVCache
from .model_cache import Checkpoint, ModelCache
from .protocol import LayerCache
from .recurrent import RecurrentStateCache
from .spec import KVLayerSpec, StateLayerSpec

__all__ = ["KVCache", "RecurrentStateCache", "LayerCache", "KVLayerSpec", "StateLayerSpec", "ModelCache",
           "Checkpoint", "CacheConfig", "attend", "attend_batch", "attend_reference", "save_cache", "load_cache",
           "get_backend", "register_backend", "backend_names"]
