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
from safetensors import safe_open

from ..formats.klt import CALIBRATION_FILE

SKIP = re.compile(r"^(mtp\.|model\.visual\.|model\.mtp\.|visual\.)")
EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: not a Hugging Face model folder (no config.json)")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object of model settings")
    return config


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [folder / n for n in names]
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
    raw: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                key = normalise_name(name)
                if key is not None:
                    t = f.get_tensor(name)
                    raw[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return fuse_experts(raw)


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
