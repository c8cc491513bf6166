"""The package's layering, held by a test: the model maths, the store, the runtime and the speculative algorithm
never import `ray` (only the actors and the server's Ray path do), and no module grows past 500 lines. The few
that are past it today are listed with their length as a ceiling: they may shrink, never grow, and leave the list
once they are split."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "streamspec_ray")
RAY_ALLOWED = ("actors/", "serve.py")
MAX_LINES = 500
OVER = {"cli.py": 568, "speculative/drafts.py": 568, "store/ggml_int4.py": 521, "runtime/memlimit.py": 514}


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
