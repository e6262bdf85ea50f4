"""The decoder-only skeleton every model file fills in, and its cache protocol.

A model file supplies a config dataclass (``from_dict``, ``cache_layout``) and
its decoder layers; this module holds what they all share: embedding, final
norm, LM head (tied or not), RoPE tables and ``make_cache``, which builds one
cache per layer exactly as the config's layout declares (the engine never
guesses which layer needs what).
"""
from __future__ import annotations

import torch
from torch import nn

from ..cache import CacheConfig, KVCache, KVLayerSpec, ModelCache, RecurrentStateCache, StateLayerSpec
from ..cache.config import check_room
from ..cache.spec import layout_bytes
from ..devices import to_device
from .batch import Batch, DecodeBatch
from .layers import RMSNorm, Rope
from .matmul_precision import prompt_matmuls


class CausalLM(nn.Module):
    """embed_tokens -> layers -> norm -> lm_head, over a flattened :class:`Batch`."""

    def __init__(self, config, layers: list[nn.Module], rope: Rope, zero_centered_norm: bool):
        super().__init__()
        self.config = config
        self.model = nn.Module()                                    # keeps HF's "model." prefix
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered_norm)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                          bias=False)
        self.rope = rope
        self.kv_calibration = None          # a formats.klt.KVCalibration, if the model has one

    def fuse_projections(self) -> None:
        """Compute projections that read the same input as one matmul each (see ``layers.Fused``)."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections()

    def _apply(self, fn, recurse=True):
        """``.to(device)``, ``.half()`` and kin convert each linear's weight on its own, which
        leaves a fused tensor (not a parameter) behind on the old device: fuse again afterwards,
        from the converted weights, so the fused matmuls read them and they share one tensor."""
        fused = any(getattr(m, "fused", None) is not None for m in self.modules())
        out = super()._apply(fn, recurse)
        if fused:
            self.fuse_projections()
        return out

    @property
    def output_weight(self) -> torch.Tensor:
        """The output head's weight (with quantized weights: its uint8 blocks; use ``logits``)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (N, hidden) -> logits (N, vocab) through lm_head or the tied
        embeddings; a quantized embedding table (kvslim.weights) multiplies by its own blocks."""
        if self.lm_head is not None:
            return self.lm_head(h)
        table = self.model.embed_tokens
        return table.project(h) if hasattr(table, "project") else torch.nn.functional.linear(h, table.weight)

    @torch.inference_mode()
    def forward(self, batch: Batch | DecodeBatch, caches: list, all_logits: bool = False) -> torch.Tensor:
        """Run the batch through every layer, appending to ``caches``.

        Returns float32 logits: one row per segment (its last token), or one per
        token with ``all_logits``. float32 matmuls of several tokens on a CPU with bf16 dot
        products run as bf16x3 (``matmul_precision``: float32's accuracy, about 2x faster).
        """
        with prompt_matmuls(batch.tokens):
            return self.run(batch, caches, all_logits)

    def run(self, batch, caches: list, all_logits: bool = False) -> torch.Tensor:
        """``forward`` without the inference-mode wrapper: what a compiled step traces."""
        x, delta = self.model.embed_tokens(batch.tokens), None
        rope = self.rope.tables(batch.positions, x.dtype)
        layers = self.model.layers
        every_row = all_logits or batch.is_decode                  # else the final norm reads the last rows only
        for i, (layer, cache) in enumerate(zip(layers, caches)):
            # delta: added by the next norm; or, handed that norm, the layer adds and norms (``Normed``)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm if every_row else None
            x, delta = layer(x, batch, cache, rope, delta, nxt)
        if not all_logits and not batch.is_decode:                   # decode: every row is a last row
            rows = to_device(batch.last_rows, x.device)            # a list index would copy synchronously
            x, delta = x[rows], delta[rows]
        return self.logits(self.model.norm.add_forward(x, delta)[0]).float()

    def make_cache(self, ctx: int | CacheConfig, n_slots: int = 1, type_k: str = "f16", type_v: str = "f16",
                   device: torch.device | str | None = None, **kv_options) -> ModelCache:
        """One cache per layer, from the config's declared layout.

        Args:
            ctx: a ``CacheConfig``, or tokens per slot (the other arguments then build one).
            kv_options: ``page_size``, ``f16_window``, ``backend`` when ``ctx`` is a number.
        """
        config = ctx if isinstance(ctx, CacheConfig) else CacheConfig(
            ctx, n_slots, type_k, type_v, device=device or self.model.embed_tokens.weight.device, **kv_options)
        layout = self.config.cache_layout(config.type_k.name, config.type_v.name)
        check_room(config, sum(layout_bytes(layout, config.ctx, config.n_slots, config.page_size, config.f16_window)))
        layers = []
        for spec in layout:
            if isinstance(spec, KVLayerSpec):
                layers.append(KVCache(spec, config.ctx, config.n_slots, config.page_size, config.f16_window,
                                      config.device, config.backend,
                                      self._layer_calibration(spec, sum(isinstance(c, KVCache) for c in layers))))
            elif isinstance(spec, StateLayerSpec):
                layers.append(RecurrentStateCache(spec, config.n_slots, device=config.device))
            else:
                raise TypeError(f"unknown layer cache spec {spec!r}")
        return ModelCache(layers, config)

    def _layer_calibration(self, spec: KVLayerSpec, index: int):
        """The index-th attention layer's KV calibration, when a format of ``spec`` needs one."""
        from .. import formats
        if not any(formats.get(t).calibrated for t in (spec.type_k, spec.type_v)):
            return None
        return None if self.kv_calibration is None else self.kv_calibration.layer(index)
