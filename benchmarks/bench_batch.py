"""Batch generation on the embedded pair: tokens/s and bytes read per token at several batch sizes.

Usage: python benchmarks/bench_batch.py [--sizes 1,4,16] [--prompts 16] [--tokens 48] [--repeats 1] [--warm]
       [--out bench_out/batch.json]

fp32 SmolLM2-135M store (streamspec_ray.store.default), `self-int4` draft, chain mode, cost-model K, greedy,
chat template; cold by default (every sweep evicts the store's files from the page cache first, so each
sweep really reads from disk). The same prompts at every batch size; every batch size's tokens are checked
identical to batch size 1's. Every figure printed is measured in this run (medians over --repeats).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from streamspec_ray import Engine
from streamspec_ray.bench import PROMPTS

MORE = [
    "Give me three tips for learning to cook.", "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.", "What is a prime number? Give examples.",
    "Write a limerick about a programmer.", "How do airplanes stay in the air?", "Explain recursion to a child.",
    "What are the planets of the solar system?", "Suggest a name for a bakery.",
    "How does a refrigerator keep food cold?", "Write two sentences about autumn.",
    "What is the difference between weather and climate?", "Translate 'good morning' into French and Spanish.",
    "What should I pack for a weekend hiking trip?", "Explain what a database index is.",
    "Tell me a fun fact about octopuses.", "How do vaccines work?", "Write a haiku about the moon.",
    "What is photosynthesis?", "Give a short biography of Ada Lovelace.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", default="adaptive")
    ap.add_argument("--warm", action="store_true", help="page cache left warm (default: cold)")
    ap.add_argument("--prefetch-depth", type=int, default=1, help="layers read ahead (Engine's default: 1)")
    ap.add_argument("--out", default="bench_out/batch.json")
    a = ap.parse_args()
    prompts = (PROMPTS + MORE)[: a.prompts]
    k = int(a.k) if a.k.isdigit() else a.k
    eng = Engine(draft="self-int4", cold=not a.warm, prefetch_depth=a.prefetch_depth)
    reqs = [{"messages": [{"role": "user", "content": p}]} for p in prompts]
    eng.generate_batch(reqs[:2], batch_size=2, max_new_tokens=4, k=k)  # warm-up: kernels, first reads
    rows, ref = [], None
    for size in [int(s) for s in a.sizes.split(",")]:
        runs = []
        for _ in range(a.repeats):
            out = eng.generate_batch(reqs, batch_size=size, max_new_tokens=a.tokens, k=k)
            runs.append(out)
            print(f"batch {size:>3}: {out.stats['new_tokens']} tok in {out.stats['wall_s']:.1f} s", file=sys.stderr,
                  flush=True)
        tokens = [[r.token_ids for r in out] for out in runs]
        ref = ref if ref is not None else tokens[0]
        st = [out.stats for out in runs]
        med = {key: statistics.median(s[key] for s in st) for key in ("wall_s", "tokens_per_s", "sweep_s", "draft_s")}
        s0 = st[0]  # tokens, sweeps and bytes are the same in every repeat (greedy; K may differ: reported)
        rows.append({"batch_size": size, "tokens": s0["new_tokens"], **med, "sweeps": s0["sweeps"],
                     "tokens_per_sweep": s0["tokens_per_sweep"], "sequences_per_sweep": s0["sequences_per_sweep"],
                     "bytes_per_token": s0["bytes_per_token"], "bytes_read": s0["bytes_read"],
                     "acceptance": statistics.mean(r.stats["acceptance_rate"] for r in runs[0]),
                     "identical": all(t == ref for t in tokens), "runs": st})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    print(f"| batch size | tokens | wall s | tok/s | x batch {rows[0]['batch_size']} | sweeps | tok/sweep | "
          "seq/sweep | MB read/token | acceptance | sweep s | draft s | = batch 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.2f} | "
              f"{r['speedup']:.2f} | {r['sweeps']} | {r['tokens_per_sweep']:.2f} | {r['sequences_per_sweep']:.1f} | "
              f"{r['bytes_per_token'] / 1e6:.1f} | {r['acceptance']:.2f} | {r['sweep_s']:.1f} | {r['draft_s']:.1f} | "
              f"{r['identical']} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(a.out, "w") as f:
        json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                   "commit": commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(a), "prompts": prompts,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
