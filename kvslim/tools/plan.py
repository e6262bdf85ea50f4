"""``kvslim plan``: will this model, context and K/V cache fit on my machine? Answered before anything loads."""
from __future__ import annotations

import argparse
import itertools
import json

from .. import formats, plan
from ..loading import BUNDLED
from ..plan import catalog
from ..tables import human_bytes as size
from ..tables import markdown_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvslim plan", description=__doc__,
        epilog=f"models: {', '.join(catalog.MODELS)}\ngpus: {', '.join(catalog.HARDWARE)}\n"
               f"cache types: {', '.join(formats.names())}\nweight quantizations: {', '.join(catalog.WEIGHT_QUANTS)}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None,
                   help="catalog name or its Hugging Face id, a Hugging Face folder (config.json) or a .gguf file "
                        "(default: the bundled model)")
    p.add_argument("-c", "--ctx-size", default="4096",
                   help="comma list of total contexts, shared by the -np slots (32k = 32768, 1M = 1048576; "
                        "0 = the model's limit)")
    p.add_argument("-np", "--parallel", default="1", help="comma list of slot counts")
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="comma list of K cache types")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="comma list of V cache types")
    p.add_argument("-wq", "--weight-quant", default=None,
                   help=f"comma list of weight quantizations (default: a GGUF's own size, a folder's stored "
                        f"dtype, else {plan.DEFAULT_WEIGHT_QUANT})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpu", help="a machine from the hardware catalog (default: this machine)")
    where.add_argument("--mem", help="memory available to the model, e.g. 24GiB (default: this machine's)")
    p.add_argument("--bw", type=float, default=None, help="memory bandwidth in GB/s (with --mem)")
    p.add_argument("-d", "--depth", type=int, default=None,
                   help="cached tokens for the decode ceiling (default: a full slot)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel over N GPUs of --gpu")
    p.add_argument("--f16-window", type=int, default=0,
                   help="newest tokens per slot kept in f16 before they are packed (counted in the KV bytes)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=plan.DEFAULT_UBATCH,
                   help="tokens per compute pass (sizes the compute workspace)")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model = plan.resolve_model(args.model or str(BUNDLED))
    target = pick_target(args)
    if args.bw is not None:
        target = plan.Target(target.name, target.memory, _positive_bw(args.bw), target.vendor)
    result = plan.report(model, target, requests(args, model))
    print(json.dumps(result, indent=2) if args.output == "json" else render(result))
    return 0


def pick_target(args) -> plan.Target:
    """--gpu from the catalog, --mem, else this machine."""
    if args.gpu:
        return plan.gpu_target(args.gpu)
    return plan.memory_target(args.mem) if args.mem else plan.local_target()


def _positive_bw(gbs: float) -> float:
    if gbs <= 0:
        raise ValueError(f"--bw must be positive GB/s, got {gbs}")
    return gbs * 1e9


def parse_counts(text: str, flag: str, allow_zero: bool = False) -> list[int]:
    """'4096,32k,1M' -> [4096, 32768, 1048576]; refuses negative, malformed and (unless allowed) zero values."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        scale = {"k": 1 << 10, "m": 1 << 20}.get(part[-1:], 1)
        digits = part[:-1] if scale > 1 else part
        if not digits.lstrip("-").isdigit():
            raise ValueError(f"{flag}: {part!r} is not a whole number")
        value = int(digits) * scale
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"{flag} must be {'0 or more' if allow_zero else 'at least 1'}, got {part}")
        out.append(value)
    if not out:
        raise ValueError(f"{flag} needs at least one value")
    return out


def parse_types(text: str, flag: str) -> list[str]:
    fmts = formats.parse_list(text)  # unknown names raise, listing the valid ones
    if not fmts:
        raise ValueError(f"{flag} needs at least one cache type")
    keys = [f.name for f in fmts if f.calibrated] if flag == "-ctk" else []
    if keys:
        # the cache refuses a calibrated K type at load: a plan and launch line for it would never run
        raise ValueError(f"-ctk {keys[0]}: {keys[0]} is a V cache type (-ctv only); for K use nl4s, q4_0 or turbo4")
    return [f.name for f in fmts]


def requests(args, model: plan.Model) -> list[plan.Request]:
    """Every combination of the comma lists, as planner requests."""
    trained = plan.max_context_per_slot(model.config)
    contexts = [c or trained for c in parse_counts(args.ctx_size, "-c", allow_zero=True)]
    quants = args.weight_quant or ("gguf" if model.gguf_bytes else model.stored_quant or plan.DEFAULT_WEIGHT_QUANT)
    quants = [plan.check_weight_quant(model, q) for q in quants.split(",") if q.strip()]
    combos = itertools.product(quants, parse_counts(args.parallel, "-np"), contexts,
                               parse_types(args.cache_type_k, "-ctk"), parse_types(args.cache_type_v, "-ctv"))
    return [plan.Request(ctx, n_slots, k, v, wq, args.tp, args.depth, args.ubatch_size, f16_window=args.f16_window)
            for wq, n_slots, ctx, k, v in combos]


# ----- printing ------------------------------------------------------------------------------------

def render(result: dict) -> str:
    """The markdown answer: model and target, the rows, largest contexts, fixes, launch lines."""
    parts = [_header(result), _rows_table(result["rows"]), _largest_table(result["largest_context"])]
    past = [r for r in result["rows"] if r["past_limit"]]
    if past:
        parts.insert(2, _past_limit(past, result["model"]))
    fixes = [_fixes(r) for r in result["rows"] if not r["fits"]]
    if fixes:
        parts.append("Does not fit:\n" + "\n".join(fixes))
    parts.append(_launch(result))
    return "\n\n".join(parts)


def _header(result: dict) -> str:
    m, t, tp = result["model"], result["target"], result["rows"][0]["tp"]
    source = m["hf_id"] or m["gguf"] or m["source"]
    lines = [f"{m['name']} ({source}, {m['model_type']}): {m['params'] / 1e9:.2f}B parameters, "
             f"{m['active_params'] / 1e9:.2f}B active per token; {_context_words(m)}",
             f"{m['layers']} layers: {m['attention_layers']} attention (KV {m['kv_bytes_per_token_f16'] / 1024:g} KiB "
             f"per token at f16)" + (f", {m['state_layers']} DeltaNet (state {size(m['state_bytes_per_slot'])} "
                                     f"per slot)" if m["state_layers"] else "")]
    bw = f", {t['bandwidth_gbs']:g} GB/s" if t["bandwidth_gbs"] else " (no bandwidth: give --bw for decode ceilings)"
    per_gpu = f" per GPU, tensor parallel over {tp}" if tp > 1 else ""
    lines.append(f"target: {t['name']}, {size(t['memory'])} usable{per_gpu}{bw}")
    return "\n".join(lines)


def _context_words(m: dict) -> str:
    words = f"context limit {m['max_context']} (max_position_embeddings)"
    return words + (f", trained on sequences of at most {m['trained_context']}" if m["trained_context"] else "")


def _past_limit(rows: list[dict], m: dict) -> str:
    lines = [f"- -c {r['ctx']} -np {r['n_slots']}: {r['ctx_per_slot']} tokens per slot, past the model's limit of "
             f"{m['max_context']}; memory is not what stops it" for r in rows]
    return "Past the model's context limit (the 'fits' column counts memory only):\n" + "\n".join(lines)


def _decode(row: dict) -> str:
    return "-" if row["decode_tps"] is None else f"{row['decode_tps']:.0f} @ {row['depth']}"


def _rows_table(rows: list[dict]) -> str:
    headers = ["-c", "-np", "-ctk", "-ctv", "-wq", "weights", "KV", "state", "compute", "total", "headroom", "fits",
               "decode t/s @ depth"]
    body = [[r["ctx"], r["n_slots"], r["type_k"], r["type_v"], r["weight_quant"], size(r["weights"]), size(r["kv"]),
             size(r["state"]), size(r["compute"]), size(r["total"]), size(r["headroom"]),
             ("yes" if r["fits"] else "NO") + (" (past limit)" if r["past_limit"] else ""), _decode(r)] for r in rows]
    return markdown_table(headers, body, ["r", "r", "l", "l", "l"] + ["r"] * 6 + ["l", "r"])


def _largest_table(rows: list[dict]) -> str:
    headers = ["-ctk", "-ctv", "-wq", "-np", "KV/token", "largest -c", "KV there"]
    body = [[r["type_k"], r["type_v"], r["weight_quant"], r["n_slots"], f"{r['kv_bytes_per_token']:,} B",
             (f"{r['ctx']} (model max)" if r["capped"] else str(r["ctx"])) if r["ctx"] else "none fits",
             size(r["kv"]) if r["ctx"] else "-"] for r in rows]
    return "Largest context that fits:\n\n" + markdown_table(headers, body, ["l"] * 3 + ["r"] * 4)


def _fixes(row: dict) -> str:
    what = f"-c {row['ctx']} -np {row['n_slots']} -ctk {row['type_k']} -ctv {row['type_v']} -wq {row['weight_quant']}"
    head = f"- {what}: needs {size(row['total'])}, {size(-row['headroom'])} over."
    if not row["suggestions"]:
        return head + f" Nothing here fits it (weights alone take {size(row['weights'])})."
    return head + " Fits with " + "; or ".join(f"{s['flags']} ({size(s['total'])})" for s in row["suggestions"])


def _launch(result: dict) -> str:
    best, launch = result["recommended"], result["launch"]
    title = (f"Launch lines (longest fitting row: -c {best['ctx']} -np {best['n_slots']} -ctk {best['type_k']} "
             f"-ctv {best['type_v']} -wq {best['weight_quant']}"
             f"{', cut to the model limit' if best['past_limit'] else ''}):" if best else
             "Launch lines (nothing fits; shown for the first row):")
    lines = [title, f"  {launch['kvslim']}", f"  {launch['llama_server']}", f"  {launch['vllm']}"]
    return "\n".join(lines + [f"  note: {n}" for n in launch["notes"]])
