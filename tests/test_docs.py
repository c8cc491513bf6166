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


def test_relative_links_resolve():
    files = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    bad = []
    for path in files:
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            rel = target.split("#")[0]
            if not os.path.exists(os.path.join(os.path.dirname(path), rel)):
                bad.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not bad, bad
