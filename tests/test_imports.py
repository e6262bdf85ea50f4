"""The package's import graph: layers that only import downward.

Every ``import`` in kvslim, read with ``ast``: the parts of the package (its subpackages
and top-level modules) form no cycle, counting imports inside functions too (a lazy import
is still a dependency); the modules within a part form none at load time (a module may
call back into its part lazily, as ``cache.model_cache`` and ``cache.io`` do); and only
the command line (``kvslim.tools``, ``kvslim.cli``, ``kvslim.__main__``) imports the
command line.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import kvslim

ROOT = Path(kvslim.__file__).resolve().parent
COMMAND_LINE = ("kvslim.tools", "kvslim.cli", "kvslim.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imported(node: ast.ImportFrom, package: str) -> list[str]:
    """The kvslim modules an ImportFrom names: its module, or each name that is a module itself."""
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return subs or [target]


def import_nodes(tree: ast.Module, lazy: bool):
    """Import statements of a module: all of them, or (``lazy=False``) those outside functions."""
    if lazy:
        return ast.walk(tree)
    todo, out = list(tree.body), []
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def imports_of(name: str, lazy: bool = True) -> set[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in import_nodes(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.ImportFrom):
            out.update(imported(node, package))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("kvslim.") and m != name}


@functools.cache
def graph(lazy: bool = True) -> dict[str, set[str]]:
    """Each module's kvslim imports (``lazy``: counting those inside functions), built when a
    test first asks rather than at collection, which every xdist worker repeats."""
    return {name: imports_of(name, lazy) for name in MODULES}


def part(name: str) -> str:
    """The part of the package a module belongs to: kvslim.plan.fit -> kvslim.plan."""
    return ".".join(name.split(".")[:2])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None (depth-first search)."""
    state: dict[str, int] = {}                                     # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_relative_and_lazy_imports():
    assert "kvslim.formats" in graph()["kvslim.cache.kv"]                  # from .. import formats
    assert "kvslim.gguf.reader" in graph()["kvslim.loading"]               # inside a function
    assert "kvslim.plan.fit" in graph()["kvslim.plan.report"]              # from .fit import ...
    assert "kvslim.gguf.reader" not in graph(lazy=False)["kvslim.loading"]


def test_the_parts_of_the_package_form_no_cycle():
    parts: dict[str, set[str]] = {}
    for name, targets in graph().items():
        if name != "kvslim":                                       # the root re-exports kvslim.load
            parts.setdefault(part(name), set()).update(part(t) for t in targets if part(t) != part(name))
    assert find_cycle(parts) is None


def test_modules_within_each_part_form_no_cycle_at_load_time():
    for prefix in {part(name) for name in graph(lazy=False)}:
        inner = {n: {t for t in ts if part(t) == prefix} for n, ts in graph(lazy=False).items() if part(n) == prefix}
        assert find_cycle(inner) is None, prefix


def test_only_the_command_line_imports_the_command_line():
    upward = sorted((name, t) for name, targets in graph().items() for t in targets
                    if t.startswith(COMMAND_LINE) and not name.startswith(COMMAND_LINE))
    assert upward == []


def test_the_command_line_starts_without_torchs_compiler():
    """``kvslim`` imports no torch._dynamo until something compiles: about half a second of
    every command's start (and of every test's child process)."""
    import subprocess
    import sys
    code = ("import sys, kvslim.cli, kvslim.loading, kvslim.server; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_traced_as_constant_marks_a_function_as_dynamo_does():
    """``native.build.traced_as_constant`` stands for torch._dynamo.assume_constant_result."""
    import torch._dynamo

    from kvslim.native.build import traced_as_constant

    def ours():
        return True

    def torchs():
        return True
    assert vars(traced_as_constant(ours)) == vars(torch._dynamo.assume_constant_result(torchs)) != {}
