"""RULER-style long-context tasks, built in token space on held-out text, scored per K/V pair.

The tasks follow NVIDIA's RULER (Hsieh et al., 2024), sized for a tiny model:

==================  ============================================================================
niah_single         one pass key (training's canonical phrasing) at each depth; one haystack per depth
niah_multikey       one "special magic number" needle per depth, each with its own key; every key is
                    asked in turn, the others are its distractors
niah_multivalue     one key with one value per depth ("One of the special magic numbers for ..."); the
                    question asks for all of them
niah_multiquery     the question asks for the numbers of all multikey keys at once
kv_retrieval        key-value facts with two-word keys every ~96 tokens; one key per depth is asked
vt                  variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... and a distractor
                    chain spread evenly over the text; name every variable holding the value
cwe                 common words extraction: a numbered word list in which 3 words occur 10x as often
                    as the others; name the 3
==================  ============================================================================

The four ``niah_*`` tasks' multi-needle questions share one haystack (the needles of
multikey/multiquery and the values of multivalue at the same depths), so each
(length, sample) costs one prefill for them. All haystacks of one (length,
sample) cut their filler from the same window of the held-out token stream, so
they share a prefix up to their first needle; :func:`run` asks the queries in
lexicographic token order through an engine with prefix caching, so that each
prompt reads only the tokens after its common prefix with the previous one.

Scoring (RULER's string match, on greedy output): a single-answer question passes
when the generated text starts with the answer number and no digit follows
(as ``kvslim eval niah``); a multi-answer question scores each expected item
found in the output (RULER's partial match, ``string_match_all``), and each
item counts toward the depth cell where it sits. Greedy generation rather than
teacher forcing keeps the measure what a user gets, and with the prefix cache
its cost is a few decode steps per question.
"""
from __future__ import annotations

import dataclasses
import math
import random
import re
from typing import Callable, Sequence

import numpy as np

from ..tables import markdown_table
from . import needle
from .haystack import TokenSpace

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "kv_retrieval", "vt", "cwe")
DEPTH_FREE = ("vt", "cwe")          # spread over the whole text: one column, no depth
DEFAULT_DEPTHS = (0.0, 0.5, 1.0)
MULTIVALUE_NEEDLE = "One of the special magic numbers for {w} is: {n}."
KV_SPACING = 96                     # kv_retrieval: one fact per this many tokens of text
VT_HOPS = 4
CWE_COMMON, CWE_RATIO = 3, 10

__all__ = ["TASKS", "DEFAULT_DEPTHS", "Query", "RulerBuilder", "default_lengths", "check_tasks", "score_output",
           "run", "summary", "render", "plot_heatmaps"]


@dataclasses.dataclass
class Query:
    """One prompt and what its greedy continuation must contain.

    ``answers[i]`` counts toward the cell ``(task, length, depths[i])`` (depth None: a
    depth-free task) and its needle starts at token ``positions[i]`` of the prompt (None
    for cwe). ``single`` questions need the output to start with the one answer; the
    others score each answer found anywhere in the output. Prompt plus ``max_tokens``
    is exactly ``length``.
    """

    task: str
    length: int
    sample: int
    prompt: list[int]
    answers: list[str]
    depths: list[float | None]
    positions: list[int | None]
    max_tokens: int
    single: bool = False


def default_lengths(n_ctx: int) -> list[int]:
    """Just ``n_ctx``: what a 2-core run can afford; ``--lengths`` sweeps (1K-64K and beyond)."""
    return [n_ctx]


def check_tasks(names: Sequence[str]) -> list[str]:
    """Validated task names (``all`` expands to every task)."""
    if list(names) == ["all"]:
        return list(TASKS)
    bad = [n for n in names if n not in TASKS]
    if bad or not names:
        raise ValueError(f"unknown ruler task(s) {', '.join(bad) or '(none)'}; expected some of {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def _numbers(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct 5-digit numbers (distinct so that no distractor answers a question).

    RULER's magic numbers have 7 digits; the bundled model copies the pass key's 5 reliably
    and stops after 5 digits of a longer number, which would measure its habit, not the cache."""
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen[str(rng.randrange(10_000, 100_000))] = None
    return list(seen)


def _var_names(rng: random.Random, count: int) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))] = None
    return list(seen)


class RulerBuilder:
    """Builds every task's queries for one tokenizer and one filler token stream.

    Args:
        space: the tokenizer's :class:`TokenSpace`.
        stream: held-out text as token ids (documents joined by a blank line).
        decode: token ids -> text (for the word pool of ``cwe``).
        bos: tokens every prompt starts with (the tokenizer's BOS, or none).
    """

    def __init__(self, space: TokenSpace, stream: Sequence[int], decode: Callable[[list[int]], str],
                 bos: Sequence[int] = ()):
        if len(stream) < 64:
            raise ValueError(f"the filler text has {len(stream)} tokens; ruler needs at least 64")
        self.space, self.stream, self.bos = space, np.asarray(stream, dtype=np.int64), list(bos)
        pool = (decode([i]) for i in range(len(space.sentence_end)))
        self.words = sorted({w[1:] for w in pool if re.fullmatch(r" [a-z]{4,}", w)})
        if len(self.words) < 2 * CWE_COMMON:
            raise ValueError("the tokenizer has too few single-token lowercase words for the cwe task")

    # ----- shared pieces ----------------------------------------------------------
    def window(self, rng: random.Random, n: int) -> np.ndarray:
        """``n`` consecutive filler tokens from a random start (wrapping around the stream)."""
        start = rng.randrange(len(self.stream))
        return np.take(self.stream, np.arange(start, start + n), mode="wrap")

    def haystack(self, window: np.ndarray, body: int, sentences: Sequence[str],
                 depths: Sequence[float]) -> tuple[list[int], list[int]]:
        """Exactly ``body`` tokens: the window's first tokens with ``sentences`` at ``depths``.

        Cuts are found on the filler length that leaves room for the widest form of every
        sentence (with or without a leading space); the filler's tail then takes what the
        sentences did not use, so the length is exact and each cut stays where it was.
        """
        widest = sum(max(len(self.space.encode(s)), len(self.space.encode(" " + s))) for s in sentences)
        short = body - widest
        if short < 1 or body > len(window):
            raise ValueError(f"a length of {body} tokens cannot hold the task's needles ({widest} tokens)")
        cuts = [self.space.cut_at(window[:short], d) for d in depths]
        used = sum(map(len, self.space.pieces(window, cuts, sentences, spaced=True)))
        return self.space.insert(window[:body - used], sentences, depths, cuts, spaced=True)

    def prompts(self, window, length: int, room: int, sentences, depths,
                questions: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """One haystack, asked each of ``questions``: BOS + haystack + question per question,
        the longest being ``length - room`` tokens; and the needles' first-token positions."""
        asked = [self.space.encode("\n\n" + q) for q in questions]
        body = length - room - len(self.bos) - max(map(len, asked))
        ids, starts = self.haystack(window, body, sentences, depths)
        return [self.bos + ids + q for q in asked], [s + len(self.bos) for s in starts]

    def answer_room(self, answers: Sequence[str]) -> int:
        """Tokens to generate: the answers with a separator each, and one more to see where they end."""
        return sum(len(self.space.encode(" " + a)) + 1 for a in answers) + 1

    # ----- tasks --------------------------------------------------------------------
    def build(self, tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float], samples: int,
              seed: int = 0) -> list[Query]:
        """Every query of the grid; the tasks of one (length, sample) cut one filler window."""
        for d in depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"depths must lie in [0, 1], got {d}")
        if not depths or len(depths) > len(needle.WORDS) - 1:
            raise ValueError(f"give between 1 and {len(needle.WORDS) - 1} depths")
        queries = []
        for length in lengths:
            for i in range(samples):
                base = f"kvslim-ruler:{seed}:{length}:{i}"
                window = self.window(random.Random(base + ":filler"), length)
                multi = None
                for task in tasks:
                    if task.startswith("niah_multi"):     # one haystack and one draw for the three
                        multi = multi or self.niah_multi(random.Random(base + ":multi"), window, length, depths, i)
                        queries += multi[task]
                    else:
                        queries += getattr(self, task)(random.Random(f"{base}:{task}"), window, length, depths, i)
        return queries

    def _query(self, task, length, i, prompt, answers, depths, positions, single=False) -> Query:
        return Query(task, length, i, prompt, list(answers), list(depths), list(positions), length - len(prompt),
                     single)

    def niah_single(self, rng, window, length, depths, i) -> list[Query]:
        out = []
        for d in depths:
            sentences, _, question, answer = needle.make_needle(rng, needle.CANONICAL_KIND, canonical=True)
            (ids,), starts = self.prompts(window, length, self.answer_room([answer]), sentences, [d], [question])
            out.append(self._query("niah_single", length, i, ids, [answer.strip()], [d], starts, True))
        return out

    def niah_multi(self, rng, window, length, depths, i) -> dict[str, list[Query]]:
        """niah_multikey, niah_multivalue and niah_multiquery: questions about one haystack.

        At each depth sit a multikey needle (its own key) and a value of the multivalue key;
        with fewer than 4 depths, more keys go to random depths as distractors.
        """
        words = rng.sample(needle.WORDS, max(4, len(depths)) + 1)
        keys, value_key = words[:-1], words[-1]
        numbers = _numbers(rng, len(keys) + len(depths))
        values, numbers = numbers[len(keys):], numbers[:len(keys)]
        sentences = [needle.MAGIC_NEEDLE.format(w=w, n=n) for w, n in zip(keys, numbers)]
        sentences += [MULTIVALUE_NEEDLE.format(w=value_key, n=n) for n in values]
        where = list(depths) + [rng.random() for _ in keys[len(depths):]] + list(depths)
        order = rng.sample(range(len(depths)), len(depths))
        listed = [keys[j] for j in order]
        listed = ", ".join(listed[:-1]) + " and " + listed[-1] if len(listed) > 1 else listed[0]
        questions = [needle.MAGIC_QUESTION.format(w=k) for k in keys[:len(depths)]] + [
            f"What are all the special magic numbers for {value_key}? The special magic numbers for {value_key} are:",
            f"What are the special magic numbers for {listed}? The special magic numbers for {listed} are:"]
        room = self.answer_room(numbers[:len(depths)])
        ids, starts = self.prompts(window, length, room, sentences, where, questions)
        n = len(depths)
        multikey = [self._query("niah_multikey", length, i, ids[j], [numbers[j]], [depths[j]], [starts[j]], True)
                    for j in range(n)]
        multivalue = self._query("niah_multivalue", length, i, ids[n], values, depths, starts[len(keys):])
        multiquery = self._query("niah_multiquery", length, i, ids[n + 1], [numbers[j] for j in order],
                                 [depths[j] for j in order], [starts[j] for j in order])
        return {"niah_multikey": multikey, "niah_multivalue": [multivalue], "niah_multiquery": [multiquery]}

    def kv_retrieval(self, rng, window, length, depths, i) -> list[Query]:
        pool = [f"{a}-{b}" for a in needle.WORDS for b in needle.WORDS if a != b]
        count = min(len(pool), max(len(depths) + 1, length // KV_SPACING))   # 3,080 keys: sparser past ~300K
        keys = rng.sample(pool, count)
        numbers = _numbers(rng, count)
        sentences = [needle.MAGIC_NEEDLE.format(w=k, n=n) for k, n in zip(keys, numbers)]
        others = count - len(depths)
        where = list(depths) + [(j + 0.5) / others for j in range(others)]
        questions = [needle.MAGIC_QUESTION.format(w=k) for k in keys[:len(depths)]]
        ids, starts = self.prompts(window, length, self.answer_room(numbers[:len(depths)]), sentences, where,
                                   questions)
        return [self._query("kv_retrieval", length, i, ids[j], [numbers[j]], [d], [starts[j]], True)
                for j, d in enumerate(depths)]

    def vt(self, rng, window, length, depths, i) -> list[Query]:
        names = _var_names(rng, 2 * (VT_HOPS + 1))
        value, other = _numbers(rng, 2)
        chains = [names[:VT_HOPS + 1], names[VT_HOPS + 1:]]
        sentences = []
        for chain, v in zip(chains, (value, other)):
            sentences += [f"VAR {chain[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        # the two chains interleave, hop by hop, at evenly spaced depths
        where = [(2 * h + c + 0.5) / len(sentences) for c in range(2) for h in range(VT_HOPS + 1)]
        question = (f"Find all variables that are assigned the value {value} in the text above. According to the "
                    f"chain of variable assignment in the text above, {VT_HOPS + 1} variables are assigned the "
                    f"value {value}, they are:")
        room = self.answer_room([f"VAR {n}" for n in chains[0]])
        (ids,), starts = self.prompts(window, length, room, sentences, where, [question])
        return [self._query("vt", length, i, ids, chains[0], [None] * len(chains[0]), starts[:VT_HOPS + 1])]

    def cwe(self, rng, window, length, depths, i) -> list[Query]:
        common = rng.sample(self.words, CWE_COMMON)
        question = (f"What are the {CWE_COMMON} most common words in the above list? The top {CWE_COMMON} "
                    f"words that appear most often in the list are:")
        head = self.space.encode("Below is a numbered list of words. In these words, some appear more often than "
                                 "others. Memorize the ones that appear most often.\n")
        asked = self.space.encode("\n\n" + question)
        body = length - self.answer_room(common) - len(self.bos) - len(head) - len(asked)
        ids: list[int] = []
        for k, word in enumerate(self._cwe_items(rng, common, body)):
            piece = self.space.encode(f" {k + 1}. {word}" if k else f"1. {word}")
            if len(ids) + len(piece) > body:
                break
            ids += piece
        ids += self.space.encode("\n") * (body - len(ids))      # the list stops short: pad to the exact length
        prompt = self.bos + head + ids + asked
        return [self._query("cwe", length, i, prompt, common, [None] * CWE_COMMON, [None] * CWE_COMMON)]

    def _cwe_items(self, rng, common: list[str], body: int) -> list[str]:
        """Words in random order, each common word CWE_RATIO times as often as any other."""
        n_items = body // 3 + 1                       # an item " 12. word" is at least 3 tokens
        others = [w for w in self.words if w not in common]
        per_other = max(1, math.ceil(n_items / (len(others) + CWE_RATIO * CWE_COMMON)))
        per_common = CWE_RATIO * per_other
        n_others = max(1, (n_items - per_common * CWE_COMMON) // per_other)
        items = common * per_common + rng.sample(others, min(len(others), n_others)) * per_other
        rng.shuffle(items)
        return items


# ----- scoring -------------------------------------------------------------------------
def score_output(query: Query, text: str) -> list[bool]:
    """Per expected answer: found in the greedy output ``text`` (see the module docstring)."""
    if query.single:
        head = text.lstrip()
        digits = re.match(r"\d*", head).group(0)
        return [digits == query.answers[0]]
    if query.task == "cwe" or query.task == "vt":
        words = set(re.findall(r"[A-Za-z]+", text))
        return [a in words for a in query.answers]
    found = set(re.findall(r"\d+", text))
    return [a in found for a in query.answers]


def run(llm, queries: Sequence[Query], progress: Callable[[int], None] | None = None) -> list[dict]:
    """Greedy answers of ``llm`` (its cache types) to every query, in lexicographic token order
    so that consecutive prompts share the longest prefixes; one record per query, in input order."""
    records: list[dict | None] = [None] * len(queries)
    for j in sorted(range(len(queries)), key=lambda j: queries[j].prompt):
        q = queries[j]
        out = llm.generate(q.prompt, q.max_tokens, temperature=0.0)
        records[j] = {"task": q.task, "length": q.length, "sample": q.sample, "depths": q.depths,
                      "answers": q.answers, "output": out.text, "hits": score_output(q, out.text)}
        if progress:
            progress(1)
    return records


def summary(records: Sequence[dict], depths: Sequence[float]) -> dict:
    """``{task: {"lengths", "depths", "score" (rows = lengths, cols = depths or one), "overall"}}``."""
    cells: dict = {}
    for r in records:
        for d, hit in zip(r["depths"], r["hits"]):
            cells.setdefault(r["task"], {}).setdefault((r["length"], d), []).append(hit)
    out = {}
    for task in [t for t in TASKS if t in cells]:
        lengths = sorted({length for length, _ in cells[task]})
        cols = [None] if task in DEPTH_FREE else list(depths)
        score = [[_mean(cells[task].get((n, d), [])) for d in cols] for n in lengths]
        hits = [h for v in cells[task].values() for h in v]
        out[task] = {"lengths": lengths, "depths": cols, "score": score, "overall": _mean(hits), "items": len(hits)}
    return out


def _mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def render(results: Sequence[dict], depths: Sequence[float]) -> str:
    """Markdown: a task x pair summary, then per pair a (task, length) x depth table."""
    tasks = [t for t in TASKS if any(t in r["tasks"] for r in results)]
    rows = [[f"{r['type_k']}/{r['type_v']}"] + [_pct(r["tasks"][t]["overall"]) for t in tasks]
            + [_pct(_mean([r["tasks"][t]["overall"] for t in tasks])), f"{r.get('seconds', 0):.1f}"] for r in results]
    parts = [markdown_table(["K/V"] + tasks + ["avg", "time (s)"], rows, ["l"] + ["r"] * (len(tasks) + 2)), ""]
    for r in results:
        parts += [f"### K {r['type_k']} / V {r['type_v']}", ""]
        rows = []
        for t in tasks:
            g = r["tasks"][t]
            for n, row in zip(g["lengths"], g["score"]):
                cells = [_pct(row[0]) if t in DEPTH_FREE and k == 0 else ("" if t in DEPTH_FREE else _pct(row[k]))
                         for k in range(len(depths))]
                rows.append([t, str(n)] + cells + [_pct(_mean([x for x in row if x == x]))])
        parts += [markdown_table(["task", "context"] + [f"depth {d:.2f}" for d in depths] + ["all"], rows,
                                 ["l"] + ["r"] * (len(depths) + 2)), ""]
    return "\n".join(parts).rstrip()


def plot_heatmaps(results: Sequence[dict], path, title: str = "") -> None:
    """One heatmap per task (rows) and K/V pair (columns): score by context length x depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(t in r["tasks"] for r in results)]
    fig, axes = plt.subplots(len(tasks), len(results), figsize=(1.5 + 3.2 * len(results), 0.6 + 2.3 * len(tasks)),
                             squeeze=False, layout="constrained")
    image = None
    for i, task in enumerate(tasks):
        for j, r in enumerate(results):
            g, ax = r["tasks"][task], axes[i][j]
            data = [[100 * x for x in row] for row in g["score"]]
            image = ax.imshow(data, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(g["depths"])), ["all" if d is None else f"{d:.2f}" for d in g["depths"]])
            ax.set_yticks(range(len(g["lengths"])), [str(n) for n in g["lengths"]])
            for y, row in enumerate(data):
                for x, v in enumerate(row):
                    ax.text(x, y, "-" if v != v else f"{v:.0f}", ha="center", va="center", fontsize=8)
            ax.set_title(f"{task} {r['type_k']}/{r['type_v']}: {_pct(g['overall'])}", fontsize=9)
            if j == 0:
                ax.set_ylabel("context (tokens)")
            if i == len(tasks) - 1:
                ax.set_xlabel("depth")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="score (%)", shrink=0.6)
    fig.suptitle(title or "RULER-style tasks by context length and depth")
    fig.savefig(path, dpi=110)
    plt.close(fig)
