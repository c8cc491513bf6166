"""The package's layering, held by a test: the model maths, the store, the runtime and the speculative algorithm
never import `ray` (only the actors and the server's Ray path do), no two modules import each other (directly or
round a longer loop), and no module grows past 500 lines. The few that are past it today are listed with their
length as a ceiling: they may shrink, never grow, and leave the list once they are split."""
from __future__ import annotations

import ast
import os

PACKAGE = "streamspec_ray"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)
RAY_ALLOWED = ("actors/", "serve.py")
MAX_LINES = 500
OVER: dict[str, int] = {}


def _modules():
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), path


def _imports(path: str) -> set[str]:
    """Every module named by an import anywhere in the file (function-level imports too)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def test_ray_is_imported_only_by_the_actors_and_the_server():
    wrong = [rel for rel, path in _modules() if not rel.startswith(RAY_ALLOWED)
             and any(m == "ray" or m.startswith("ray.") for m in _imports(path))]
    assert wrong == [], f"these import ray outside {RAY_ALLOWED}: {wrong}"


def test_no_module_grows_past_500_lines():
    lines = {rel: sum(1 for _ in open(path)) for rel, path in _modules()}
    over = {rel: n for rel, n in lines.items() if n > OVER.get(rel, MAX_LINES)}
    assert over == {}, f"split these before they grow further (ceilings: {MAX_LINES}, or OVER's): {over}"
    assert all(rel in lines for rel in OVER), "a module in OVER is gone: drop it from the list"


def _name(rel: str) -> str:
    """store/default.py -> streamspec_ray.store.default; a package's __init__.py -> the package."""
    parts = [PACKAGE] + rel[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in the file, relative imports resolved. `from P import x`
    imports the module P.x where there is one, else P itself (a name P defines)."""
    files = {_name(rel): (rel, path) for rel, path in _modules()}
    graph = {}
    for name, (rel, path) in files.items():
        package = (name if rel.endswith("__init__.py") else name.rpartition(".")[0]).split(".")
        out = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # (`from ..store import x` in a module of streamspec_ray/speculative: level 2)
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each set of two or more modules that all reach one another through imports (a strongly connected set)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            new = graph[todo.pop()] - seen
            seen |= new
            todo += new
        reach[start] = seen
    return sorted({tuple(sorted(m for m in reach[a] if a in reach[m])) for a in graph if a in reach[a]})


def test_no_import_cycles():
    graph = _graph()
    cycles = list(_cycles(graph))
    shown = "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & set(c)))}" for c in cycles for m in c)
    print(shown)
    assert cycles == [], f"these modules import one another (move what they share to a module both import, or " \
                         f"pass a callable in):\n{shown}"
