"""The README's commands run as written on a fresh setup.

Every `streamspec ...` line of the README's bash blocks is either run here, as written, in an empty folder with a
fresh STREAMSPEC_HOME, and must exit 0, or listed in SLOW with the reason it is not (minutes of work, a cluster,
a placeholder path). A new command in the README must be classified here, so none can go stale unnoticed."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")

# commands not run here, each with why (a prefix of the command is enough)
SLOW = {  # (keys in shlex.join's spelling: "Hello" is Hello, "a b" is 'a b')
    "streamspec generate 'Write a haiku": "64 tokens; the headline command covers the same path",
    "streamspec generate Hello --mode": "more modes of the headline command: covered by test_cli and test_tree",
    "streamspec generate Hello --k 8": "cold reads of every sweep: covered by test_cli and test_executor",
    "streamspec generate Hello --temperature": "sampling: covered by test_rejection and test_cli",
    "streamspec generate 'The three primary colors are' --target gemma3-270m": "converts Gemma 3 on first use (a "
    "minute): test_gemma_real converts it the same way (resolve_store) and generates from it",
    "streamspec convert path/to/": "a placeholder path",
    "streamspec generate ...": "placeholder paths",
    "streamspec generate 'Write a Python function": "the 1.5B real pair: minutes (test_real_pair runs it)",
    "streamspec convert qwen2.5-coder-1.5b": "converts the 1.5B: minutes (test_real_pair runs it)",
    "streamspec batch prompts.jsonl": "needs the user's prompts file (test_batch runs batch jobs)",
    "streamspec bench": "minutes of measuring (test_bench runs a small bench)",
    "streamspec serve --port": "a server runs until stopped (test_serve runs one)",
    "streamspec serve --ray": "a server runs until stopped (test_ray runs the controller)",
    "RAY_ADDRESS=": "needs the two-node cluster script (test_cluster_script runs exactly this)",
    "streamspec generate 'The capital of France is' --ray --stages 2": "Ray and two stage processes: "
    "test_stages_cli runs it against the in-process tokens",
}


def readme_commands() -> list[str]:
    """The `streamspec` commands of the README's bash blocks, continuation lines joined, comments dropped."""
    with open(README) as f:
        text = f.read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and ("streamspec" in words[:2] or words[0].startswith("RAY_ADDRESS=")) and \
                    not words[0].startswith(("pip", "python", "cluster/")):
                out.append(shlex.join(words))
    return out


def _slow(cmd: str) -> str | None:
    return next((why for prefix, why in SLOW.items() if cmd.startswith(prefix)), None)


def test_every_readme_command_is_classified():
    cmds = readme_commands()
    assert any(c.startswith("streamspec plan") for c in cmds) and 'streamspec generate Hello' in cmds
    fast = [c for c in cmds if _slow(c) is None]
    assert fast, cmds


FAST = [c for c in readme_commands() if _slow(c) is None]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    (root / "home").mkdir()
    (root / "cwd").mkdir()
    return root


@pytest.mark.parametrize("cmd", FAST)
def test_readme_command_runs_as_written(cmd, fresh):
    env = dict(os.environ, STREAMSPEC_HOME=str(fresh / "home"), TOKENIZERS_PARALLELISM="false")
    words = shlex.split(cmd)
    assert words[0] == "streamspec"
    r = subprocess.run([sys.executable, "-m", "streamspec_ray", *words[1:]], cwd=fresh / "cwd", env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    if cmd == "streamspec generate Hello":  # the headline: a chat answer from the embedded model
        assert r.stdout.strip(), r.stderr[-2000:]
        assert "start-up" in r.stderr
