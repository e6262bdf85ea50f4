"""Export a Hugging Face checkpoint to GGUF the way llama.cpp's converter would.

The goal is a file llama.cpp itself loads and runs identically to the original:
its tensor names, layouts and metadata keys (see ``names.py`` for where each
convention comes from), its choice of which tensors stay F32, and its byte-level
BPE vocabulary keys. Quantized outputs (q8_0, q4_0) use ``gguf.quants``, which
matches ggml's C reference; rows that do not split into 32-value blocks fall back
to F16, as the converter does.

The whole checkpoint is held in memory while writing (like the converter without
--use-temp-file); fine for the models this project converts on one machine.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from ..models import config_class, config_from_dict
from ..models.config import text_config
from . import names as N

# Every type a matrix can be written in: gguf.quants encodes all but IQ4_NL, which uses
# kvslim's own encoder (kvslim.formats.ggml, byte-identical to ggml's reference).
_Q, _F = gguf.GGMLQuantizationType, gguf.LlamaFileType
QTYPE = {"f32": _Q.F32, "f16": _Q.F16, "bf16": _Q.BF16, "q8_0": _Q.Q8_0, "q4_0": _Q.Q4_0, "q4_1": _Q.Q4_1,
         "q5_0": _Q.Q5_0, "q5_1": _Q.Q5_1, "iq4_nl": _Q.IQ4_NL}
FILE_TYPE = {"f32": _F.ALL_F32, "f16": _F.MOSTLY_F16, "bf16": _F.MOSTLY_BF16, "q8_0": _F.MOSTLY_Q8_0,
             "q4_0": _F.MOSTLY_Q4_0, "q4_1": _F.MOSTLY_Q4_1, "q5_0": _F.MOSTLY_Q5_0, "q5_1": _F.MOSTLY_Q5_1,
             "iq4_nl": _F.MOSTLY_IQ4_NL}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Qwen3.5 always uses interleaved MRoPE; llama.cpp's qwen35/qwen35moe loaders require the
# sections key and the converter writes this default when the config has none
# (conversion/qwen.py _Qwen35MRopeMixin). For text, all sections see the same position.
DEFAULT_MROPE_SECTIONS = [11, 11, 10, 0]


def write_gguf(hf_config: dict, state_dict: dict[str, torch.Tensor], tokenizer_dir: str | Path,
               out_path: str | Path, out_type: str = "f16", split_max_tensors: int = 0) -> Path:
    """Write a checkpoint to ``out_path`` as a GGUF llama.cpp can load.

    Args:
        hf_config: the Hugging Face config.json dict.
        state_dict: the checkpoint's tensors, names normalised as ``kvslim.loading.hf`` reads them.
        tokenizer_dir: the folder with tokenizer.json (and tokenizer_config.json for special tokens).
        out_type: a key of ``QTYPE`` (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl); every
            matrix but those the converter keeps F32 gets that type (llama-quantize --pure),
            rows not made of whole blocks F16.
        split_max_tensors: above 0, split the model into files of at most this many tensors, as
            llama.cpp's converter and llama-gguf-split do (``<stem>-00001-of-0000N.gguf``, ...).
    Returns: the file written (the first part of a split). ``kvslim.loading.convert_hf_to_gguf``
    does this for a folder.
    """
    with staged_output(out_path) as staged:
        writer, arch, config = open_writer(hf_config, tokenizer_dir, staged, out_type, split_max_tensors)
        for name, array in gguf_tensors(arch, config, state_dict):
            _add_tensor(writer, name, array, out_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(out_path).with_name(writer.format_shard_names(staged)[0].name)


@contextlib.contextmanager
def staged_output(out_path: str | Path):
    """A path to write ``out_path`` (or the parts of a split named after it) to: in a hidden
    folder beside it, each file moved over its destination by one rename once the block ends
    without an error. A failed or interrupted write leaves no half-written file that a loader
    would take for the model, and an existing file is left as it was until the new one is whole."""
    out_path = Path(out_path)
    if out_path.is_dir():
        raise ValueError(f"{out_path}: a folder; give the output file's name")
    if not out_path.parent.is_dir():
        raise ValueError(f"{out_path.parent}: no such folder for the output")
    with tempfile.TemporaryDirectory(prefix=f".{out_path.name}.", dir=out_path.parent) as tmp:
        yield Path(tmp) / out_path.name
        for made in sorted(Path(tmp).iterdir()):
            os.replace(made, out_path.parent / made.name)


def open_writer(hf_config: dict, tokenizer_dir: str | Path, out_path: str | Path, out_type: str,
                split_max_tensors: int = 0) -> tuple[gguf.GGUFWriter, str, object]:
    """(writer with the metadata and vocabulary added, GGUF architecture, config): what every
    GGUF of ``hf_config`` starts with; the caller adds the tensors and writes the file."""
    arch, config = check_export(hf_config, out_type)
    if split_max_tensors < 0:
        raise ValueError(f"split_max_tensors must be 0 (no split) or positive, got {split_max_tensors}")
    writer = gguf.GGUFWriter(str(out_path), arch, split_max_tensors=split_max_tensors)
    _write_hparams(writer, arch, config, text_config(hf_config), out_type)
    _write_vocab(writer, Path(tokenizer_dir), config.vocab_size)
    return writer, arch, config


def check_export(hf_config: dict, out_type: str):
    """(GGUF architecture, config) of a checkpoint ``write_gguf`` can export to ``out_type``,
    or a ValueError saying why not (checked before any tensor is read)."""
    if out_type not in QTYPE:
        raise ValueError(f"out_type {out_type!r} is not supported; choose from {', '.join(QTYPE)}")
    model_type = text_config(hf_config)["model_type"]
    config = config_from_dict(hf_config) if model_type in N.GGUF_ARCH else None
    if config is None or not config.runnable:
        exportable = sorted(t for t in N.GGUF_ARCH if config_class(t).runnable)
        raise ValueError(f"model_type {model_type!r} cannot be exported to GGUF; supported: {', '.join(exportable)}")
    arch = N.GGUF_ARCH[model_type]
    _check_exportable(arch, config)
    return arch, config


def _check_exportable(arch: str, c) -> None:
    """Shapes llama.cpp's loaders cannot express, refused here rather than by llama.cpp later."""
    if arch in N.HYBRID and c.linear_key_head_dim != c.linear_value_head_dim:
        # the qwen35/qwen3next loaders take both head sizes from ssm.state_size
        raise ValueError("llama.cpp needs linear_key_head_dim == linear_value_head_dim "
                         f"(got {c.linear_key_head_dim} and {c.linear_value_head_dim})")
    if arch == "qwen2" and c.head_dim * c.num_attention_heads != c.hidden_size:
        # llama.cpp's qwen2 loader sizes attn_q as {n_embd, n_embd}, ignoring attention.key_length
        # (seen: "tensor 'blk.0.attn_q.weight' has wrong shape" from llama-cpp-python 0.3.36)
        raise ValueError(f"llama.cpp's qwen2 needs head_dim * num_attention_heads == hidden_size "
                         f"(got {c.head_dim} * {c.num_attention_heads} != {c.hidden_size})")
    if arch in N.MOE and (c.mlp_only_layers or c.decoder_sparse_step != 1):
        raise ValueError("llama.cpp's qwen3next/qwen35moe loaders expect experts in every layer")


# ----- metadata -----------------------------------------------------------------
def _write_hparams(w: gguf.GGUFWriter, arch: str, c, text: dict, out_type: str) -> None:
    """The keys TextModel.set_gguf_parameters (+ the arch's subclass) writes."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    if c.intermediate_size:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(int(c.head_dim * c.partial_rotary_factor))
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(FILE_TYPE[out_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_rope_scaling(w, c.rope_scaling)
    if arch in N.HYBRID:
        _write_hybrid(w, arch, c, text)
    if arch in N.MOE:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _write_rope_scaling(w: gguf.GGUFWriter, scaling: dict) -> None:
    """linear -> rope.scaling.* keys; llama3 is carried by the rope_freqs tensor instead
    (LlamaModel.generate_extra_tensors); anything else kvslim cannot run anyway."""
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind not in ("default", "llama3"):
        raise ValueError(f"rope_type {kind!r} cannot be exported (supported: default, linear, llama3)")


def _write_hybrid(w: gguf.GGUFWriter, arch: str, c, text: dict) -> None:
    """Gated DeltaNet sizes as Qwen3NextModel.set_gguf_parameters names them."""
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    _write_layer_pattern(w, arch, c.layer_types)
    if arch in N.TILED_VALUE_HEADS:
        sections = list((text.get("rope_parameters") or {}).get("mrope_section") or DEFAULT_MROPE_SECTIONS)
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _write_layer_pattern(w: gguf.GGUFWriter, arch: str, layer_types: list[str]) -> None:
    """full_attention_interval when the layers follow one (llama.cpp's loaders default to 4),
    else the explicit per-layer ``attention.recurrent_layers`` flags the loaders accept."""
    attention = [t == "full_attention" for t in layer_types]
    for every in range(1, len(attention) + 1):
        if attention == [(i + 1) % every == 0 for i in range(len(attention))]:
            w.add_full_attention_interval(every)
            return
    w.add_array(f"{arch}.attention.recurrent_layers", [not a for a in attention])


# ----- tokenizer ----------------------------------------------------------------
def _write_vocab(w: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """Byte-level BPE as the converter's _set_vocab_gpt2 stores it; merges, special token
    ids, add_bos/add_eos and the chat template come from gguf.SpecialVocab."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no tokenizer.json (only byte-level BPE tokenizers can be exported)")
    spec = json.loads(path.read_text(encoding="utf-8"))
    if spec.get("model", {}).get("type") != "BPE":
        raise ValueError(f"{path}: tokenizer model {spec.get('model', {}).get('type')!r} is not BPE")
    tokens, types = token_list(spec, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer")))
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def token_list(spec: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their types: added tokens that are special, or look like
    <|...|>, are CONTROL, other added tokens USER_DEFINED, ids with no token become
    [PAD{i}] UNUSED (TextModel.get_vocab_base)."""
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    if by_id and max(by_id) >= vocab_size:
        raise ValueError(f"tokenizer has token id {max(by_id)} but the model's vocab_size is {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            looks_special = by_id[i].startswith("<|") and by_id[i].endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i].get("special") or looks_special
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def pre_tokenizer_name(pre: dict | None) -> str:
    """tokenizer.ggml.pre for a tokenizer.json pre_tokenizer. The converter identifies it by
    hashing sample encodings; we identify the steps themselves (regexes, digit splitting),
    which is what llama.cpp's pre-types implement."""
    steps = pre_tokenizer_steps(pre)
    if steps in N.PRE_NAME_OF_STEPS:
        return N.PRE_NAME_OF_STEPS[steps]
    known = "; ".join(f"{name}: {list(s)}" for s, name in N.PRE_NAME_OF_STEPS.items())
    raise ValueError(f"pre-tokenizer steps {list(steps)} have no llama.cpp pre-type known here (known: {known})")


def pre_tokenizer_steps(pre: dict | None) -> tuple[tuple, ...]:
    """The splitting steps of a pre_tokenizer, e.g. (("digits",), ("byte_level_regex",))."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("use_regex", True):
                out.append(("byte_level_regex",))
        elif kind == "Split":
            out.append(("split", step.get("pattern", {}).get("Regex", step.get("pattern", {}).get("String"))))
        elif kind == "Digits":
            out.append(("digits",) if step.get("individual_digits") else ("digit_runs",))
        else:
            out.append((kind,))
    return tuple(out)


# ----- tensors ------------------------------------------------------------------
def gguf_tensors(arch: str, c, state_dict: dict[str, torch.Tensor]):
    """(GGUF name, float32 array) for every tensor, llama.cpp's conventions applied."""
    for name, t in mapped_tensors(arch, c, state_dict):
        yield name, _to_numpy(t)
    if (freqs := rope_factors(c)) is not None:
        yield "rope_freqs.weight", freqs


def mapped_tensors(arch: str, c, state_dict: dict[str, torch.Tensor]):
    """(GGUF name, float32 tensor) for every tensor of ``state_dict``. Tensors on the meta
    device give the GGUF names and shapes alone (benchmarks/random_gguf.py plans a file so)."""
    for name, t in state_dict.items():
        t = t.float()
        if name in N.GLOBAL_TENSORS:
            if not (name == "lm_head.weight" and c.tie_word_embeddings):
                yield N.GLOBAL_TENSORS[name], _norm_plus_one(arch, name, t)
            continue
        m = LAYER.match(name)
        if m is None:
            raise ValueError(f"tensor {name!r} has no GGUF name for arch {arch}")
        for suffix, out in layer_tensors(arch, c, m[2], t):
            yield f"blk.{m[1]}.{suffix}", out


def layer_tensors(arch: str, c, suffix: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF layer tensor -> its GGUF tensor(s), layout and value conventions applied."""
    t = _reorder_rows(arch, c, suffix, t)
    if suffix == N.EXPERTS_GATE_UP:                                # (E, 2I, H): gate rows, then up rows
        return list(zip(N.EXPERTS_SPLIT, t.chunk(2, dim=1)))
    if suffix == "linear_attn.in_proj_qkvz.weight":
        return _split_qkvz(c, t)
    table = N.LAYER_TENSORS[arch]
    if suffix not in table:
        raise ValueError(f"layer tensor {suffix!r} has no GGUF name for arch {arch}")
    if suffix.endswith("A_log"):
        t = -torch.exp(t)                                          # Qwen3NextModel: ssm_a = -exp(A_log)
    elif suffix.endswith("conv1d.weight"):
        t = t.squeeze(1)                                           # (C, 1, K) -> (C, K): ggml {K, C}
    return [(table[suffix], _norm_plus_one(arch, suffix, t))]


def _norm_plus_one(arch: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """Zero-centred RMSNorm weights are stored as 1 + w (Qwen3NextModel.modify_tensors)."""
    if arch in N.ZERO_CENTRED_NORMS and name.endswith("norm.weight") and "linear_attn.norm" not in name:
        return t + 1
    return t


def _reorder_rows(arch: str, c, suffix: str, t: torch.Tensor) -> torch.Tensor:
    """Value heads grouped -> tiled (qwen35*), q/k rows to interleaved pairs (llama)."""
    if arch in N.TILED_VALUE_HEADS:
        found = N.value_head_index(suffix, c.linear_num_key_heads, c.linear_num_value_heads,
                                   c.linear_key_head_dim, c.linear_value_head_dim)
        if found is not None:
            return t.index_select(found[0], torch.from_numpy(found[1]))
    if arch in N.ROPE_PERMUTED:
        rows = N.rope_row_index(suffix, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        if rows is not None:
            return t.index_select(0, torch.from_numpy(rows))
    return t


def _split_qkvz(c, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Qwen3-Next's per-key-head [q | k | v group | z group] rows -> attn_qkv = [all q | all k |
    all v] and attn_gate = [all z], value heads staying grouped (Qwen3NextModel.modify_tensors)."""
    rep = c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    per_head = t.view(c.linear_num_key_heads, 2 * dk + 2 * rep * dv, -1)
    q, k, v, z = torch.split(per_head, [dk, dk, rep * dv, rep * dv], dim=1)
    flat = [x.reshape(-1, t.shape[1]) for x in (q, k, v, z)]
    return [("attn_qkv.weight", torch.cat(flat[:3])), ("attn_gate.weight", flat[3])]


def rope_factors(c) -> np.ndarray | None:
    """Llama 3.1 RoPE as llama.cpp carries it: a rope_freqs tensor of per-frequency divisors."""
    s = getattr(c, "rope_scaling", None) or {}
    if s.get("rope_type", s.get("type")) != "llama3":
        return None
    from ..models.layers import Rope
    base = Rope(c.head_dim, c.rope_theta, c.partial_rotary_factor).inv_freq
    scaled = Rope(c.head_dim, c.rope_theta, c.partial_rotary_factor, s).inv_freq
    return (base / scaled).numpy().astype(np.float32)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy()


def gguf_type(name: str, array: np.ndarray, out_type: str) -> gguf.GGMLQuantizationType:
    """F32 where the converter forces it (names.F32_BY_NAME and the rules beside it)."""
    if N.stays_f32(name, array.ndim):
        return gguf.GGMLQuantizationType.F32
    return QTYPE[out_type]


def _add_tensor(w: gguf.GGUFWriter, name: str, array: np.ndarray, out_type: str) -> None:
    qtype = gguf_type(name, array, out_type)
    try:
        data = quantize(array, qtype)
    except gguf.QuantError:                                        # row length not a multiple of the block
        qtype = gguf.GGMLQuantizationType.F16
        data = quantize(array, qtype)
    w.add_tensor(name, data, raw_dtype=qtype)


def quantize(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """ggml blocks of ``array`` (rows along the last axis), as uint8 (..., row_bytes)."""
    if qtype != _Q.IQ4_NL:
        return gguf.quants.quantize(array, qtype)
    from ..weights import types as W
    block = W.get("iq4_nl")
    if array.shape[-1] % block.block_size:
        raise gguf.QuantError(f"row of {array.shape[-1]} values is not whole IQ4_NL blocks")
    values = torch.from_numpy(np.ascontiguousarray(array, np.float32)).reshape(-1, block.block_size)
    # bounded chunks keep the scale search's (N, 16, 32) candidates in cache
    blocks = torch.cat([block.encode(part) for part in values.split(4096)])
    return blocks.numpy().reshape(*array.shape[:-1], -1)
