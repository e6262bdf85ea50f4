"""Read GGUF files (llama.cpp's or ours) back into Hugging Face terms.

``read_config`` and the size helpers look at metadata and tensor infos only;
``gguf.GGUFReader`` memory-maps the file, so no tensor data is read until
``read_model`` asks for it. ``read_model`` returns a state dict with kvslim's (=
Hugging Face's) names and layouts: every convention ``names.py`` lists is undone.
Quantized tensors are dequantized to float32, or with ``keep_quantized`` stay ggml
blocks (``kvslim.weights.QuantTensor``, memory-mapped from the file unless a layout
convention had to copy them): the conventions on matrices are moves of whole rows
(or whole blocks), so they are applied to the blocks without touching a value.
A model split in several files (llama-gguf-split's ``-00001-of-0000N.gguf`` parts) reads as one,
from any of its parts (``open_gguf``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ..weights import QuantTensor, cat, from_ggml, supported_message
from . import names as N

BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_T = gguf.GGMLQuantizationType
_FLOAT = (_T.F32, _T.F16, _T.BF16)


# llama.cpp's split files (llama-gguf-split, convert_hf_to_gguf.py --split-max-tensors/-size):
# <prefix>-00001-of-00003.gguf ...; the first holds the metadata, every part some of the tensors.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def open_gguf(path: str | Path) -> "GGUFModel":
    """The model in ``path`` (one GGUF file, or any part of a split one), or a ValueError that
    says why it is not a usable GGUF."""
    first = _open_one(Path(path))
    count = _value(first, "split.count", 0)
    if count <= 1:
        return GGUFModel([(Path(path), first)])
    return GGUFModel(_open_parts(Path(path), count))


def _open_one(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:                                       # bad magic, truncated header, ...
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":                               # a GGUF cut short (a partial download)
                raise ValueError(f"{path}: truncated or corrupt GGUF file ({err})") from None
        raise ValueError(f"{path}: not a GGUF file ({err})") from None


def _open_parts(path: Path, count: int) -> list[tuple[Path, gguf.GGUFReader]]:
    """Every part of a split model, in order, from any one of them; each checked to be the part
    its name says, and the tensors counted against the first part's split.tensors.count."""
    m = SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ValueError(f"{path}: part of a GGUF split in {count} files, but not named "
                         f"<prefix>-NNNNN-of-{count:05d}.gguf, so its other parts cannot be found")
    parts = []
    for no in range(1, count + 1):
        part = path.with_name(f"{m['prefix']}-{no:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise ValueError(f"{part}: missing; the model is split in {count} files and needs all of them")
        reader = _open_one(part)
        if _value(reader, "split.no", -1) != no - 1 or _value(reader, "split.count", 0) != count:
            raise ValueError(f"{part}: its split.no/split.count metadata say it is not part {no} of {count}")
        parts.append((part, reader))
    expected = _value(parts[0][1], "split.tensors.count")
    found = sum(len(r.tensors) for _, r in parts)
    if expected is not None and found != expected:
        raise ValueError(f"{path}: the {count} parts hold {found} tensors, the first part says {expected}")
    return parts


class GGUFModel:
    """A GGUF model read as one file: metadata from the (first) file, tensors from every part,
    each with the file it lives in (``path_of``), since its blocks are memory-mapped from it."""

    def __init__(self, parts: list[tuple[Path, gguf.GGUFReader]]):
        self.paths = [p for p, _ in parts]
        self.first = parts[0][1]
        self.tensors = [t for _, r in parts for t in r.tensors]
        self._file = {t.name: p for p, r in parts for t in r.tensors}

    def get_field(self, key: str):
        return self.first.get_field(key)

    def path_of(self, tensor) -> Path:
        return self._file[tensor.name]


def _value(reader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def architecture(reader: GGUFModel) -> str:
    arch = _value(reader, "general.architecture")
    if arch not in N.HF_MODEL_TYPE:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(N.HF_MODEL_TYPE))}")
    return arch


# ----- configuration ------------------------------------------------------------
def read_config(path: str | Path) -> dict:
    """A Hugging Face-style (text) config.json dict from the GGUF's metadata."""
    return gguf_config(open_gguf(path))


def gguf_config(reader: GGUFModel) -> dict:
    arch = architecture(reader)
    key = _ArchKeys(reader, arch)
    hidden, heads = key.positive("embedding_length"), key.positive("attention.head_count")
    head_dim = key.int("attention.key_length", hidden // heads)
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": N.HF_MODEL_TYPE[arch],
        "vocab_size": _vocab_size(reader),
        "hidden_size": hidden,
        "num_hidden_layers": _layer_count(reader, key),
        "num_attention_heads": heads,
        "num_key_value_heads": key.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "intermediate_size": key.int("feed_forward_length", 0),
        "rms_norm_eps": key.float("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": key.int("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_parameters": _rope_parameters(key, head_dim),
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch in N.HYBRID:
        config.update(_hybrid_fields(key, config["num_hidden_layers"]))
    if arch in N.MOE:
        config.update(_moe_fields(key))
    return config


class _ArchKeys:
    """``{arch}.*`` metadata. Per-layer arrays (some files store head counts or FFN sizes
    per layer) collapse to their largest entry; floats come back at float32 precision
    written the short way (1e-06, not 9.99999997e-07)."""

    def __init__(self, reader: GGUFModel, arch: str):
        self.reader, self.arch = reader, arch

    def get(self, name: str, default: Any = None) -> Any:
        return _value(self.reader, f"{self.arch}.{name}", default)

    def int(self, name: str, default: Any = KeyError) -> int:
        value = self.get(name)
        if value is None:
            if default is KeyError:
                raise ValueError(f"GGUF metadata {self.arch}.{name} is missing")
            return default
        return int(max(value)) if isinstance(value, list) else int(value)

    def positive(self, name: str) -> int:
        value = self.int(name)
        if value <= 0:
            raise ValueError(f"GGUF metadata {self.arch}.{name} is {value}; it must be positive")
        return value

    def float(self, name: str, default: float) -> float:
        value = self.get(name)
        return default if value is None else float(str(np.float32(value)))


def _layer_count(reader: GGUFModel, key: _ArchKeys) -> int:
    """The decoder's layers: block_count less the multi-token-prediction blocks after them.
    A tensor of a block past block_count means metadata and tensors disagree; dropping it as
    if it were an MTP block would run a model missing layers (llama.cpp refuses such a file)."""
    blocks = key.positive("block_count")
    found = [int(m[1]) for t in reader.tensors if (m := BLOCK.match(t.name))]
    if found and max(found) >= blocks:
        raise ValueError(f"GGUF tensors go up to blk.{max(found)}, but {key.arch}.block_count is {blocks}")
    return blocks - key.int("nextn_predict_layers", 0)


def _vocab_size(reader: GGUFModel) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[1])                                 # ggml ne = {hidden, vocab}
    raise ValueError("GGUF has no token_embd.weight tensor")


def _rope_parameters(key: _ArchKeys, head_dim: int) -> dict:
    params = {"rope_type": "default", "rope_theta": key.float("rope.freq_base", 10_000.0),
              "partial_rotary_factor": key.int("rope.dimension_count", head_dim) / head_dim}
    kind = key.get("rope.scaling.type")
    if kind == "linear":
        params.update(rope_type="linear", factor=key.float("rope.scaling.factor", 1.0))
    elif kind not in (None, "none"):
        params.update(rope_type=kind, factor=key.float("rope.scaling.factor", 1.0))   # kvslim refuses it clearly
    return params


def _hybrid_fields(key: _ArchKeys, n_layer: int) -> dict:
    """Gated DeltaNet sizes from ssm.* (Qwen3NextModel.set_gguf_parameters) and the layer
    pattern from attention.recurrent_layers or full_attention_interval (llama.cpp's default: 4)."""
    n_v = key.int("ssm.time_step_rank")
    recurrent = key.get("attention.recurrent_layers")
    if recurrent is None:
        every = key.int("full_attention_interval", 4)
        recurrent = [(i + 1) % every != 0 for i in range(n_layer)]
    fields = {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n_layer]],
        "linear_conv_kernel_dim": key.int("ssm.conv_kernel"),
        "linear_key_head_dim": key.int("ssm.state_size"),
        "linear_num_key_heads": key.int("ssm.group_count"),
        "linear_num_value_heads": n_v,
        "linear_value_head_dim": key.int("ssm.inner_size") // n_v,
    }
    if key.get("full_attention_interval") is not None:
        fields["full_attention_interval"] = key.int("full_attention_interval")
    return fields


def _moe_fields(key: _ArchKeys) -> dict:
    """Experts in every layer, softmax router with renormalised top-k: what llama.cpp's
    qwen3next / qwen35moe graphs hard-code."""
    return {
        "num_experts": key.int("expert_count"),
        "num_experts_per_tok": key.int("expert_used_count"),
        "moe_intermediate_size": key.int("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key.int("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


# ----- sizes for the planner ------------------------------------------------------
def decoder_tensors(reader, n_layer: int) -> list:
    """The file's tensors without multi-token-prediction blocks (``blk.N`` with N at or past
    ``n_layer``, the decoder's layers): neither kvslim nor llama-server loads them for decoding."""
    return [t for t in reader.tensors if not ((m := BLOCK.match(t.name)) and int(m[1]) >= n_layer)]


def tensor_bytes(path: str | Path) -> int:
    """Bytes of the decoder's tensor data (what the weights occupy once loaded as stored)."""
    reader = open_gguf(path)
    return sum(int(t.n_bytes) for t in decoder_tensors(reader, gguf_config(reader)["num_hidden_layers"]))


def weight_types(path: str | Path) -> dict[str, dict[str, int]]:
    """Per ggml type name: how many tensors the file stores in it and their bytes."""
    summary: dict[str, dict[str, int]] = {}
    for t in open_gguf(path).tensors:
        entry = summary.setdefault(t.tensor_type.name, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += int(t.n_bytes)
    return summary


def file_type(path: str | Path) -> str | None:
    """general.file_type by name (ALL_F32, MOSTLY_Q8_0, MOSTLY_Q4_K_M, ...), None if absent."""
    ftype = _value(open_gguf(path), "general.file_type")
    return None if ftype is None else gguf.LlamaFileType(ftype).name


# ----- tensors ------------------------------------------------------------------
def read_model(path: str | Path, dtype: torch.dtype | None = None, keep_quantized: bool = False,
               allow_dequant: bool = False):
    """(config dict, state dict with HF names and layouts, tokenizers.Tokenizer, tokenizer_config dict).

    F32 / F16 / BF16 tensors keep their type (unless ``dtype`` is given, which casts them).
    Quantized ones are dequantized to float32, unless ``keep_quantized``: then weight
    matrices of a supported type (kvslim.weights.TABLE; in a quantized file its float
    matrices too) stay QuantTensors, tensors llama.cpp keeps in float anyway (norms, conv,
    routers) are read as float, and a tensor of an unsupported type is refused (ValueError
    naming it and the supported types) unless ``allow_dequant`` lets it be dequantized.
    """
    reader = open_gguf(path)
    config = gguf_config(reader)
    arch = architecture(reader)
    stored = {t.name: t for t in decoder_tensors(reader, config["num_hidden_layers"])}
    if "rope_freqs.weight" in stored:
        config["rope_parameters"].update(llama3_parameters(_load(stored.pop("rope_freqs.weight")), config))
    if keep_quantized and not allow_dequant:
        _refuse_unsupported(stored.values())
    quantized_file = any(t.tensor_type not in _FLOAT for t in stored.values())
    loaded = {name: _load_blocks(reader.path_of(t), t) if keep_quantized and _keeps_blocks(t, quantized_file) else _load(t)
              for name, t in stored.items()}
    state = hf_state_dict(arch, config, loaded)
    if dtype is not None:
        state = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in state.items()}
    return (config, state, *read_tokenizer(reader))


def _load(t) -> torch.Tensor:
    """One tensor in numpy (= PyTorch) dimension order, copied out of the memory map."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if t.tensor_type in (_T.F32, _T.F16):
        return torch.from_numpy(np.array(t.data)).reshape(shape)
    if t.tensor_type == _T.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    try:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"tensor {t.name}: ggml type {t.tensor_type.name} cannot be dequantized") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _keeps_blocks(t, quantized_file: bool) -> bool:
    """A matrix a layer multiplies by (or looks rows up in), of a supported block type; in a
    quantized file its float matrices too (llama.cpp's F16 fallbacks for rows that are not
    whole blocks), so every matrix stays as stored. What llama.cpp always stores as F32
    (1-d tensors, norms, conv1d, routers) is read as float."""
    wtype = from_ggml(t.tensor_type)
    return (wtype is not None and (quantized_file or not wtype.is_float) and len(t.shape) >= 2
            and t.name.endswith(".weight") and not t.name.endswith("_norm.weight")
            and not t.name.endswith(N.F32_BY_NAME))


def _load_blocks(path: str | Path, t) -> QuantTensor:
    """One matrix as (..., rows, row_bytes) blocks, a private (copy-on-write) map of its bytes
    in the file: nothing is read until a layer uses it, and dropping it unmaps it."""
    wtype = from_ggml(t.tensor_type)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))                  # (..., rows, cols)
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=int(t.data_offset), shape=(int(t.n_bytes),))
    data = torch.from_numpy(raw).view(*shape[:-1], wtype.row_bytes(shape[-1]))
    return QuantTensor(data, wtype, shape[-1])


def _refuse_unsupported(tensors) -> None:
    """Quantized types weights cannot stay in are refused, never silently expanded."""
    bad = [t for t in tensors if t.tensor_type not in _FLOAT and from_ggml(t.tensor_type) is None]
    if bad:
        names = ", ".join(f"{t.name} ({t.tensor_type.name})" for t in bad[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise ValueError(f"GGUF tensor {names}{more}: type not supported for quantized weights; "
                         f"{supported_message()}. Pass --allow-dequant (allow_dequant=True) to expand "
                         "such tensors to float instead")


def hf_state_dict(arch: str, config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF tensors -> HF names and layouts (every convention in names.py undone)."""
    to_hf = {v: k for k, v in N.GLOBAL_TENSORS.items()}
    out, blocks = {}, {}
    for name, t in tensors.items():
        if (m := BLOCK.match(name)) is not None:
            blocks.setdefault(int(m[1]), {})[m[2]] = t
        elif name in to_hf:
            out[to_hf[name]] = _norm_minus_one(arch, to_hf[name], t)
        else:
            raise ValueError(f"GGUF tensor {name!r} is not understood for arch {arch}")
    kinds = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    for i, block in sorted(blocks.items()):
        attention = kinds[i] == "full_attention"
        for suffix, t in hf_layer(arch, config, _unfuse(arch, config, block, attention)).items():
            out[f"model.layers.{i}.{suffix}"] = t
    return out


def _unfuse(arch: str, c: dict, block: dict[str, torch.Tensor], attention: bool) -> dict[str, torch.Tensor]:
    """Bring fused or split GGUF tensors to HF's grouping: experts gate + up -> gate_up_proj,
    a fused attention attn_qkv -> q/k/v, qwen3next's attn_qkv + attn_gate -> in_proj_qkvz."""
    block = dict(block)
    if all(n in block for n in N.EXPERTS_SPLIT):
        block[N.EXPERTS_GATE_UP] = cat([block.pop(n) for n in N.EXPERTS_SPLIT], dim=1)
    elif N.EXPERTS_FUSED in block:
        block[N.EXPERTS_GATE_UP] = block.pop(N.EXPERTS_FUSED)       # already [gate | up] per expert
    if "attn_qkv.weight" in block and attention:
        q_rows = c["num_attention_heads"] * c["head_dim"] * (2 if arch in N.HYBRID else 1)
        kv_rows = c["num_key_value_heads"] * c["head_dim"]
        q, k, v = block.pop("attn_qkv.weight").split([q_rows, kv_rows, kv_rows])
        block.update({"attn_q.weight": q, "attn_k.weight": k, "attn_v.weight": v})
    elif arch == "qwen3next" and "attn_qkv.weight" in block:
        block["ssm_in.weight"] = _join_qkvz(c, block.pop("attn_qkv.weight"), block.pop("attn_gate.weight"))
    return block


def _join_qkvz(c: dict, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """attn_qkv [all q | all k | all v] + attn_gate [all z] -> HF's per-key-head
    [q | k | v group | z group] rows (inverse of Qwen3NextModel's split)."""
    n_k, dk, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    rep, hidden = c["linear_num_value_heads"] // n_k, qkv.shape[1]
    q, k, v = qkv.split([n_k * dk, n_k * dk, n_k * rep * dv])
    parts = [x.reshape(n_k, -1, hidden) for x in (q, k, v, z)]
    return cat(parts, dim=1).reshape(-1, hidden)


def hf_layer(arch: str, c: dict, block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One block's GGUF tensors (after _unfuse) -> HF suffixes, values and row orders restored."""
    to_hf = {v: k for k, v in N.LAYER_TENSORS[arch].items()}
    to_hf[N.EXPERTS_GATE_UP] = N.EXPERTS_GATE_UP
    out = {}
    for name, t in block.items():
        if name not in to_hf:
            raise ValueError(f"GGUF layer tensor {name!r} is not understood for arch {arch}")
        suffix = to_hf[name]
        if suffix.endswith("A_log"):
            t = torch.log(-t.float()).to(t.dtype)                  # ssm_a = -exp(A_log)
        elif suffix.endswith("conv1d.weight") and t.dim() == 2:
            t = t.unsqueeze(1)                                     # (C, K) -> (C, 1, K)
        elif suffix == "mlp.shared_expert_gate.weight":
            t = t.reshape(1, -1)                                   # stored as {hidden} by some files
        out[suffix] = _restore_rows(arch, c, suffix, _norm_minus_one(arch, suffix, t))
    return out


def _norm_minus_one(arch: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if arch in N.ZERO_CENTRED_NORMS and name.endswith("norm.weight") and "linear_attn.norm" not in name:
        return (t.float() - 1).to(t.dtype)                         # stored as 1 + w
    return t


def _restore_rows(arch: str, c: dict, suffix: str, t: torch.Tensor) -> torch.Tensor:
    """Inverse of writer._reorder_rows: tiled -> grouped value heads, interleaved -> half-split q/k."""
    if arch in N.TILED_VALUE_HEADS:
        found = N.value_head_index(suffix, c["linear_num_key_heads"], c["linear_num_value_heads"],
                                   c["linear_key_head_dim"], c["linear_value_head_dim"])
        if found is not None:
            return t.index_select(found[0], torch.from_numpy(np.argsort(found[1])))
    if arch in N.ROPE_PERMUTED:
        rows = N.rope_row_index(suffix, c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        if rows is not None:
            return t.index_select(0, torch.from_numpy(np.argsort(rows)))
    return t


def llama3_parameters(factors: torch.Tensor, config: dict) -> dict:
    """rope_freqs (llama.cpp's per-frequency divisors) -> HF llama3 rope parameters.

    llama3 divides frequency x by 1 / ((1 - s) / factor + s), s = clip((old_ctx * x / 2 pi
    - low) / (high - low), 0, 1): ``factor`` for low frequencies, 1 for high ones, a ramp
    between. Only where s crosses 0 and 1 matters (2 pi low / old_ctx and 2 pi high /
    old_ctx), so low_freq_factor is pinned to 1 and the crossings found from the divisors.
    """
    f = factors.double().flatten()
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return {}
    rot = 2 * len(f)
    x = 1.0 / (config["rope_parameters"]["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    s = ((1 / f - 1 / factor) / (1 - 1 / factor)).numpy()
    zero, one = _ramp_ends(x.numpy(), s)
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": one / zero,
            "original_max_position_embeddings": 2 * np.pi / zero}


def _ramp_ends(x: np.ndarray, s: np.ndarray, eps: float = 1e-5) -> tuple[float, float]:
    """Frequencies where the line s(x) reaches 0 and 1: fitted through the ramp entries when
    there are two or more; else any line consistent with the clipped entries around them."""
    ramp = (s > eps) & (s < 1 - eps)
    if ramp.sum() >= 2:
        a, b = np.polyfit(x[ramp], s[ramp], 1)
        return -b / a, (1 - b) / a
    lo = x[s <= eps].max()                                          # the largest fully scaled frequency
    above = x[s >= 1 - eps]
    hi = above.min() if above.size else 2 * x.max()                 # the smallest unscaled one
    if not ramp.any():
        return lo, hi
    x0, s0 = x[ramp][0], s[ramp][0]
    a = max(s0 / (x0 - lo), (1 - s0) / (hi - x0))                   # steep enough to clip both neighbours
    return x0 - s0 / a, x0 + (1 - s0) / a


# ----- tokenizer ----------------------------------------------------------------
def read_tokenizer(reader: GGUFModel):
    """(tokenizers.Tokenizer, tokenizer_config dict) from the tokenizer.* metadata.

    Only llama.cpp's "gpt2" model (byte-level BPE) is supported: tokens are stored in
    byte-level form, merges as "a b", added tokens as their text with type CONTROL
    (special) or USER_DEFINED; tokenizer.ggml.pre picks the split regex(es).
    """
    model = _value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = _value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF metadata tokenizer.ggml.tokens is missing: the file has no vocabulary")
    types = _value(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _value(reader, "tokenizer.ggml.merges", [])]
    try:
        tokenizer = _byte_level_bpe(tokens, merges, _value(reader, "tokenizer.ggml.pre", "default"))
    except ValueError:
        raise
    except Exception as err:                 # tokenizers raises a bare Exception (e.g. a merge of unknown tokens)
        raise ValueError(f"GGUF tokenizer.ggml.tokens/merges do not make a BPE tokenizer ({err})") from None
    _add_tokens(tokenizer, tokens, types)
    special = _special_tokens(reader, tokens)
    _post_processor(tokenizer, special, reader)
    return tokenizer, _tokenizer_config(reader, special)


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]], pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    if pre not in N.PRE_TOKENIZERS:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(N.PRE_TOKENIZERS)}")
    regexes, ignore_merges = N.PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges, fuse_unk=False))
    if regexes is None:                                            # GPT-2's own regex
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:                                                          # each regex splits the last one's pieces
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL -> special added tokens, USER_DEFINED -> plain added tokens, both matched
    before BPE as in HF; their ids are found in the vocab the model was built with."""
    from tokenizers import AddedToken
    control = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k == gguf.TokenType.CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == gguf.TokenType.USER_DEFINED]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)


def _special_tokens(reader: GGUFModel, tokens: list[str]) -> dict[str, tuple[str, int]]:
    out = {}
    for kind in ("bos", "eos", "padding", "unknown"):
        i = _value(reader, f"tokenizer.ggml.{kind}_token_id")
        if i is not None and 0 <= i < len(tokens):
            out[kind] = (tokens[i], int(i))
    return out


def _post_processor(tokenizer, special: dict[str, tuple[str, int]], reader: GGUFModel) -> None:
    """BOS / EOS added on encode exactly when the file's add_bos_token / add_eos_token say so."""
    from tokenizers import processors
    before = [special["bos"]] if _value(reader, "tokenizer.ggml.add_bos_token") and "bos" in special else []
    after = [special["eos"]] if _value(reader, "tokenizer.ggml.add_eos_token") and "eos" in special else []
    if not before and not after:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    first = [t for t, _ in before] + ["$A"] + [t for t, _ in after]
    second = [f"{t}:1" for t, _ in before] + ["$B:1"] + [f"{t}:1" for t, _ in after]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=first, pair=first + second, special_tokens=sorted(set(before + after), key=lambda p: p[1]))


def _tokenizer_config(reader: GGUFModel, special: dict[str, tuple[str, int]]) -> dict:
    """The tokenizer_config.json keys that matter to generation."""
    return {
        "chat_template": _value(reader, "tokenizer.chat_template"),
        "bos_token": special.get("bos", (None,))[0],
        "eos_token": special.get("eos", (None,))[0],
        "pad_token": special.get("padding", (None,))[0],
        "add_bos_token": bool(_value(reader, "tokenizer.ggml.add_bos_token", False)),
    }
