"""Launch lines: kvslim's own ``kvslim serve`` for a plan, and the llama-server and vLLM
commands equivalent to it, with notes on what differs."""
from __future__ import annotations

import dataclasses

from .. import formats
from . import catalog
from .fit import Request, kv_bits
from .model import Model, context_limit
from .targets import Target
from .weight_size import weight_size


def vllm_kv_dtype(type_k: str, type_v: str, head_dim: int) -> tuple[str, list[str]]:
    """vLLM's --kv-cache-dtype for a K/V pair, and what differs from the plan."""
    notes, picks = [], []
    for t in (type_k, type_v):
        pick = catalog.VLLM_KV_DTYPE.get(t)
        if pick is None:
            pick = "fp8" if kv_bits(t, head_dim) <= 8.5 else "auto"
            notes.append(f"vLLM has no {t} cache; --kv-cache-dtype {pick} stands in for it")
        elif t == "q8_0":
            notes.append("vLLM's fp8 (8 bits/value, per-tensor scale) is the nearest to q8_0, not the same format")
        picks.append(pick)
    if picks[0] != picks[1]:
        notes.append("vLLM takes one --kv-cache-dtype for K and V; the wider of the two is used")
    return ("auto" if "auto" in picks else "fp8"), notes


def _llama_server_type(t: str) -> tuple[str, str | None]:
    if t in catalog.LLAMA_SERVER_KV:
        return t, None
    if t.endswith(formats.NOROT) and t.removesuffix(formats.NOROT) in catalog.LLAMA_SERVER_KV:
        return t.removesuffix(formats.NOROT), "unrotated ggml cache: run llama-server with LLAMA_ATTN_ROT_DISABLE=1"
    near = catalog.LLAMA_SERVER_NEAREST
    return near, f"upstream llama-server has no {t} cache; {near} stands in for it and takes more memory"


def _gguf_name(model: Model, quant: str) -> str:
    if model.gguf_path:
        return model.gguf_path
    base = (model.hf_id or model.name).rstrip("/").split("/")[-1]
    return f"{base}-{quant.upper()}.gguf"


def launch_commands(model: Model, req: Request, target: Target | None = None) -> dict:
    """``kvslim serve`` and the equivalent llama-server and vLLM command lines for ``req``, with
    notes on what differs. kvslim takes every cache type of the plan as it is."""
    k, note_k = _llama_server_type(req.type_k)
    v, note_v = _llama_server_type(req.type_v)
    notes = [n for n in (note_k, note_v) if n]
    server = (f"llama-server -m {_gguf_name(model, req.weight_quant)} -c {req.ctx} -np {req.n_slots} "
              f"-ctk {k} -ctv {v} -fa on -ngl 99")
    if req.tp > 1:
        server += f" -sm layer -ts {','.join(['1'] * req.tp)}"
        notes.append("llama.cpp splits by layers across GPUs (-sm layer), not by heads; its per-GPU figures "
                     "differ from the tensor-parallel split above")
    dtype, vllm_notes = vllm_kv_dtype(req.type_k, req.type_v, model.config.head_dim)
    source = model.hf_id or model.gguf_path or model.name
    vllm = (f"vllm serve {source} --tensor-parallel-size {req.tp} --max-model-len {req.ctx_per_slot} "
            f"--max-num-seqs {req.n_slots} --kv-cache-dtype {dtype}")
    bf16 = weight_size(model, "bf16", req.tp).per_gpu
    notes += vllm_notes + [f"vLLM loads the checkpoint's own weights (bf16: {bf16 / catalog.GIB:.1f} GiB per GPU), "
                           f"not the {req.weight_quant} mix, and fills the rest of --gpu-memory-utilization "
                           f"with KV blocks"]
    if model.source == "gguf":
        notes.append("vLLM reads GGUF experimentally and needs --tokenizer set to the original repository")
    if target is not None and target.vendor == "apple":
        notes.append("vLLM does not run on Apple GPUs; use llama-server (Metal)")
    if req.tp > 1:
        notes.append("kvslim serve runs on one device: the kvslim line has no tensor-parallel split")
    kvslim = (f"kvslim serve -m {_gguf_name(model, req.weight_quant)} -c {req.ctx} -np {req.n_slots} "
              f"-ctk {req.type_k} -ctv {req.type_v}")
    return {"kvslim": kvslim, "vllm": vllm, "llama_server": server,
            "notes": list(dict.fromkeys(notes))}                                    # K = V: said once


def within_context_limit(model: Model, req: Request) -> tuple[Request, list[str]]:
    """``req`` with each slot cut to the model's context limit for the launch lines, and a note saying so."""
    limit = context_limit(model.config)
    if limit is None or req.ctx_per_slot <= limit:
        return req, []
    cut = dataclasses.replace(req, ctx=limit * req.n_slots, depth=None)
    return cut, [f"-c {req.ctx} gives each slot {req.ctx_per_slot} tokens, past the model's limit of {limit} "
                 f"(max_position_embeddings): vLLM refuses it and llama-server warns; the lines use -c {cut.ctx}"]
