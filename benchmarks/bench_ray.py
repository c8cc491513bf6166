"""Per-sweep time, RayEngine vs the in-process Engine, on the same store and the same chunks.

Each run prefills a prompt, then sweeps a chunk of K+1 tokens (one speculative round's verification) `--sweeps`
times, rolling the cache back after each, exactly as rejected drafts are. Reported: the median over all
measured sweeps of all runs (the first run is a warm-up and not counted). RayEngine's sweep time is the
driver's round trip; the verifier's own wall, stall and the store's read time are shown beside it. RayEngine
runs twice: shards through a shared-memory ring (the default where store and verifier share a node) and
through Ray's object store (the path across nodes, here forced with shared_ring=False).

    python benchmarks/bench_ray.py               # warm page cache
    python benchmarks/bench_ray.py --cold        # every shard read from disk (posix_fadvise DONTNEED)
    python benchmarks/bench_ray.py --direct      # every shard read from disk with O_DIRECT (no page-cache copy)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_worker_niceness", "0")  # actors at normal priority, as in the engine
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def measure(eng, prompt: list[int], chunk: list[int], sweeps: int, runs: int) -> dict:
    ex = eng.executor
    walls, inner, stall, io, read = [], [], [], [], []
    for run in range(runs + 1):
        cache = ex.new_cache()
        ex.sweep(prompt, cache, logits_from=len(prompt) - 1)
        base = cache.length
        for _ in range(sweeps):
            t0 = time.perf_counter()
            _, st = ex.sweep(chunk, cache, logits_from=0)
            wall = time.perf_counter() - t0
            cache.truncate(base)
            if run == 0:
                continue  # warm-up run
            walls.append(wall)
            inner.append(st.compute_s + st.stall_s)  # the sweep's own wall, measured where it ran
            stall.append(st.stall_s)
            io.append(st.io_s)
            read.append(st.bytes_read)
    med = statistics.median
    return {"sweep_ms": med(walls) * 1e3, "min_ms": min(walls) * 1e3, "max_ms": max(walls) * 1e3,
            "inner_ms": med(inner) * 1e3, "stall_ms": med(stall) * 1e3, "io_ms": med(io) * 1e3,
            "mb_per_sweep": med(read) / 1e6, "gb_per_s": med(read) / med(walls) / 1e9, "n": len(walls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="store (default: the embedded SmolLM2-135M fp32 store)")
    p.add_argument("--cold", action="store_true", help="evict each shard from the page cache before reading it")
    p.add_argument("--direct", action="store_true", help="read shards with O_DIRECT (both engines)")
    p.add_argument("--runs", type=int, default=3, help="measured runs (plus one warm-up)")
    p.add_argument("--sweeps", type=int, default=5, help="sweeps per run")
    p.add_argument("--k", type=int, default=4, help="chunk = K+1 tokens, as one chain round verifies")
    p.add_argument("--prefetch-depth", type=int, default=2, help="units read ahead (and read at once), both engines")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    import torch

    from streamspec_ray import Engine, RayEngine

    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 1690, 282]  # 12 tokens
    chunk = [28, 1, 504, 3458, 282, 4649, 314, 253][: a.k + 1]
    rows = {}
    reads = dict(cold=a.cold, direct=a.direct, prefetch_depth=a.prefetch_depth)  # the same for both engines
    eng = Engine(target=a.target, draft=None, **reads)
    vocab = eng.args.vocab_size
    prompt, chunk = [t % vocab for t in prompt], [t % vocab for t in chunk]
    rows["Engine (in-process)"] = measure(eng, prompt, chunk, a.sweeps, a.runs)
    del eng
    for shared in (True, False):
        with RayEngine(target=a.target, draft=None, shared_ring=shared, **reads) as reng:
            via = reng.transport()  # what it really used, not what was asked for
            rows[f"RayEngine (3 actors, 1 node, {via})"] = measure(reng, prompt, chunk, a.sweeps, a.runs)
            where = reng.placement()
    info = {**reads, "k": a.k, "chunk_tokens": len(chunk), "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "placement_nodes": len(set(where.values())), "rows": rows}
    if a.json:
        print(json.dumps(info))
        return
    how = "O_DIRECT reads" if a.direct else "cold (page cache dropped per shard)" if a.cold else "warm page cache"
    print(f"per-sweep time, {how}, "
          f"chunk of {len(chunk)} tokens, median of {a.runs} runs x {a.sweeps} sweeps, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, prefetch depth {a.prefetch_depth}")
    print("| engine | sweep ms (median) | min | max | in-actor sweep ms | stall ms | read ms (disk busy) | MB/sweep "
          "| GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['sweep_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | {r['inner_ms']:.1f} | "
              f"{r['stall_ms']:.1f} | {r['io_ms']:.1f} | {r['mb_per_sweep']:.1f} | {r['gb_per_s']:.2f} |")
    e = rows["Engine (in-process)"]
    for name, r in rows.items():
        if name != "Engine (in-process)":
            print(f"{name} / in-process: {r['sweep_ms'] / e['sweep_ms']:.2f}x per sweep "
                  f"({r['sweep_ms'] - e['sweep_ms']:+.1f} ms)")


if __name__ == "__main__":
    main()
