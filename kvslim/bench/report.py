"""llama-bench's output: the markdown table, csv/json/jsonl records, and a plot."""
from __future__ import annotations

import torch

from ..models.matmul_precision import prompt_mode
from ..tables import human_bytes, markdown_table
from ..weights import parameter_count, weight_bytes, weight_type_label


def model_facts(model, threads: int) -> dict:
    """llama-bench's model columns: quantized matrices count as rows x columns
    parameters (not as their uint8 bytes), and the type is the one holding most bytes."""
    params, size, dtype = parameter_count(model), weight_bytes(model), weight_type_label(model)
    device = next(model.parameters()).device
    return {"model_type": f"{model.config.model_type} {params / 1e6:.1f}M {dtype}", "model_size": size,
            "model_n_params": params, "backend": "CPU" if device.type == "cpu" else "CUDA", "n_threads": threads,
            "f32_matmul": prompt_mode(device)}          # kvslim's own field: how prompts' f32 matmuls ran


def record(facts: dict, test, case: dict, result: dict) -> dict:
    return {**facts, "n_prompt": test.n_prompt, "n_gen": test.n_generated, "n_depth": test.n_depth,
            "n_parallel": case["n_parallel"], "type_k": case["type_k"], "type_v": case["type_v"],
            "n_ubatch": case["n_ubatch"], "f16_window": case.get("f16_window", 0), "test": test.label,
            "decode_path": case["decode"] if test.n_generated else "",   # kvslim's own: which step decoded
            **result}


def markdown(records: list[dict]) -> str:
    """llama-bench's table; type_k/type_v columns only when some run is not f16, np when > 1."""
    show_types = any(r["type_k"] != "f16" or r["type_v"] != "f16" for r in records)
    show_np = any(r["n_parallel"] > 1 for r in records)
    show_window = any(r.get("f16_window") for r in records)
    on_gpu = any("peak_gpu_bytes" in r for r in records)
    peak_key = "peak_gpu_bytes" if on_gpu else "peak_rss_bytes"
    headers = ["model", "size", "params", "backend", "threads"] + (["type_k", "type_v"] if show_types else []) \
        + (["np"] if show_np else []) + (["f16 window"] if show_window else []) \
        + ["test", "t/s", "KV", "peak GPU" if on_gpu else "peak RSS"]
    rows = []
    for r in records:
        row = [r["model_type"], human_bytes(r["model_size"]), f"{r['model_n_params'] / 1e6:.2f} M", r["backend"],
               r["n_threads"]]
        row += [r["type_k"], r["type_v"]] if show_types else []
        row += [r["n_parallel"]] if show_np else []
        row += [r.get("f16_window", 0)] if show_window else []
        row += [r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", human_bytes(r["kv_bytes"]),
                human_bytes(r[peak_key]) if r.get(peak_key, -1) >= 0 else "n/a"]
        rows.append(row)
    align = ["l"] * (len(headers) - 3) + ["r", "r", "r"]
    return markdown_table(headers, rows, align)


def plot(records: list[dict], path: str) -> None:
    """tokens/s against depth, one line per K/V pair, pp and tg side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("pp", "tg")):
        # pp+tg runs (-pg) have both counts and belong to neither line
        runs = [r for r in records if (r["n_prompt"] if kind == "pp" else r["n_gen"])
                and not (r["n_prompt"] and r["n_gen"])]
        for pair in dict.fromkeys((r["type_k"], r["type_v"]) for r in runs):
            pts = sorted((r["n_depth"], r["avg_ts"], r["stddev_ts"]) for r in runs if (r["type_k"], r["type_v"]) == pair)
            d, ts, sd = zip(*pts)
            ax.errorbar(d, ts, yerr=sd, marker="o", capsize=3, label=f"{pair[0]}/{pair[1]}")
        label = runs[0]["test"].split(" ")[0] if runs else kind
        ax.set(title=f"{label} by depth", xlabel="depth (tokens)", ylabel="tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(records[0]["model_type"] if records else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def threads() -> int:
    return torch.get_num_threads()
