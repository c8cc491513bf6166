"""`--stages` / `--split` on the command line: `streamspec generate --ray --stages 2` as a real subprocess on the
embedded SmolLM2 (two StageActors on an embedded Ray) gives the in-process engine's tokens and keeps the stage
figures in --json; the flags without --ray, or a bad split, are one error line before anything loads."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from streamspec_ray import cli

PROMPT = "The capital of France is"
N = 12


def _ours(folder: str) -> list[int]:
    """PIDs of live processes whose command line mentions `folder` (Ray's processes under its temp dir)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if (folder + "/").encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_generate_ray_stages_subprocess(smol_store, smol_home, smol_engine):
    pytest.importorskip("ray")
    ray_tmp = tempfile.mkdtemp(prefix="sss-", dir="/tmp")  # short: Ray's unix socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # an embedded Ray, never someone's cluster
    env.update(STREAMSPEC_HOME=smol_home, TOKENIZERS_PARALLELISM="false", RAY_TMPDIR=ray_tmp,
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    want = smol_engine.generate(PROMPT, max_new_tokens=N)
    try:
        r = subprocess.run([sys.executable, "-m", "streamspec_ray", "generate", PROMPT, "--target", smol_store,
                            "--ray", "--stages", "2", "--max-new-tokens", str(N), "--json"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
        assert len(lines) == 1, r.stdout
        out = json.loads(lines[0])
        assert out["token_ids"] == want.token_ids and out["text"] == want.text
        st = out["ray"]["stages"]
        assert st["stages"] == 2 and len(st["last_sweep"]) == 2
        assert st["sweeps"] == out["sweeps"] and st["hops"] == st["sweeps"]  # one hop per sweep between 2 stages
        assert st["hidden_bytes"] > 0 and [s["stage"] for s in st["last_sweep"]] == [0, 1]
        assert set(out["ray"]["revivals"]) == {"layer store", "stage 0", "stage 1", "draft"}
        assert out["ray"]["transport"] == "local store"
        deadline = time.monotonic() + 15  # the stage actors end with the command
        while _ours(ray_tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours(ray_tmp) == []
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


ERRORS = {
    # name: (args, text in the one error line); all refused before any store is opened or Ray started
    "generate-stages-no-ray": (["generate", PROMPT, "--stages", "2"], "--stages needs --ray"),
    "generate-split-no-ray": (["generate", PROMPT, "--split", "0:10,10:30"], "--split needs --ray"),
    "generate-split-overlap": (["generate", PROMPT, "--ray", "--split", "0:5,4:30"], "0:5, 4:30"),
    "generate-split-syntax": (["generate", PROMPT, "--ray", "--split", "0:5,5"], "START:END"),
    "generate-stages-0": (["generate", PROMPT, "--ray", "--stages", "0"], "positive"),
    "generate-stages-vs-split": (["generate", PROMPT, "--ray", "--stages", "3", "--split", "0:10,10:30"],
                                 "2 ranges"),
    "batch-stages-no-ray": (["batch", "in.jsonl", "out.jsonl", "--stages", "2"], "--stages needs --ray"),
    "serve-split-no-ray": (["serve", "--split", "0:10,10:30"], "--split needs --ray"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_stage_flag_errors(name, capsys, tmp_path, monkeypatch):
    args, text = ERRORS[name]
    monkeypatch.chdir(tmp_path)  # (batch: nothing is created)
    monkeypatch.setenv("STREAMSPEC_HOME", str(tmp_path / "home"))  # nothing is converted either
    capsys.readouterr()
    try:
        rc = cli.main(args)
    except SystemExit as e:  # argparse's errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc not in (0, None) and out == ""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], lines
    assert os.listdir(tmp_path) == []
