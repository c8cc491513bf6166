"""Several OS processes feeding one ControllerActor: do their requests share sweeps, and is each output what it gets
alone? Starts an embedded Ray, a named controller over the embedded pair (RayEngine: store, verifier and draft
actors; chain, cost-model K), then N separate Python processes that attach by name (`RayEngine.attach`), wait for
each other, and generate at once. Prints the sweeps, the sequences they carried (from the controller's counters),
the per-process outputs against an in-process Engine alone, and the wall time. Every figure is measured.

    python benchmarks/bench_controller.py [--processes 2] [--tokens 48]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = ["Write a short poem about the sea.", "Explain what a CPU does.", "Name five fruits and their colors.",
           "Write a haiku about winter."]

ATTACHED = """
import json, os, sys, time
from streamspec_ray import RayEngine
eng = RayEngine.attach(sys.argv[1], address=sys.argv[2])
open(sys.argv[3] + ".ready", "w").close()
while not os.path.exists(sys.argv[4]):
    time.sleep(0.005)
out = eng.generate(prompt=sys.argv[5], max_new_tokens=int(sys.argv[6]), temperature=0.0)
print(json.dumps(out.token_ids))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--tokens", type=int, default=48)
    a = p.parse_args()

    import ray

    from streamspec_ray import Engine
    from streamspec_ray.actors import controller
    from streamspec_ray.actors.common import ensure_ray

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(a.processes)]
    ref = Engine(target=None, draft="self-int4")
    alone = [ref.generate(prompt=q, max_new_tokens=a.tokens, mode="chain").token_ids for q in prompts]
    ensure_ray()
    ctl = controller.start("bench-controller", mode="chain", batch_size=max(a.processes, 1))
    tmp = tempfile.mkdtemp()
    go = os.path.join(tmp, "go")
    procs = [subprocess.Popen([sys.executable, "-c", ATTACHED, "bench-controller",
                               ray.get_runtime_context().gcs_address, os.path.join(tmp, f"p{i}"), go, q,
                               str(a.tokens)], stdout=subprocess.PIPE, text=True, env=dict(os.environ))
             for i, q in enumerate(prompts)]
    try:
        while not all(os.path.exists(os.path.join(tmp, f"p{i}.ready")) for i in range(a.processes)):
            if any(pr.poll() is not None for pr in procs):
                raise SystemExit("an attached process died before generating")
            time.sleep(0.05)
        before = ray.get(ctl.stats.remote())
        t0 = time.perf_counter()
        open(go, "w").close()
        outs = [json.loads(pr.communicate()[0]) for pr in procs]
        wall = time.perf_counter() - t0
        after = ray.get(ctl.stats.remote())
    finally:
        ray.get(ctl.close.remote())
        ray.kill(ctl)
    sweeps = after["sweeps"] - before["sweeps"]
    seqs = after["sequences"] - before["sequences"]
    tokens = sum(len(o) for o in outs)
    print(f"{a.processes} processes attached to one controller: {tokens} tokens in {wall:.1f} s, {sweeps:.0f} sweeps "
          f"carrying {seqs:.0f} sequences ({seqs / sweeps:.2f} per sweep); each output identical to Engine alone: "
          f"{outs == alone}")
    return 0 if outs == alone else 1


if __name__ == "__main__":
    sys.exit(main())
