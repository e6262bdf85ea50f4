"""``kvslim quant``: every KV format measured on the same random vectors."""
from __future__ import annotations

import argparse
import sys

import torch

from .. import formats
from ..formats.klt import random_calibration
from ..formats.stats import measure
from ..tables import markdown_table, render_records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim quant", description=__doc__,
                                epilog="types: " + ", ".join(formats.names()))
    p.add_argument("-t", "--type", default=None,
                   help="comma list of KV types to measure (default: all that need no model calibration and "
                        "can store --head-dim; "
                        "a calibrated type is fitted to separate random draws, which are white: its speed "
                        "is real, its error is not what it does on a model's values)")
    p.add_argument("--n", type=int, default=20000, help="number of random N(0,1) vectors")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=256, help="random query vectors for inner products")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timing repetitions (best is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", choices=["md", "json", "jsonl", "csv"], default="md")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.n < 1 or args.queries < 1 or args.repetitions < 1 or args.head_dim < 1:
        raise ValueError("--n, --queries, --head-dim and -r must be at least 1")
    fmts = chosen_formats(args.type, args.head_dim)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.n, args.head_dim, generator=gen)
    q = torch.randn(args.queries, args.head_dim, generator=gen)
    records = []
    with progress(fmts, args) as bar:          # all formats at the defaults take a minute or two
        for f in fmts:
            bar.set_postfix_str(f.name)
            if f.calibrated:                   # one head: rows (N, 1, D), as a cache holds them
                f = f.bind(random_calibration(f.name, 1, args.head_dim, args.seed))
                records.append(measure(f, x[:, None], q, args.repetitions).as_dict())
            else:
                records.append(measure(f, x, q, args.repetitions).as_dict())
            bar.update()
    print(render_records(records, args.output, lambda rs: render(rs, args.n)))
    return 0


def chosen_formats(names: str | None, head_dim: int) -> list:
    """-t's formats, each checked against head_dim before any is measured; without -t, every
    standalone format that can store head_dim."""
    if names is None:
        return [formats.get(n) for n in formats.standalone_names(head_dim)]
    fmts = formats.parse_list(names)
    if not fmts:
        raise ValueError("-t needs at least one KV type")
    for f in fmts:
        f.check_head_dim(head_dim)        # raises with the reason, before minutes of measuring others
    return fmts


def progress(fmts, args):
    from tqdm import tqdm

    return tqdm(total=len(fmts), desc=f"quant {args.n} x {args.head_dim}", unit="type", file=sys.stderr,
                leave=False, disable=args.no_progress or None, dynamic_ncols=True)


def render(records: list[dict], n: int) -> str:
    headers = ["type", "bits/value", "nmse", "ip rel err", "ip bias", "encode vec/s", "decode vec/s"]
    rows = [[r["type"], f"{r['bits_per_value']:.3f}", f"{r['nmse']:.6f}", f"{r['ip_rel_err']:.5f}",
             f"{r['ip_bias']:+.5f}", f"{r['encode_vps']:,.0f}", f"{r['decode_vps']:,.0f}"] for r in records]
    head = f"head_dim {records[0]['head_dim']}, {n} vectors drawn N(0,1); nmse = ||x - x_hat||^2 / ||x||^2\n\n"
    return head + markdown_table(headers, rows, ["l"] + ["r"] * 6)
