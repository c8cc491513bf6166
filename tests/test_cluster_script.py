"""cluster/local-two-nodes.sh as a user runs it: start two Ray nodes on this machine, run `streamspec generate
--ray` against them with RAY_ADDRESS (the store actor and the verifier land on different nodes, the tokens are
the in-process engine's), then stop, which must leave none of the script's processes running. And the embedded
case: `generate --ray` with no cluster leaves nothing in the home folder and no process behind. And
cluster/local-nodes.sh: its nodes carry the stage resource and the memory asked for, and stop ends them."""
from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("ray")

from streamspec_ray import Engine  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster", "local-two-nodes.sh")
PROMPT = [1, 5, 9, 33, 7, 12]


def _free_port_block() -> int:
    """A base port whose first few ports are free (the script uses base .. base+299)."""
    for _ in range(50):
        base = random.randrange(20000, 40000, 300)
        try:
            for p in (base, base + 1, base + 2, base + 12):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    pytest.skip("no free port block for a local Ray cluster")


def _ours(cluster_dir: str) -> list[int]:
    """PIDs of live processes whose command line mentions the script's temp dir."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if (cluster_dir + "/").encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_local_two_nodes_start_generate_stop(tiny):
    cluster_dir = tempfile.mkdtemp(prefix="ssc-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port_block()
    bindir = os.path.dirname(sys.executable)  # this environment's `ray` and `streamspec`
    env = dict(os.environ, STREAMSPEC_CLUSTER_DIR=cluster_dir, STREAMSPEC_RAY_PORT=str(port),
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""), RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    want = Engine(target=tiny["store"], draft="self-int4").generate(prompt_ids=PROMPT, max_new_tokens=12, k=4)
    try:
        started = subprocess.run([SCRIPT, "start"], env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stderr
        assert f"127.0.0.1:{port}" in started.stdout
        gen = subprocess.run([sys.executable, "-m", "streamspec_ray", "generate", "--prompt-ids",
                              ",".join(map(str, PROMPT)), "--target", tiny["store"], "--max-new-tokens", "12",
                              "--k", "4", "--ray", "--json"], env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                             capture_output=True, text=True, timeout=300)
        assert gen.returncode == 0, gen.stderr[-3000:]
        out = json.loads(gen.stdout)
        assert out["token_ids"] == want.token_ids
        where = out["ray"]["placement"]
        assert where["layer_store"] != where["verifier"], where  # streamspec_store vs streamspec_verifier
    finally:
        stopped = subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 10
    while _ours(cluster_dir) and time.monotonic() < deadline:  # killed processes may take a moment to go
        time.sleep(0.2)
    assert _ours(cluster_dir) == []
    shutil.rmtree(cluster_dir, ignore_errors=True)


def test_embedded_ray_leaves_nothing_behind(tiny, tmp_path):
    """`generate --ray` with no cluster and no RAY_* settings: Ray starts embedded, keeps token auth without
    writing ~/.ray/auth_token or warning about it, and leaves no process behind; the shards take the shared ring."""
    home, ray_tmp = tmp_path / "home", tempfile.mkdtemp(prefix="sse-", dir="/tmp")  # short: socket paths
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_TMPDIR=ray_tmp)
    want = Engine(target=tiny["store"], draft="self-int4").generate(prompt_ids=PROMPT, max_new_tokens=8, k=4)
    gen = subprocess.run([sys.executable, "-m", "streamspec_ray", "generate", "--prompt-ids", ",".join(map(str, PROMPT)),
                          "--target", tiny["store"], "--max-new-tokens", "8", "--k", "4", "--ray", "--json"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    out = json.loads(gen.stdout)
    assert out["token_ids"] == want.token_ids and out["ray"]["transport"] == "shared ring"
    assert "authentication" not in gen.stderr.lower(), gen.stderr[-3000:]
    assert list(home.iterdir()) == []
    deadline = time.monotonic() + 10
    while _ours(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ours(ray_tmp) == []
    shutil.rmtree(ray_tmp, ignore_errors=True)


NODES_SCRIPT = os.path.join(os.path.dirname(SCRIPT), "local-nodes.sh")
RESOURCES = """
import json, ray
ray.init(logging_level="ERROR", log_to_driver=False)
print(json.dumps(sorted((n["Resources"].get("memory"), n["Resources"].get("streamspec_stage"),
                         n["Resources"].get("streamspec_store")) for n in ray.nodes() if n["Alive"])))
"""


def test_local_nodes_start_resources_stop():
    """cluster/local-nodes.sh start 2 3 1.5: two stage nodes with those memory resources (the head also the store's),
    and stop leaves none of its processes. (`generate --ray --stages` itself: test_stages_cli.)"""
    cluster_dir = tempfile.mkdtemp(prefix="ssn-", dir="/tmp")
    port = _free_port_block()
    bindir = os.path.dirname(sys.executable)  # this environment's `ray`
    env = dict(os.environ, STREAMSPEC_CLUSTER_DIR=cluster_dir, STREAMSPEC_RAY_PORT=str(port),
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""), RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    try:
        started = subprocess.run([NODES_SCRIPT, "start", "2", "3", "1.5"], env=env, capture_output=True, text=True,
                                 timeout=180)
        assert started.returncode == 0, started.stderr
        assert f"127.0.0.1:{port}" in started.stdout
        got = subprocess.run([sys.executable, "-c", RESOURCES], env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                             capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr[-3000:]
        assert json.loads(got.stdout.strip().splitlines()[-1]) == [[1.5e9, 1.0, None], [3e9, 1.0, 1.0]]
    finally:
        stopped = subprocess.run([NODES_SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 10
    while _ours(cluster_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ours(cluster_dir) == []
    shutil.rmtree(cluster_dir, ignore_errors=True)
