"""What the planner plans for: a model's config and where it came from (a catalog name, a
Hugging Face folder's config.json or a GGUF file's metadata; weights are never read)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from ..models import config_from_dict
from . import catalog
from .tensors import WeightTensor, weight_tensors


@dataclass(eq=False)  # compared and hashed by identity, so per-model results can be cached
class Model:
    """A model to plan: its config and where it came from."""

    name: str
    config: object
    source: str                  # "catalog", "hf" (a folder with config.json) or "gguf"
    hf_id: str | None = None     # what vLLM would serve
    gguf_path: str | None = None
    gguf_bytes: int | None = None
    stored_quant: str | None = None       # a folder's weights as stored (what `kvslim run` loads)
    trained_context: int | None = None    # when shorter than the config's limit and known (the bundled model)
    kv_calibrated: bool = False           # a KV calibration lies beside it (`kvslim calibrate`): klt V types work

    @functools.cached_property
    def tensors(self) -> list["WeightTensor"]:
        return weight_tensors(self.config)


def resolve_model(spec: str) -> Model:
    """A catalog name, a Hugging Face folder (config.json only) or a GGUF file (metadata only)."""
    path = Path(spec).expanduser()
    if path.is_dir() or path.name == "config.json":
        return _from_hf_folder(path if path.is_dir() else path.parent)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"no such GGUF file: {spec}")
        return _from_gguf(path)
    name, entry = catalog.find_model(spec)
    return Model(name, config_from_dict(entry.config), "catalog", hf_id=entry.hf_id)


# config.json's dtype (transformers 5) or torch_dtype (4.x) -> the weight mix of the same bytes
STORED_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _from_hf_folder(folder: Path) -> Model:
    from ..data import BUNDLED_TRAINED_CONTEXT
    from ..loading import BUNDLED, calibration_path, folder_config
    d, config = folder_config(folder)

    stored = STORED_DTYPES.get(str(d.get("dtype") or d.get("torch_dtype") or "").removeprefix("torch."))
    trained = BUNDLED_TRAINED_CONTEXT if folder.resolve() == BUNDLED.resolve() else None
    return Model(folder.name, config, "hf", hf_id=str(folder), stored_quant=stored,
                 trained_context=trained, kv_calibrated=calibration_path(folder).is_file())


def _from_gguf(path: Path) -> Model:
    try:
        from ..gguf import reader  # metadata and tensor sizes only; the weights are never read
    except ImportError:
        raise ValueError("GGUF input needs kvslim.gguf.reader, which this installation lacks") from None
    from ..loading import calibration_path

    config = config_from_dict(reader.read_config(str(path)))
    return Model(path.stem, config, "gguf", gguf_path=str(path), gguf_bytes=int(reader.tensor_bytes(str(path))),
                 kv_calibrated=calibration_path(path).is_file())


def context_limit(c) -> int | None:
    """The positions the model's config allows (max_position_embeddings); None when it does not say."""
    return int(getattr(c, "max_position_embeddings", 0) or 0) or None


def max_context_per_slot(c) -> int:
    return context_limit(c) or 262_144
