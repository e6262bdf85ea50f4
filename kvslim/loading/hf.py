"""Hugging Face folders: config.json and (sharded) safetensors.

Checkpoint names are brought to the one layout the model files use:
multimodal wrappers (``model.language_model.``) lose their prefix, vision and
MTP weights are skipped, and per-expert MoE weights are stacked into the fused
``gate_up_proj`` (E, 2I, H) / ``down_proj`` (E, H, I) that official Qwen3.5/3.6
checkpoints store.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..formats.klt import CALIBRATION_FILE

SKIP = re.compile(r"^(mtp\.|model\.visual\.|model\.mtp\.|visual\.)")
EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: not a Hugging Face model folder (no config.json)")
    return read_json_object(path, "model settings")


def read_json_object(path: Path, what: str) -> dict:
    """A JSON file that must hold an object; errors name the file (json's own messages do not)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object of {what}")
    return value


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "shard names").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no \"weight_map\" of tensor names to shard files")
        files = [folder / n for n in sorted(set(weight_map.values()))]
    else:
        files = sorted(f for f in folder.glob("*.safetensors") if f.name != CALIBRATION_FILE)
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights found")
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ValueError(f"{folder}: shards listed in the index are missing: {', '.join(missing)}")
    return files


def read_state_dict(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All language-model tensors of a folder, names normalised (see module docstring)."""
    refuse_prequantized(folder)
    raw: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            raw.update(_read_shard(path, dtype))
        except SafetensorError as err:     # a cut-off download, an empty or foreign file
            raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({err})") from None
    return fuse_experts(raw)


def _read_shard(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():
            key = normalise_name(name)
            if key is not None:
                t = f.get_tensor(name)
                out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def refuse_prequantized(folder: str | Path) -> None:
    """FP8, AWQ, GPTQ, bitsandbytes ... checkpoints store scales and packed integers that kvslim
    would otherwise report as a list of unexpected weights (or, for FP8 without scale tensors,
    read as if the codes were the weights): say what the folder is instead."""
    config = read_config(folder)
    for part in (config, config.get("text_config") or {}):
        quant = part.get("quantization_config") if isinstance(part, dict) else None
        if quant:
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
            raise ValueError(f"{Path(folder) / 'config.json'}: a pre-quantized checkpoint (quant_method {method!r}); "
                             "kvslim reads float checkpoints (f32/f16/bf16): use the original model, or a GGUF")


def normalise_name(name: str) -> str | None:
    if SKIP.match(name):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    return name


def fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack per-expert weights ``experts.{e}.{gate,up,down}_proj.weight`` into fused tensors."""
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    out = {}
    for key, t in sd.items():
        m = EXPERT.match(key)
        if m:
            groups[m["prefix"]][(int(m["e"]), m["proj"])] = t
        else:
            out[key] = t
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        try:
            out[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
            out[prefix + ".down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
        except KeyError as gap:
            raise ValueError(f"{prefix}: expert weight {gap} is missing from the checkpoint") from None
    return out
