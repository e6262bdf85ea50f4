"""A model's KV calibration (for the klt formats): V rows of real text, per attention layer.

Windows of ``n_ctx`` tokens spread over the text are prefilled into an f32 cache; every
value row they leave in each attention layer is read back exactly and handed to
``formats.klt.calibrate_layer`` with that layer's output-projection weighting
(``output_weights``: the model reads V only through o_proj, so that is the error to
minimise). Windows span whole contexts so that the statistics cover the positions a
cache of that context holds. Text like the model's training data makes a calibration
that carries to other text; the bundled model's was made on its held-out training text.
"""
from __future__ import annotations

import torch

from .. import formats
from ..formats.klt import KVCalibration, calibrate_layer
from ..models.batch import Batch
from ..models.layers import Attention


def klt_formats() -> dict[str, float]:
    """Every klt row of the table -> its mean code bits per value (the tables a calibration holds)."""
    return {spec.name: float(spec.code_bits) for spec in formats.TABLE if spec.family == "klt"}


def window_starts(n_tokens: int, n_ctx: int, windows: int) -> list[int]:
    """``windows`` starts, evenly spread, of whole windows of ``n_ctx`` tokens (fewer if the
    text is short; at least one token window of the whole text when it is shorter than one)."""
    if n_tokens <= n_ctx:
        return [0]
    count = max(1, min(windows, n_tokens // n_ctx))
    step = (n_tokens - n_ctx) / (count - 1) if count > 1 else 0
    return sorted({int(round(i * step)) for i in range(count)})


def value_rows(llm, token_ids: list[int], n_ctx: int, windows: int) -> list[torch.Tensor]:
    """Per attention layer, the f32 value rows ``(N, H, D)`` of the text's windows."""
    engine = llm.with_cache_types("f32", "f32").engine
    n_ctx = min(n_ctx, engine.ctx)
    rows: list[list[torch.Tensor]] | None = None
    for start in window_starts(len(token_ids), n_ctx, windows):
        ids = token_ids[start:start + n_ctx]
        with engine.borrowed_slot() as slot:
            for at in range(0, len(ids), engine.n_ubatch):
                engine.model(Batch.build([(slot, ids[at:at + engine.n_ubatch], at)], device=engine.device),
                             engine.cache, all_logits=False)
            layers = engine.cache.kv_layers
            rows = rows or [[] for _ in layers]
            for out, layer in zip(rows, layers):
                _, vb = layer.rows(slot)
                out.append(layer.fmt_v.decode(vb, layer.head_dim).cpu())
    return [torch.cat(r) for r in rows or []]


def attention_modules(model) -> list:
    """The model's attention blocks in layer order (the order of the cache's KV layers)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def output_weights(attn: Attention) -> torch.Tensor:
    """(Hkv, D, D): per KV head, the square root of the Gram matrix of the output projection's
    columns that read it (summed over the query heads of its group). Read through the module
    (identity in, minus bias) so quantized projections work too."""
    dim, group = attn.head_dim, attn.n_heads // attn.n_kv_heads
    param = next(attn.o_proj.parameters())
    eye = torch.eye(attn.n_heads * dim, device=param.device, dtype=param.dtype if param.is_floating_point() else None)
    with torch.no_grad():
        cols = (attn.o_proj(eye) - attn.o_proj(torch.zeros_like(eye[:1]))).double().cpu()   # (H*D, hidden)
    out = []
    for h in range(attn.n_kv_heads):
        w = cols[h * group * dim:(h + 1) * group * dim].reshape(group, dim, -1)
        lam, u = torch.linalg.eigh(torch.einsum("gdk,gek->de", w, w))
        out.append((u * lam.clamp_min(lam.max() * 1e-6).sqrt()) @ u.T)
    return torch.stack(out)


def calibrate(llm, token_ids: list[int], n_ctx: int = 4096, windows: int = 4, source: str = "") -> KVCalibration:
    """Calibrate ``llm``'s model on ``token_ids``; the result can be saved beside the weights."""
    rows = value_rows(llm, token_ids, n_ctx, windows)
    if not rows:
        raise ValueError("the model has no attention layers: there is no KV cache to calibrate")
    if rows[0].shape[0] < 4 * rows[0].shape[-1]:
        raise ValueError(f"{rows[0].shape[0]} tokens are too few to calibrate rows of {rows[0].shape[-1]} values; "
                         f"give at least {4 * rows[0].shape[-1]} (a few thousand is better)")
    table = klt_formats()
    attns = attention_modules(llm.engine.model)
    if len(attns) != len(rows):
        raise ValueError(f"found {len(attns)} attention blocks for {len(rows)} KV layers")
    return KVCalibration([calibrate_layer(r, table, output_weights(a)) for r, a in zip(rows, attns)], source)


__all__ = ["calibrate", "value_rows", "window_starts", "klt_formats", "output_weights", "attention_modules"]
