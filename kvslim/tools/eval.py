"""``kvslim eval``: quality of every K/V cache pair: perplexity, KL divergence, depth, needles, sampling, attention.

    kvslim eval ppl       -f TEXT -c 4096 -ctk f16,q8_0,turbo4
    kvslim eval kld       --kl-divergence-base base.kld                         # write the f16 reference, once
    kvslim eval kld       --kl-divergence-base base.kld --kl-divergence -ctk q8_0 -ctv turbo4  # compare
    kvslim eval kld       --pairs f16,q8_0,q4_0,turbo4,q8_0/turbo3            # sweep, exact, no file
    kvslim eval depth     -c 16384 --pairs q8_0,turbo4 --png depth.png
    kvslim eval niah      -c 4096 --pairs f16,turbo3 --png niah.png
    kvslim eval ruler     -c 16384 --pairs f16,q8_0/turbo4,turbo3 --png ruler.png
    kvslim eval sampling  --pairs q8_0,turbo4 --temp 0.8
    kvslim eval attention --pairs q8_0,q4_0,turbo4,turbo3

-ctk/-ctv take comma lists and sweep every pair; --pairs lists pairs explicitly
(``K/V``, or one name for both). Without -f the text is the held-out text that
ships with kvslim (kvslim/data/text: Austen, Wells/Verne/Dickens, KJV chapters
the bundled model never saw). The KL-divergence flags are llama-perplexity's:
--kl-divergence-base FILE alone writes the reference, with --kl-divergence it
compares. Compute is f32 unless --dtype says otherwise: bf16 arithmetic alone
moves the logits more than a q8_0 cache does.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from .. import formats
from ..data import HELDOUT_FILES
from ..tables import markdown_table
from .common import add_model_args, add_sampling_args, apply_threads, check_output, load_kwargs
from .engine_args import engine_config

SUBCOMMANDS = ("ppl", "kld", "depth", "niah", "ruler", "sampling", "attention")
DEFAULT_CTX = {"ppl": 4096, "kld": 4096, "depth": 16384, "niah": 4096, "ruler": 4096, "sampling": 4096}


# ----- arguments ---------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvslim eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = p.add_subparsers(dest="what", metavar="{" + ",".join(SUBCOMMANDS) + "}", required=True)
    helps = {"ppl": "perplexity over chunks of -c tokens (second half scored)",
             "kld": "KL divergence vs a reference cache, llama-perplexity's blocks",
             "depth": "KL divergence and top-1 agreement by depth band",
             "niah": "needle retrieval over context lengths x depths, table + heatmap",
             "ruler": "RULER-style tasks (needles, kv retrieval, variable tracking, common words) x lengths x depths",
             "sampling": "drift of the truncated sampling distribution",
             "attention": "attention fidelity on all-MiniLM-L6-v2's real K/V"}
    extra = {"ppl": None, "kld": _args_kld, "depth": _args_depth, "niah": _args_niah, "ruler": _args_ruler,
             "sampling": _args_sampling,
             "attention": _args_attention}
    for name in SUBCOMMANDS:
        s = sub.add_parser(name, help=helps[name], description=helps[name])
        add_common_args(s, name)
        if extra[name]:
            extra[name](s)
    return p


def add_common_args(p: argparse.ArgumentParser, name: str) -> None:
    # f32 compute by default: with bf16 weights' arithmetic a q8_0 cache's KLD reads 0.000088, in f32 0.000001
    add_model_args(p, dtype="f32", ctx_help=ctx_help(name))
    p.set_defaults(ctx_size=None, cache_type_k=None, cache_type_v=None)
    p.add_argument("--pairs", default=None, help="explicit K/V pairs, e.g. f16,q4_0,q8_0/turbo4 (overrides -ctk/-ctv)")
    p.add_argument("-f", "--file", action="append", default=[], help="text file (repeatable); default: the held-out text shipped in kvslim/data/text")
    p.add_argument("--chunks", type=int, default=0, help="use at most this many chunks (0 or -1: all)")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="llama-perplexity's logical batch: as there, a prefill pass takes min(-b, -ub) tokens; "
                        "the results do not depend on it")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


CTX_MEANING = {"depth": "tokens per window, every row scored", "niah": "largest context length",
               "ruler": "largest context length"}


def ctx_help(name: str) -> str:
    """-c's help with what it means in ``name`` and its own default, which is not llama-perplexity's 512."""
    if name not in DEFAULT_CTX:
        return "context size per sequence (tokens)"
    return f"{CTX_MEANING.get(name, 'tokens per chunk, second half scored')} (default {DEFAULT_CTX[name]})"


def _args_kld(p):
    # llama-perplexity's flags: the base file alone writes it; with --kl-divergence it is read and compared
    p.add_argument("--kl-divergence-base", metavar="FILE", default=None,
                   help="reference log-probs (cache types --base-ctk/--base-ctv): written, unless --kl-divergence "
                        "or -ctk/-ctv/--pairs ask to compare against it")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare -ctk/-ctv (default f16) against the --kl-divergence-base FILE written earlier")
    p.add_argument("--save-base", action="store_true", help=argparse.SUPPRESS)   # kvslim's earlier name for writing
    _base_args(p)
    p.add_argument("--kld-top-k", type=int, default=0,
                   help="when writing the base: 0 (default) stores the whole vocabulary (uint16 log-probs, exact KLD); "
                        "K > 0 keeps the top K plus one tail bucket, a lower bound on the KLD")


def _base_args(p):
    p.add_argument("--base-ctk", default="f16", help="reference K cache type (default f16)")
    p.add_argument("--base-ctv", default="f16", help="reference V cache type (default f16)")


def _args_depth(p):
    _base_args(p)
    p.add_argument("--bands", default="0,1024,4096,16384", help="depth band edges in tokens")
    p.add_argument("--png", default=None, help="save the KLD / top-1 curve by depth to this PNG")


def _args_niah(p):
    p.add_argument("--lengths", default=None, help="context lengths (default: powers of two up to -c)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    p.add_argument("-n", "--samples", type=int, default=5, help="samples per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=None, help="also save the heatmap to this PNG")


def _args_ruler(p):
    from ..eval import ruler

    p.add_argument("--tasks", default="all", help="comma list of " + ", ".join(ruler.TASKS) + " (default all)")
    p.add_argument("--lengths", default=None, help="context lengths, e.g. 1024,4096,16384,65536 (default: -c)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in ruler.DEFAULT_DEPTHS),
                   help="needle depths in [0, 1] (vt and cwe spread over the whole text)")
    p.add_argument("-n", "--samples", type=int, default=1, help="samples per (task, length); each asks every depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=None, help="also save the heatmaps, one per task and pair, to this PNG")


def _args_sampling(p):
    _base_args(p)
    add_sampling_args(p)


def _args_attention(p):
    p.add_argument("--sentences", type=int, default=64, help="number of sentences to encode")


# ----- inputs ------------------------------------------------------------------------
def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``"q4_0,q8_0/turbo4"`` -> [("q4_0", "q4_0"), ("q8_0", "turbo4")], names checked."""
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        k, _, v = item.partition("/")
        pairs.append((formats.get(k.strip()).name, formats.get((v or k).strip()).name))
    return pairs


def resolve_pairs(args, default: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The K/V pairs to evaluate: --pairs, else every -ctk x -ctv combination, else ``default``."""
    if args.pairs:
        pairs = parse_pairs(args.pairs)
    elif args.cache_type_k is None and args.cache_type_v is None:
        pairs = default
    else:
        ks = [formats.get(x).name for x in (args.cache_type_k or "f16").split(",") if x.strip()]
        vs = [formats.get(x).name for x in (args.cache_type_v or "f16").split(",") if x.strip()]
        pairs = list(itertools.product(ks, vs))
    if not pairs:
        raise ValueError("no K/V pairs given")
    return pairs


def number_list(text: str, flag: str, kind=int) -> list:
    """``"0,1024,4096"`` -> [0, 1024, 4096]; a word in the list is named, not a Python conversion error."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of numbers, got {text!r}") from None


def check_lengths(lengths: list[int], n_ctx: int) -> None:
    """Context lengths for niah/ruler: positive (a length of 0 would score a bare question) and within -c."""
    if not lengths:
        raise ValueError("--lengths needs at least one context length")
    if min(lengths) < 1:
        raise ValueError(f"context lengths must be at least 1 token, got {min(lengths)}")
    if max(lengths) > n_ctx:
        raise ValueError(f"context length {max(lengths)} exceeds -c {n_ctx}")


def base_pair(args) -> tuple[str, str]:
    return parse_pairs(f"{args.base_ctk}/{args.base_ctv}")[0]


def read_documents(files: list[str]) -> list[str]:
    """Documents of the given files ('\\f'-separated as the corpus writes them), or of the held-out split."""
    paths = [Path(f) for f in files] or list(HELDOUT_FILES)
    docs = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read text file {path}: {getattr(err, 'strerror', None) or err}") from None
        docs += [d for d in (part.strip("\n") for part in text.split("\f\n")) if d]
    if not docs:
        raise ValueError(f"the text file(s) {', '.join(map(str, paths))} are empty")
    return docs


def load_llm(args, ctx: int, **engine):
    from ..engine import load

    return load(args.model, **load_kwargs(args),
                config=engine_config(args, ctx=ctx, type_k="f16", type_v="f16", **engine))


def text_chunks(args, llm, n_ctx: int) -> list[list[int]]:
    from ..eval.perplexity import bos_id, chunk_ids

    ids = llm.tokenize("\n\n".join(read_documents(args.file)), add_special=False)
    return chunk_ids(ids, n_ctx, args.chunks, bos_id(llm))


def progress_bar(args, total: int, desc: str, unit: str = "tok"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False, file=sys.stderr,
                disable=args.no_progress or None, dynamic_ncols=True)


def ctx_of(args) -> int:
    from ..eval.perplexity import MIN_CTX

    ctx = args.ctx_size if args.ctx_size is not None else DEFAULT_CTX[args.what]
    if ctx < MIN_CTX:
        raise ValueError(f"-c {ctx} is too small: chunks need at least {MIN_CTX} tokens")
    return ctx


def head_dim_of(llm) -> int:
    return llm.model.config.head_dim


def bits(pair, head_dim: int) -> str:
    return f"{(formats.get(pair[0]).bits_per_value(head_dim) + formats.get(pair[1]).bits_per_value(head_dim)) / 2:.2f}"


def emit(args, records, markdown: str) -> None:
    print(json.dumps(records, indent=2) if args.output == "json" else markdown)


# ----- subcommands -------------------------------------------------------------------------
def run_ppl(args) -> int:
    from ..eval.perplexity import perplexity, with_cache_types

    n_ctx = ctx_of(args)
    pairs = resolve_pairs(args, [("f16", "f16")])
    llm = load_llm(args, n_ctx)
    chunks = text_chunks(args, llm, n_ctx)
    results, lines = [], []
    for pair in pairs:
        with progress_bar(args, len(chunks) * n_ctx, f"ppl {pair[0]}/{pair[1]}") as bar:
            r = perplexity(with_cache_types(llm, *pair), chunks, bar.update)
        results.append(r)
        lines.append(f"{pair[0]}/{pair[1]}: {r.final_line()}")
    hd = head_dim_of(llm)
    table = markdown_table(["type_k", "type_v", "bits/value", "chunks", "tokens", "PPL", "±"],
                           [[r.type_k, r.type_v, bits((r.type_k, r.type_v), hd), r.n_chunks, len(r.nll),
                             f"{r.ppl:.4f}", f"{r.uncertainty:.5f}"] for r in results], ["l", "l"] + ["r"] * 5)
    emit(args, [r.as_dict() for r in results], "\n".join(lines) + f"\n\nn_ctx {n_ctx}\n\n" + table)
    return 0


def kld_mode(args) -> str:
    """'write' a base file, 'compare' against one, or 'sweep' (no file: base and pairs side by side).

    As llama-perplexity: the base file alone writes it, with --kl-divergence it is read. Cache types to
    compare (-ctk/-ctv/--pairs) with a base file also mean reading it, as kvslim always took them."""
    base = args.kl_divergence_base
    if args.kld_top_k < 0:                  # 0 is "whole vocabulary"; -5 read as 0 hid a typo
        raise ValueError(f"--kld-top-k must be 0 (whole vocabulary) or more, got {args.kld_top_k}")
    if args.kl_divergence and args.save_base:
        raise ValueError("--kl-divergence compares against the base file; --save-base writes it: give one")
    if not base:
        if args.save_base or args.kl_divergence:
            # llama-perplexity refuses this too; a silent f16-vs-f16 sweep would read as "no damage"
            flag = "--save-base" if args.save_base else "--kl-divergence"
            raise ValueError(f"{flag} needs --kl-divergence-base FILE")
        return "sweep"
    compare = args.kl_divergence or (not args.save_base and (args.pairs or args.cache_type_k or args.cache_type_v))
    if compare:
        if not Path(base).is_file():
            raise ValueError(f"no such file {base}: write the KL-divergence base first with "
                             f"'kvslim eval kld --kl-divergence-base {base}' (add -f TEXT and -c N as needed)")
        return "compare"
    check_output(base, "cannot write")
    return "write"


def run_kld(args) -> int:
    from ..eval import perplexity as P

    mode = kld_mode(args)
    base = base_pair(args)
    pairs = resolve_pairs(args, [("f16", "f16")])
    if mode == "compare":
        ref = P.Reference.load(args.kl_divergence_base)
        if args.ctx_size is not None and args.ctx_size != ref.n_ctx:
            raise ValueError(f"{args.kl_divergence_base} was computed with -c {ref.n_ctx}, not -c {args.ctx_size}")
        llm = load_llm(args, ref.n_ctx)
        if args.chunks > 0:                 # -1 is llama-perplexity's "all", as in text_chunks
            ref = _first_chunks(ref, args.chunks)
        comparisons = []
        for pair in pairs:
            with progress_bar(args, ref.tokens.size, f"kld {pair[0]}/{pair[1]}") as bar:
                comparisons.append(P.compare(P.with_cache_types(llm, *pair), ref, bar.update))
        meta = {"base_type_k": ref.meta.get("type_k"), "base_type_v": ref.meta.get("type_v"), "n_ctx": ref.n_ctx,
                "chunks": len(ref.tokens), "top_k": ref.top_k}
    else:
        n_ctx = ctx_of(args)
        llm = load_llm(args, n_ctx)
        chunks = text_chunks(args, llm, n_ctx)
        if mode == "write":
            return write_base(args, P, llm, chunks, base)
        with progress_bar(args, len(chunks) * n_ctx * (1 + len(pairs)), "kld") as bar:
            comparisons = P.compare_exact(P.with_cache_types(llm, *base), [P.with_cache_types(llm, *pair)
                                                                            for pair in pairs], chunks,
                                          progress=bar.update)
        meta = {"base_type_k": base[0], "base_type_v": base[1], "n_ctx": n_ctx, "chunks": len(chunks), "top_k": 0}
    stats = [{**P.kld_statistics(c), **meta} for c in comparisons]
    emit(args, stats, render_kld(stats, head_dim_of(llm)))
    return 0


def write_base(args, P, llm, chunks, base) -> int:
    """Compute the reference log-probs with the base cache types and save them (llama-perplexity's first run)."""
    n_ctx = len(chunks[0])
    with progress_bar(args, len(chunks) * n_ctx, f"base {base[0]}/{base[1]}") as bar:
        ref = P.reference(P.with_cache_types(llm, *base), chunks, top_k=args.kld_top_k, progress=bar.update)
    ref.save(args.kl_divergence_base)
    ppl = P.PerplexityResult(-ref.next_logp.astype("float64"), ref.n_ctx, len(chunks), *base)
    emit(args, [{**ppl.as_dict(), "base_file": args.kl_divergence_base, "top_k": ref.top_k}],
         f"{ppl.final_line()}\nsaved {base[0]}/{base[1]} log-probs of {len(ref.next_logp)} tokens "
         f"({ref.storage}) to {args.kl_divergence_base}")
    return 0


def _first_chunks(ref, n: int):
    return ref.first_chunks(n)


def render_kld(stats: list[dict], head_dim: int) -> str:
    from ..eval.perplexity import format_kld_block

    if len(stats) == 1:
        return format_kld_block(stats[0])
    parts = []
    for s in stats:
        parts += [f"### K {s['type_k']} / V {s['type_v']} vs {s['base_type_k']}/{s['base_type_v']} "
                  f"({s['chunks']} chunks of {s['n_ctx']})", "", format_kld_block(s), ""]
    rows = [[s["type_k"], s["type_v"], bits((s["type_k"], s["type_v"]), head_dim),
             f"{s['ppl']:.4f} ± {s['ppl_unc']:.4f}", f"{100 * s['ln_ppl_ratio']:+.3f}%",
             f"{s['kld_mean']:.6f}", f"{s['kld_p99.9']:.4f}", f"{100 * s['same_top']:.2f}%"] for s in stats]
    parts.append(markdown_table(["type_k", "type_v", "bits/value", "PPL", "ln(PPL/base)", "mean KLD", "99.9% KLD",
                                 "same top-1"], rows, ["l", "l"] + ["r"] * 6))
    return "\n".join(parts)


def run_depth(args) -> int:
    from ..eval import depth as D
    from ..eval import perplexity as P

    n_ctx = ctx_of(args)
    base = base_pair(args)
    pairs = resolve_pairs(args, [("f16", "f16")])
    edges = number_list(args.bands, "--bands")
    check_output(args.png, "--png")
    llm = load_llm(args, n_ctx)
    chunks = text_chunks(args, llm, n_ctx)
    with progress_bar(args, len(chunks) * n_ctx * (1 + len(pairs)), "depth") as bar:
        comparisons = P.compare_exact(P.with_cache_types(llm, *base), [P.with_cache_types(llm, *pair)
                                                                        for pair in pairs], chunks, first=0,
                                      progress=bar.update)
    records, curves = [], []
    for c in comparisons:
        records += D.depth_profile(c, n_ctx, edges)
        curves.append(D.depth_curve(c, n_ctx))
    if args.png:
        D.plot_depth(curves, args.png, f"KV cache quality by depth vs {base[0]}/{base[1]} "
                                       f"({len(chunks)} windows of {n_ctx})")
    rows = [[r["type_k"], r["type_v"], r["band"], r["tokens"], f"{r['kld_mean']:.6f} ± {r['kld_unc']:.6f}",
             f"{r['kld_p99']:.5f}", f"{100 * r['same_top']:.2f}%", f"{r['ppl']:.3f}", f"{r['ppl_base']:.3f}"]
            for r in records]
    table = markdown_table(["type_k", "type_v", "depth", "tokens", "mean KLD", "99% KLD", "same top-1", "PPL",
                            "PPL(base)"], rows, ["l", "l", "l"] + ["r"] * 6)
    note = f"\n\nsaved {args.png}" if args.png else ""
    emit(args, {"bands": records, "curves": curves, "n_ctx": n_ctx, "windows": len(chunks)},
         f"depth profile vs {base[0]}/{base[1]}: {len(chunks)} windows of {n_ctx} tokens\n\n{table}{note}")
    return 0


def run_niah(args) -> int:
    from ..eval import niah as N
    from ..eval.perplexity import with_cache_types

    n_ctx = ctx_of(args)
    lengths = number_list(args.lengths, "--lengths") if args.lengths else N.default_lengths(n_ctx)
    depths = number_list(args.depths, "--depths", float)
    if args.samples < 1 or not depths:
        raise ValueError("niah needs at least one depth and -n >= 1")
    check_lengths(lengths, n_ctx)
    check_output(args.png, "--png")
    pairs = resolve_pairs(args, [("f16", "f16")])
    llm = load_llm(args, n_ctx + 8)
    docs = read_documents(args.file)
    samples = N.build_samples(docs, lambda t: len(llm.tokenize(t)), lengths, depths, args.samples, args.seed)
    grids = []
    for pair in pairs:
        with progress_bar(args, len(samples) * args.samples, f"niah {pair[0]}/{pair[1]}", unit="sample") as bar:
            grids.append(N.run_grid(with_cache_types(llm, *pair), samples, bar.update))
    if args.png:
        N.plot_heatmaps(grids, args.png)
    parts = []
    for g in grids:
        parts += [f"### K {g['type_k']} / V {g['type_v']}: {100 * g['overall']:.1f}% "
                  f"({g['samples_per_cell']} samples per cell)", "", N.render_table(g), ""]
    if args.png:
        parts.append(f"saved {args.png}")
    emit(args, grids, "\n".join(parts).rstrip())
    return 0


def run_ruler(args) -> int:
    import time

    from ..eval import ruler as R
    from ..eval.perplexity import with_cache_types

    n_ctx = ctx_of(args)
    lengths = number_list(args.lengths, "--lengths") if args.lengths else R.default_lengths(n_ctx)
    depths = number_list(args.depths, "--depths", float)
    tasks = R.check_tasks([x.strip() for x in args.tasks.split(",") if x.strip()])
    if args.samples < 1:
        raise ValueError("ruler needs -n >= 1")
    check_lengths(lengths, n_ctx)
    check_output(args.png, "--png")
    pairs = resolve_pairs(args, [("f16", "f16")])
    # prefix reuse between consecutive prompts: a DeltaNet checkpoint every ubatch of every prompt
    llm = load_llm(args, n_ctx + 8, prefix_cache=True, checkpoint_interval=args.ubatch_size,
                   max_checkpoints=n_ctx // args.ubatch_size + 4, checkpoint_bytes=1 << 30)
    queries = ruler_builder(args, llm).build(tasks, lengths, depths, args.samples, args.seed)
    results = []
    for pair in pairs:
        t0 = time.perf_counter()
        with progress_bar(args, len(queries), f"ruler {pair[0]}/{pair[1]}", unit="query") as bar:
            records = R.run(with_cache_types(llm, *pair), queries, bar.update)
        results.append({"type_k": pair[0], "type_v": pair[1], "seconds": time.perf_counter() - t0,
                        "tasks": R.summary(records, depths), "queries": records})
    if args.png:
        R.plot_heatmaps(results, args.png)
    head = (f"ruler: {len(queries)} queries per K/V pair; lengths {','.join(map(str, lengths))}; depths "
            f"{','.join(f'{d:g}' for d in depths)}; {args.samples} sample(s) per task and length; greedy\n\n")
    note = f"\n\nsaved {args.png}" if args.png else ""
    meta = {"n_ctx": n_ctx, "lengths": lengths, "depths": depths, "samples": args.samples, "seed": args.seed}
    emit(args, {**meta, "results": results}, head + R.render(results, depths) + note)
    return 0


def ruler_builder(args, llm):
    """The task builder over the -f text (default: the shipped held-out text) in ``llm``'s tokens."""
    from ..eval import ruler as R
    from ..eval.haystack import TokenSpace
    from ..eval.perplexity import bos_id

    space = TokenSpace(lambda t: llm.tokenize(t, add_special=False), llm.detokenize, llm.tokenizer.vocab_size)
    stream = []
    for doc in read_documents(args.file):
        stream += llm.tokenize(doc, add_special=False) + [space.blank_line]
    bos = bos_id(llm)
    return R.RulerBuilder(space, stream, llm.detokenize, [] if bos is None else [bos])


def run_sampling(args) -> int:
    from ..engine.sampling import SamplingParams
    from ..eval.perplexity import with_cache_types
    from ..eval.sampling import drift
    from .common import sampling_kwargs

    n_ctx = ctx_of(args)
    params = SamplingParams(**sampling_kwargs(args))
    seed = params.seed if params.seed is not None else 0
    pairs = resolve_pairs(args, [("f16", "f16")])
    base = base_pair(args)
    llm = load_llm(args, n_ctx)
    chunks = text_chunks(args, llm, n_ctx)
    ref = with_cache_types(llm, *base)
    records = []
    for pair in pairs:
        with progress_bar(args, len(chunks) * n_ctx, f"sampling {pair[0]}/{pair[1]}") as bar:
            records.append(drift(ref, with_cache_types(llm, *pair), chunks, params, seed=seed,
                                 progress=bar.update).summary())
    rows = [[r["type_k"], r["type_v"], r["positions"], f"{r['tv_mean']:.5f} ± {r['tv_unc']:.5f}",
             f"{r['tv_p99']:.4f}", f"{100 * r['sampled_differs']:.2f}% ± {100 * r['sampled_differs_unc']:.2f}",
             f"{100 * r['argmax_differs']:.2f}%", f"{r['support_mean']:.1f}"] for r in records]
    head = (f"sampling drift vs {base[0]}/{base[1]}: temp {params.temperature}, top-k {params.top_k}, "
            f"top-p {params.top_p}, min-p {params.min_p}; {len(chunks)} chunks of {n_ctx}, second halves\n\n")
    emit(args, records, head + markdown_table(
        ["type_k", "type_v", "positions", "mean TV", "99% TV", "sampled token differs", "argmax differs",
         "support"], rows, ["l", "l"] + ["r"] * 6))
    return 0


def run_attention(args) -> int:
    from ..eval import minilm as M

    if args.sentences < 1:
        raise ValueError(f"--sentences must be at least 1, got {args.sentences}")
    model = M.MiniLM()
    head_dim = model.config["hidden_size"] // model.n_heads      # 32: below the nl formats' 64-value rotation
    pairs = resolve_pairs(args, [(n, n) for n in formats.standalone_names(head_dim)])
    sentences = M.split_sentences("\n\n".join(attention_text(args)), args.sentences)
    if not sentences:
        raise ValueError("no usable sentences in the text (need prose with sentences of 6-60 words)")
    with progress_bar(args, len(sentences) * len(pairs), "attention", unit="sent") as bar:
        records = M.attention_fidelity(model, sentences, pairs, bar.update)
    rows = [[r["type_k"], r["type_v"], bits((r["type_k"], r["type_v"]), head_dim), f"{r['attn_rel_err']:.5f}",
             f"{r['attn_rel_err_max']:.5f}", f"{r['cos_mean']:.6f}", f"{r['cos_min']:.6f}"] for r in records]
    head = (f"all-MiniLM-L6-v2 (6 layers, 12 heads x 32), {len(sentences)} sentences; attention error = "
            f"||A - A_exact|| / ||A_exact|| per layer on exact inputs; cosine = final embedding vs exact\n\n")
    emit(args, records, head + markdown_table(
        ["type_k", "type_v", "bits/value", "attn rel err", "max", "cos mean", "cos min"], rows,
        ["l", "l"] + ["r"] * 5))
    return 0


def attention_text(args) -> list[str]:
    """-f files, else the shipped held-out text."""
    return read_documents(args.file)


RUN = {"ppl": run_ppl, "kld": run_kld, "depth": run_depth, "niah": run_niah, "ruler": run_ruler,
       "sampling": run_sampling,
       "attention": run_attention}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    apply_threads(args)
    apply_batch(args)
    return RUN[args.what](args)


def apply_batch(args) -> None:
    """llama.cpp caps the physical batch by the logical one (n_ubatch = min(n_batch, n_ubatch))."""
    if args.ubatch_size < 1:
        raise ValueError(f"-ub must be at least 1, got {args.ubatch_size}")
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise ValueError(f"-b must be at least 1, got {args.batch_size}")
        args.ubatch_size = min(args.ubatch_size, args.batch_size)
