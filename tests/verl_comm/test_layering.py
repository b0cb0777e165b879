"""verl_comm's runtime stands apart from its tools, and no import goes round in a circle.

The runtime is what a training job imports (kernels, compression, hooks, reducer, distributed,
nccl, telemetry, extras); the tools (:data:`TOOLS`) import the runtime, never the reverse.
Three checks, each of which fails on one wrong import:

- every runtime module imports in a subprocess whose meta-path refuses the tools;
- no runtime module names a tool in any import statement, lazy ones inside functions included
  (read from the source, so a branch the import check does not run is still covered);
- the module graph of verl_comm, and the graph of its folders, have no cycle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("verl_comm.bench", "verl_comm.profiler", "verl_comm.doctor", "verl_comm.cli")
"""The tool packages; every other module of verl_comm is runtime."""


def _modules() -> dict[str, Path]:
    """Every module of verl_comm (``kernels/`` installs as ``verl_comm.kernels``) -> its file."""
    out = {}
    for base, prefix in (
        (ROOT / "verl_comm", "verl_comm"),
        (ROOT / "kernels", "verl_comm.kernels"),
    ):
        for f in sorted(base.rglob("*.py")):
            parts = f.relative_to(base).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((prefix, *parts))] = f
    return out


MODULES = _modules()


def _is_tool(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLS)


def _imports(name: str, path: Path) -> set[str]:
    """The verl_comm modules that ``name`` imports anywhere in its source (a ``from package
    import submodule`` counts as the submodule)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


BLOCK_TOOLS = """
import importlib, importlib.abc, sys
TOOLS = {tools!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == t or name.startswith(t + ".") for t in TOOLS):
            raise ModuleNotFoundError(f"runtime imported the tool {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Block())
names = sys.argv[1:]
for n in names:
    importlib.import_module(n)
leaked = sorted(m for m in sys.modules if any(m == t or m.startswith(t + ".") for t in TOOLS))
assert not leaked, leaked
print("imported", len(names))
"""


@pytest.mark.timeout(300)
def test_the_runtime_imports_with_the_tools_unimportable():
    runtime = sorted(n for n in MODULES if not _is_tool(n))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", BLOCK_TOOLS.format(tools=TOOLS), *runtime],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == str(len(runtime))
    assert len(runtime) > 30  # the whole runtime, not a few modules


def test_no_runtime_module_names_a_tool_even_lazily():
    bad = {n: sorted(filter(_is_tool, GRAPH[n])) for n in MODULES if not _is_tool(n)}
    assert not {n: t for n, t in bad.items() if t}


def test_no_import_circle_between_modules_or_folders():
    assert (cycle := _cycle(GRAPH)) is None, " -> ".join(cycle)
    top = {n: n.split(".")[1] if "." in n else n for n in MODULES}
    folders: dict[str, set[str]] = {}
    for n, deps in GRAPH.items():
        folders.setdefault(top[n], set()).update(top[d] for d in deps if top[d] != top[n])
    assert (cycle := _cycle(folders)) is None, "folder loop " + " -> ".join(cycle)


def test_the_graph_sees_lazy_and_relative_imports_and_the_finder_sees_a_cycle():
    # the checks above pass on an empty result, so their tools must see what they look for
    assert "verl_comm.nccl.lint" in GRAPH["verl_comm.distributed.context"]  # in a function
    assert "verl_comm.hooks.graphs" in GRAPH["verl_comm.hooks._core"]  # from .graphs import
    assert "verl_comm.bench.report" in GRAPH["verl_comm.bench.plot"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
