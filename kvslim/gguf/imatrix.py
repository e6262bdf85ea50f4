"""Importance matrices: how much each input column of each weight matrix matters.

llama.cpp's quantizer weighs a matrix's rounding errors by the mean square of the inputs each
column multiplies (its "imatrix"); at 1-2 bits (IQ1_*, IQ2_*) it refuses to run without one,
and at 3-4 bits it helps too. llama-imatrix measures it by running the model over text; that
binary is not in the llama.cpp wheel kvslim's peer uses, so kvslim measures it itself:

- ``collect`` runs a kvslim model over token chunks, summing x^2 per input column of every
  linear layer and of every expert (per expert, with the tokens routed to it), by the
  checkpoint's parameter names;
- ``to_gguf`` carries those sums through the GGUF writer's own layout conventions (the
  tensor names, split and fused matrices, reordered columns), so that each entry is in the
  file's column order: the writer is given a probe tensor whose every row is the importance
  vector, and each GGUF tensor it yields must come back with identical rows;
- ``read`` / ``write`` speak llama-imatrix's GGUF format (``<tensor>.in_sum2``, columns x
  experts, and ``<tensor>.counts``, tokens per expert), so files go both ways between kvslim
  and llama.cpp's tools; ``read`` also takes the legacy ``imatrix.dat`` format.

``kvslim.loading.measure_importance`` runs the three for a Hugging Face folder and a text.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

SUMS, COUNTS = ".in_sum2", ".counts"


@dataclass
class Importance:
    sums: np.ndarray          # (experts, cols) float64: sum of squared inputs per column
    counts: np.ndarray        # (experts,) float64: input rows (tokens) seen per expert
    rows: int = 0             # the matrix's output rows (what ``to_gguf``'s probe needs), 0 if unknown

    def means(self) -> np.ndarray:
        """Flat (experts * cols) float32 mean squares, as llama-quantize reads a file: an expert
        that saw no token gets ones (no preference among its columns)."""
        counts = self.counts.reshape(-1, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(counts > 0, self.sums / counts, 1.0).astype(np.float32).reshape(-1)


def read(path: str | Path) -> dict[str, Importance]:
    """llama-imatrix's file -> {tensor name: Importance}: its GGUF format, or the legacy binary
    one (``imatrix.dat``, as many published matrices still are); a ValueError naming the
    problem for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such importance matrix file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return read_legacy(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:           # a file cut short fails anywhere in the header (IndexError, ...)
        raise ValueError(f"{path}: a truncated or corrupt GGUF importance matrix ({err})") from None
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    out = {}
    for key, sums in tensors.items():
        if not key.endswith(SUMS):
            continue
        name = key[:-len(SUMS)]
        if name + COUNTS not in tensors:
            raise ValueError(f"{path}: {name}{SUMS} has no {name}{COUNTS}")
        counts = tensors[name + COUNTS].reshape(-1)
        out[name] = Importance(sums.reshape(counts.size, -1), counts)
    if not out:
        raise ValueError(f"{path}: no <tensor>{SUMS} entries (llama-imatrix's GGUF format expected)")
    return out


def read_legacy(path: Path) -> dict[str, Importance]:
    """The legacy binary format: int32 entry count; per entry an int32 name length, the name,
    int32 calls (chunks' tokens seen) and int32 value count, then the float32 sums of squares
    (an expert tensor's columns, expert after expert, under one count); an optional trailer
    (chunks, dataset name) is not needed here."""
    data = path.read_bytes()
    at, out = 0, {}

    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(data):
            raise ValueError(f"{path}: not an importance matrix (GGUF or llama-imatrix's legacy .dat): "
                             f"it ends inside entry {len(out) + 1}")
        at += n
        return data[at - n:at]

    (count,) = np.frombuffer(take(4), np.int32)
    if not 0 < count < 1 << 20:
        raise ValueError(f"{path}: not an importance matrix (GGUF or llama-imatrix's legacy .dat)")
    for _ in range(count):
        (length,) = np.frombuffer(take(4), np.int32)
        if not 0 < length < 1 << 12:
            raise ValueError(f"{path}: entry {len(out) + 1} has a name of {length} bytes; not an importance matrix")
        name = take(int(length)).decode("utf-8", "replace")
        calls, n_values = np.frombuffer(take(8), np.int32)
        sums = np.frombuffer(take(4 * int(n_values)), np.float32).astype(np.float64)
        out[name] = Importance(sums.reshape(1, -1), np.array([float(calls)]))
    return out


def write(path: str | Path, entries: dict[str, Importance], datasets: list[str], chunk_count: int,
          chunk_size: int) -> Path:
    """``entries`` as llama-imatrix writes them (llama-quantize --imatrix reads the file);
    written whole or not at all (``writer.staged_output``)."""
    from .writer import staged_output
    with staged_output(path) as staged:
        w = gguf.GGUFWriter(str(staged), arch="imatrix")
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", datasets)
        w.add_uint32("imatrix.chunk_count", chunk_count)
        w.add_uint32("imatrix.chunk_size", chunk_size)
        for name, imp in sorted(entries.items()):
            w.add_tensor(name + SUMS, imp.sums.astype(np.float32))
            w.add_tensor(name + COUNTS, imp.counts.astype(np.float32).reshape(1, -1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return Path(path)


# ----- measuring it ---------------------------------------------------------------------------
class _Recorder:
    """Sums of x^2 per input column, by parameter name (float64: millions of tokens add up)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor, rows: int, expert: int = 0, n_experts: int = 1) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        if name not in self.sums:
            self.sums[name] = torch.zeros(n_experts, x.shape[-1], dtype=torch.float64)
            self.counts[name] = torch.zeros(n_experts, dtype=torch.float64)
            self.rows[name] = rows
        self.sums[name][expert] += (x * x).sum(0).cpu()
        self.counts[name][expert] += x.shape[0]

    def result(self) -> dict[str, Importance]:
        return {k: Importance(self.sums[k].numpy(), self.counts[k].numpy(), self.rows[k]) for k in self.sums}


def _record_experts(module: nn.Module, name: str, rec: _Recorder):
    """Have ``module.project`` (each expert's products on the per-expert reference path, which
    every routing takes while this runs) record its inputs: x for gate_up, silu(gate) * up for down."""
    n_experts = module.gate_up_proj.shape[0]
    rows = {m: getattr(module, f"{m}_proj").shape[1] for m in ("gate_up", "down")}
    project = module.project

    def recording(e: int, matrix: str, x: torch.Tensor) -> torch.Tensor:
        rec.add(f"{name}.{matrix}_proj", x, rows[matrix], e, n_experts)
        return project(e, matrix, x)
    module.project = recording
    module.groups = lambda x, experts: False


def collect(model: nn.Module, chunks: list[list[int]], skip: tuple[str, ...] = ("lm_head",)) -> dict[str, Importance]:
    """Run ``model`` (a kvslim model on the CPU, float or quantized weights) over each chunk of
    token ids from position 0, and return the importance of every linear layer's and expert's
    input, by the checkpoint's parameter names. ``skip``: layers left out (llama-imatrix leaves
    the output matrix out by default). Fused projections are unfused for the run, so each
    matrix is seen."""
    from ..models import Batch
    from ..weights.modules import QuantLinear
    rec = _Recorder()
    hooks, fused = [], {}
    for name, module in model.named_modules():
        if getattr(module, "fused", None) is not None:
            fused[module] = module.fused
            module.fused = None
        if isinstance(module, (nn.Linear, QuantLinear)) and not any(name.endswith(s) for s in skip):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, n=f"{name}.weight": rec.add(n, args[0], m.out_features)))
        if hasattr(module, "gate_up_proj") and hasattr(module, "project"):
            _record_experts(module, name, rec)
    try:
        with torch.inference_mode():
            for ids in chunks:
                cache = model.make_cache(len(ids), 1, "f16", "f16")
                model(Batch.build([(0, list(ids), 0)]), cache)
    finally:
        for h in hooks:
            h.remove()
        for module, f in fused.items():
            module.fused = f
        for module in model.modules():
            for attr in ("project", "groups"):
                if attr in vars(module):
                    delattr(module, attr)
    return rec.result()


def to_gguf(arch: str, config, collected: dict[str, Importance]) -> dict[str, Importance]:
    """Parameter names -> GGUF tensor names, columns in the file's order, through the writer's
    ``layer_tensors``/``GLOBAL_TENSORS`` (whatever it does to a matrix's rows and columns it
    does to a probe whose every row is the importance); a ValueError if a tensor comes back
    with rows that differ (a convention that changes values, not only the layout: the probe
    could not be read back)."""
    from . import names as N
    from .writer import LAYER, layer_tensors
    out = {}
    for name, imp in collected.items():
        if imp.rows <= 0:
            raise ValueError(f"{name}: the matrix's row count is needed to follow the writer's conventions")
        probe = torch.from_numpy(imp.sums).float().unsqueeze(-2).expand(imp.sums.shape[0], imp.rows, imp.sums.shape[1])
        if imp.sums.shape[0] == 1:                                        # a plain matrix: (rows, cols)
            probe = probe[0]
        if name in N.GLOBAL_TENSORS:
            mapped = [(N.GLOBAL_TENSORS[name], probe)]
        elif (m := LAYER.match(name)) is not None:
            mapped = [(f"blk.{m[1]}.{suffix}", t) for suffix, t in layer_tensors(arch, config, m[2], probe.clone())]
        else:
            raise ValueError(f"{name}: no GGUF name for arch {arch}")
        for gguf_name, t in mapped:
            t = t.reshape(imp.sums.shape[0], -1, t.shape[-1])
            if not bool((t == t[:, :1]).all()):
                raise ValueError(f"{gguf_name}: the GGUF writer changes this matrix's values, not only its layout; "
                                 "its importance cannot be carried through")
            out[gguf_name] = Importance(t[:, 0].double().numpy().copy(), imp.counts.copy())
    return out

