"""Load a model and its tokenizer from a Hugging Face folder or a GGUF file."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models import config_from_dict
from ..tokenizer import Tokenizer
from .hf import read_config, read_json_object, read_state_dict
from .instantiate import check_state_dict, instantiate

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "tiny-qwen35"
DTYPES = {"f32": torch.float32, "float32": torch.float32, "f16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def default_model() -> Path:
    """The small model that ships inside the package (used when no -m is given)."""
    if not (BUNDLED / "config.json").is_file():
        raise ValueError(f"the bundled model is missing from {BUNDLED}; pass -m PATH")
    return BUNDLED


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return dtype
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:          # int8 weights would fail deep inside load_state_dict
            raise ValueError(f"dtype {dtype} is not a float type; valid: {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(path: str | Path | None = None, dtype=None, device: str = "cpu", weights: str | None = None,
               allow_dequant: bool = False):
    """Returns (model, tokenizer, eos token ids from the model's configs).

    Args:
        dtype: float weights' and activations' dtype (default: as stored).
        weights: Hugging Face folders only: quantize the weight matrices at load time to this
            ggml block type (``kvslim.weights.encodable_names()``: q8_0, q4_0, ...).
            A GGUF's quantized tensors always stay in the file's block types.
        allow_dequant: GGUF only: expand tensors of types kvslim cannot keep quantized to
            float instead of refusing the file.
    """
    path = _model_path(path)
    dtype = parse_dtype(dtype)
    if weights is not None:
        weights = check_weights(weights)
    if path.is_dir():
        return _with_calibration(_load_folder(path, dtype, device, weights), calibration_path(path))
    if weights is not None:
        raise ValueError(f"{path}: --weights quantizes Hugging Face folders; a GGUF keeps its own types")
    return _with_calibration(_load_gguf(path, dtype, device, allow_dequant), calibration_path(path))


def check_model_path(path: str | Path | None = None) -> Path:
    """The model ``load_model`` would read (None: the bundled one), checked without reading
    weights: a folder's config.json must parse into a config kvslim knows, a file must be a
    GGUF. ``kvslim serve`` calls it before it binds its port."""
    path = _model_path(path)
    if path.is_dir():
        folder_config(path)                       # load_model reads it while loading
    return path


def _model_path(path: str | Path | None) -> Path:
    """A folder or a GGUF file (None: the bundled model), else a ValueError naming the path."""
    path = Path(path) if path is not None else default_model()
    if path.is_dir() or (path.is_file() and _is_gguf(path)):
        return path
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    if path.suffix != ".gguf" and (path.parent / "config.json").is_file():   # model.safetensors, config.json
        raise ValueError(f"{path}: a file of a Hugging Face model folder; pass the folder, {path.parent}")
    raise ValueError(f"{path}: neither a Hugging Face model folder nor a GGUF file")


def calibration_path(model_path: str | Path) -> Path:
    """Where a model's KV calibration lives (``kvslim calibrate`` writes it there): inside a
    Hugging Face folder, or beside a GGUF file as ``<name>.kv-calibration.safetensors``."""
    from ..formats.klt import CALIBRATION_FILE
    path = Path(model_path)
    return path / CALIBRATION_FILE if path.is_dir() else path.with_name(f"{path.stem}.{CALIBRATION_FILE}")


def _with_calibration(loaded: tuple, cal_path: Path) -> tuple:
    if cal_path.is_file():
        from ..formats.klt import KVCalibration
        loaded[0].kv_calibration = KVCalibration.load(cal_path)
    return loaded


def convert_hf_to_gguf(folder: str | Path, out_path: str | Path, out_type: str = "f16",
                       split_max_tensors: int = 0) -> Path:
    """Export a Hugging Face folder (config.json, safetensors, tokenizer.json) to ``out_path`` as
    a GGUF llama.cpp can load, with matrices in ``out_type``, split into files of at most
    ``split_max_tensors`` tensors when that is positive (see ``kvslim.gguf.writer.write_gguf``).
    Returns the file written (a split's first part)."""
    from ..gguf.writer import check_export, write_gguf

    folder = Path(folder)
    hf_config = read_config(folder)
    _, config = check_export(hf_config, out_type)   # before reading any weights
    state_dict = read_state_dict(folder)
    # a GGUF whose tensors disagree with its metadata loads nowhere (llama.cpp: "wrong shape"):
    # refuse it here, as loading the folder would, rather than write it
    check_state_dict(config, state_dict)
    return write_gguf(hf_config, state_dict, folder, out_path, out_type, split_max_tensors)


def measure_importance(path: str | Path, text: str, n_ctx: int = 512, max_chunks: int = 64):
    """The importance of a model's matrices on ``text``, by GGUF tensor name
    (``kvslim.gguf.imatrix``): the text's tokens in chunks of ``n_ctx`` (at most ``max_chunks``),
    each from position 0, as llama-imatrix runs them. ``path``: a Hugging Face folder, or a
    GGUF file (run with its weights as stored, as llama-imatrix does). Returns (entries, chunks run)."""
    from ..gguf import imatrix
    from ..gguf import reader
    from ..gguf.writer import check_export
    path = _model_path(path)
    arch, config = check_export(read_config(path) if path.is_dir() else reader.read_config(path), "f32")
    model, tokenizer, _ = load_model(path, "f32", allow_dequant=True)
    ids = tokenizer.encode(text, add_special=False)
    chunks = [ids[i:i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)][:max_chunks]
    if not chunks:
        raise ValueError(f"the calibration text has {len(ids)} tokens: fewer than one chunk of {n_ctx}")
    return imatrix.to_gguf(arch, config, imatrix.collect(model, chunks)), len(chunks)


def check_weights(name: str) -> str:
    """A ``--weights`` value, or a ValueError listing the valid ones."""
    from ..weights import encodable_names
    if str(name).lower() not in encodable_names():                   # Q8_0 as llama.cpp prints it, too
        raise ValueError(f"unknown --weights {name!r}; valid: {', '.join(encodable_names())}")
    return str(name).lower()


def folder_config(path: str | Path):
    """A Hugging Face folder's config.json -> (the dict, kvslim's config); errors name the file."""
    hf_config = read_config(path)
    try:
        return hf_config, config_from_dict(hf_config)
    except ValueError as err:
        raise ValueError(f"{Path(path) / 'config.json'}: {err}") from None


def _load_folder(path: Path, dtype, device, weights):
    _, config = folder_config(path)
    model = instantiate(config, read_state_dict(path), dtype, device, weights)
    eos = [config.eos_token_id]
    gen = path / "generation_config.json"
    if gen.is_file():
        eos.append(read_json_object(gen, "generation settings").get("eos_token_id"))
    return model, folder_tokenizer(path), _flatten_ids(eos)


def folder_tokenizer(path: Path) -> Tokenizer:
    """The folder's tokenizer; errors name the file (the libraries' messages do not)."""
    try:
        return Tokenizer.from_folder(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: tokenizer_config.json or chat_template.jinja cannot be read ({err})") from None
    except ValueError:
        raise
    except Exception as err:                         # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"{path / 'tokenizer.json'}: not a tokenizer the tokenizers library reads ({err})") from None


def _load_gguf(path: Path, dtype, device, allow_dequant: bool):
    from ..gguf.reader import read_model

    hf_config, state_dict, backend, tok_config = read_model(path, keep_quantized=True, allow_dequant=allow_dequant)
    config = config_from_dict(hf_config)
    model = instantiate(config, state_dict, dtype, device)
    return model, Tokenizer(backend, tok_config), _flatten_ids([config.eos_token_id])


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _flatten_ids(values) -> set[int]:
    out = set()
    for v in values:
        if isinstance(v, list):
            out |= {int(i) for i in v}
        elif v is not None:
            out.add(int(v))
    return out
