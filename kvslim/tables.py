"""Output people can read and machines can parse: llama-bench-style markdown tables,
JSON, JSONL and CSV records, byte sizes in llama.cpp's units. Below every tool, so
the library's own reports (bench, eval) print the same way the tools do."""
from __future__ import annotations

import csv
import io
import json


def markdown_table(headers: list[str], rows: list[list], align: list[str] | None = None) -> str:
    """A GitHub markdown table like llama-bench prints; align items are 'l' or 'r'."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    align = list(align or [])
    align += ["l"] * (len(headers) - len(align))                      # a short list drops no column

    def fmt(row):
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([fmt(headers), rule] + [fmt(r) for r in cells])


def to_json(records: list[dict]) -> str:
    return json.dumps(records, indent=2)


def to_jsonl(records: list[dict]) -> str:
    return "\n".join(json.dumps(r) for r in records)


def to_csv(records: list[dict]) -> str:
    if not records:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)
    return buf.getvalue().rstrip("\n")


def human_bytes(n: int | float) -> str:
    """Binary units as llama.cpp prints them (MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def render_records(records: list[dict], output: str, markdown) -> str:
    """One tool's records in the chosen output: ``markdown(records)`` for md, else json/jsonl/csv
    (csv leaves out list-valued fields such as per-run samples)."""
    if output == "json":
        return to_json(records)
    if output == "jsonl":
        return to_jsonl(records)
    if output == "csv":
        return to_csv([{k: v for k, v in r.items() if not isinstance(v, list)} for r in records])
    return markdown(records)
