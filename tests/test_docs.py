"""docs/: the CLI reference agrees with the parser, and every relative link in README.md and docs/ resolves."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

from streamspec_ray import clidoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_md_is_the_parser_rendered():
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        assert f.read() == clidoc.render(), "regenerate: python -m streamspec_ray.clidoc > docs/cli.md"


def test_cli_md_matches_streamspec_help():
    env = dict(os.environ, COLUMNS=str(clidoc.WIDTH + 2))  # argparse wraps at COLUMNS - 2
    doc = open(os.path.join(ROOT, "docs", "cli.md")).read()
    for cmd in ([], ["generate"], ["bench"]):
        out = subprocess.run([sys.executable, "-m", "streamspec_ray", *cmd, "--help"], env=env,
                             capture_output=True, text=True, check=True).stdout.rstrip()
        assert out in doc, cmd


def slugs(path: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading numbered -1, -2, ..."""
    text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_resolve():
    """Every relative link names a file that exists and, with a #fragment, a heading that file has."""
    files = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    bad = []
    for path in files:
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            rel, _, frag = target.partition("#")
            dest = os.path.join(os.path.dirname(path), rel) if rel else path
            if not os.path.exists(dest):
                bad.append(f"{os.path.relpath(path, ROOT)}: {target}")
            elif frag and dest.endswith(".md") and frag not in slugs(dest):
                bad.append(f"{os.path.relpath(path, ROOT)}: {target} (no such heading)")
    assert not bad, bad
