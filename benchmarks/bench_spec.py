"""Chain speculation on the embedded pair: tokens per sweep and wall time for fixed K and the controllers.

Usage: python benchmarks/bench_spec.py [--tokens 128] [--repeats 1] [--cold] [--out bench_out/spec.json]
Every figure printed is measured in this run; outputs of every configuration are checked identical to naive.
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

from streamspec_ray import Engine
from streamspec_ray.bench import PROMPTS



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--configs", default="naive,1,2,4,8,12,adaptive,ema")
    ap.add_argument("--out", default="bench_out/spec.json")
    a = ap.parse_args()
    eng = Engine(draft="self-int4", cold=a.cold)
    rows, ref = [], {}
    for cfg in a.configs.split(","):
        mode, k = ("naive", 1) if cfg == "naive" else ("chain", cfg if not cfg.isdigit() else int(cfg))
        per_prompt = []
        for prompt in PROMPTS:
            walls, last = [], None
            for _ in range(a.repeats):
                out = eng.generate(prompt, max_new_tokens=a.tokens, mode=mode, k=k, chat=True)
                walls.append(out.stats["wall_s"])
                last = out
            if cfg == "naive":
                ref[prompt] = last.token_ids
            same = last.token_ids == ref.get(prompt)
            per_prompt.append({"prompt": prompt, "wall_s": statistics.median(walls), "tokens": last.stats["new_tokens"],
                               "sweeps": last.stats["sweeps"], "identical": same,
                               "acceptance": last.stats["acceptance_rate"], "draft_s": last.stats["stats"]["draft_s"],
                               "sweep_s": last.stats["stats"]["sweep_s"], "k": last.stats["stats"]["k_per_round"]})
        tokens = sum(p["tokens"] for p in per_prompt)
        wall = sum(p["wall_s"] for p in per_prompt)
        row = {"config": cfg, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
               "sweeps": sum(p["sweeps"] for p in per_prompt),
               "tokens_per_sweep": tokens / sum(p["sweeps"] for p in per_prompt),
               "acceptance": statistics.mean(p["acceptance"] for p in per_prompt),
               "draft_s": sum(p["draft_s"] for p in per_prompt), "sweep_s": sum(p["sweep_s"] for p in per_prompt),
               "identical": all(p["identical"] for p in per_prompt), "per_prompt": per_prompt}
        rows.append(row)
        print(f"{cfg:>9}: {tokens} tok in {wall:6.2f} s = {row['tokens_per_s']:5.2f} tok/s, "
              f"{row['tokens_per_sweep']:.2f} tok/sweep, acc {row['acceptance']:.2f}, draft {row['draft_s']:.1f} s, "
              f"sweeps {row['sweep_s']:.1f} s, identical={row['identical']}", file=sys.stderr, flush=True)
    print("| config | tokens | wall s | tok/s | sweeps | tok/sweep | acceptance | draft s | sweep s | = naive |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.2f} | {r['sweeps']} | "
              f"{r['tokens_per_sweep']:.2f} | {r['acceptance']:.2f} | {r['draft_s']:.1f} | {r['sweep_s']:.1f} | "
              f"{r['identical']} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(a.out, "w") as f:
        json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "commit": commit, "time": time.time(),
                   "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
