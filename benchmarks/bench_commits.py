"""Two checkouts of the engine, the same generations, runs taking turns: is a change a slowdown?

    git worktree add /tmp/before <commit before the change>
    python benchmarks/bench_commits.py --before /tmp/before --after . --prompts unseen.jsonl --repeat 3 \\
        -- --mode tree --cold                      # the embedded model, cold, tree
    python benchmarks/bench_commits.py --before /tmp/before --after . --prompts unseen.jsonl --repeat 3 \\
        -- --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --memory-limit 1.2GB --max-new-tokens 64

Each run is `python -m streamspec_ray generate PROMPT --json ARGS` in its own process, with that checkout first on
the import path; for every prompt and repeat the two checkouts run one after the other (which goes first
alternates), so a slow hour of the disk falls on both. --prompts takes one {"kind": ..., "text": ..., "raw":
true | false} object a line. Prints, per prompt kind and over all, the median ms/token of each checkout and
their ratio, and whether the two gave the same tokens in every run. Every figure is measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def run(tree: str, prompt: dict, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, "-m", "streamspec_ray", "generate", prompt["text"], "--json",
           "--raw" if prompt.get("raw") else "--chat", *args]
    out = subprocess.run(cmd, env=env, cwd=os.path.abspath(tree), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd[:6])}... failed ({out.returncode}):\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    return {"ms_per_token": 1000 * r["wall_s"] / max(1, r["new_tokens"]), "tokens": r["token_ids"],
            "tokens_per_sweep": r["tokens_per_sweep"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the checkout before the change")
    ap.add_argument("--after", default=".", help="the checkout with the change")
    ap.add_argument("--prompts", required=True, metavar="JSONL")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write every run to this JSON file")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the generate arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    prompts = [json.loads(line) for line in open(a.prompts) if line.strip()]
    trees = {"before": a.before, "after": a.after}
    runs = []  # (prompt index, name, result)
    for rep in range(a.repeat):
        for i, p in enumerate(prompts):
            order = ["before", "after"] if (rep + i) % 2 == 0 else ["after", "before"]
            for name in order:
                r = run(trees[name], p, args)
                runs.append((i, name, r))
                print(f"  run {rep + 1} prompt {i} ({p.get('kind', '?')}) {name}: {r['ms_per_token']:.0f} ms/token, "
                      f"{r['tokens_per_sweep']:.2f} tokens/sweep", file=sys.stderr, flush=True)
    same = all(len({json.dumps(r["tokens"]) for i, _, r in runs if i == k}) == 1 for k in range(len(prompts)))
    kinds = sorted({p.get("kind", "all") for p in prompts})
    print(f"generate {' '.join(args)}; {a.repeat} runs per prompt and checkout, medians of ms/token\n")
    print("| prompts | before | after | after / before |")
    print("|---|---|---|---|")
    for kind in kinds + ["all"]:
        idx = {i for i, p in enumerate(prompts) if kind == "all" or p.get("kind", "all") == kind}
        med = {n: statistics.median(r["ms_per_token"] for i, name, r in runs if i in idx and name == n)
               for n in trees}
        print(f"| {kind} | {med['before']:.0f} | {med['after']:.0f} | {med['after'] / med['before']:.3f} |")
    print(f"\nthe same tokens in every run of each prompt, both checkouts: {same}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": args, "prompts": prompts, "runs": [{"prompt": i, "checkout": n, **r}
                                                                    for i, n, r in runs]}, f)


if __name__ == "__main__":
    main()
