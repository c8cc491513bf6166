"""Pipeline stages: what crosses between the stages, where each stage's time goes, and what pipelined batches gain.

    python benchmarks/bench_stages.py                                  # embedded model, 2 and 3 stages (~28 min)
    python benchmarks/bench_stages.py --max-new-tokens 16 --repeat 1 --batch-sizes 1,4     # a check (~4 min)
    python benchmarks/bench_stages.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --json out.json

Every engine is a RayEngine with threads=1 (each stage process computes on one thread; on 2 cores that is also the
engine's own choice, runtime/threads.py), on one machine: the stages are processes side by side, so "between
stages" is Ray's object store here, not a network. Four parts:

1. Per round, chain mode (default K), on each --stages N: each stage's compute, reads (io; stall: the compute
   waiting for them) and wait, where wait = the driver's round trip for the sweep minus the stage's own sweep wall
   (the stage idle in that round: for the stages before it, then for the ones after). Medians over the rounds
   after each generation's first sweep (which carries the prompt too), and totals over every sweep. Figures come
   from the StagedExecutor's per-stage figures of each sweep (its `_account` is wrapped to keep every one, not
   just the last).
2. Hops (stage-to-stage messages) and stage-to-stage bytes per generated token for naive, chain and tree on the
   same stages, prompts and max tokens (prompt sweeps included).
3. Batch throughput (new tokens/s) at each --batch-sizes B through generate_batch, pipelined rounds on N stages
   (the batch split into N groups) against stages=1 (one stage actor running every layer): the same requests,
   the configurations taking turns (A B C, then C B A, ...), medians of --repeat runs.
4. A PROJECTION computed from part 2's measured hops and bytes (prompt sweeps included): stage-to-stage transfer
   time per generated token over a link of a given bandwidth and per-hop latency. A speculative round pays each
   hop once for all the tokens it accepts.

Every other figure is measured in this run; timings on a shared machine are indicative.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CODE = ["def merge_intervals(intervals):",
        "Write a Python function that parses an ISO 8601 date string without the datetime module.",
        "Write a bash one-liner that counts the lines of every .py file under the current folder.",
        "Write a Python class for a fixed-size ring buffer with push and pop.",
        "Write a Rust function that reverses the order of the words in a string.",
        "Write a Python generator that yields the rows of a CSV file as dictionaries.",
        "Write a Go function that returns the largest value in a slice of integers.",
        "Write a Python decorator that retries a function three times when it raises."]
CHAT = ["Explain in three sentences why a hash map lookup is O(1) on average.",
        "What is the difference between a process and a thread?",
        "Give two reasons to write a failing test before fixing a bug.",
        "Why do bridges have expansion joints? Answer briefly.",
        "Name three ways to make a cup of coffee stronger.",
        "What does a compiler do, in two sentences?",
        "How does a library decide where to shelve a new book?",
        "Describe the water cycle in four short steps."]
PROMPTS = [p for pair in zip(CODE, CHAT) for p in pair]  # code and chat alternating: any prefix has both kinds
MODES = ("naive", "chain", "tree")
LINKS = [(1e9, 0.2e-3), (10e9, 0.2e-3), (100e9, 0.2e-3)]  # (bits/s, seconds per hop) for the projection
med = statistics.median


def watch(ex) -> list[dict]:
    """Keep every sweep's per-stage figures: wrap the StagedExecutor's _account, which sees each sweep's
    driver-side round trip (wall) and the figures the stages sent back with the logits."""
    rows, inner = [], ex._account

    def account(out, wall):
        res = inner(out, wall)
        rows.append({"wall_s": wall, "prompt": False, "stages": [
            {"compute_s": f.sweep.compute_s, "io_s": f.sweep.io_s, "stall_s": f.sweep.stall_s,
             "stage_wall_s": f.sweep.wall_s, "wait_s": wall - f.sweep.wall_s, "bytes_read": f.sweep.bytes_read,
             "received_bytes": f.received_bytes, "sent_bytes": f.sent_bytes} for f in ex.last]})
        return res

    ex._account = account
    return rows


def spec_runs(eng, rounds: list[dict], prompts: list[str], a) -> dict:
    """naive, chain and tree on every prompt -> per mode: totals, the outputs, and its sweeps' figures."""
    out = {}
    for mode in MODES:
        first = len(rounds)
        rec = {"tokens": 0, "sweeps": 0, "hops": 0, "hidden_bytes": 0, "wall_s": 0.0, "token_ids": []}
        for p in prompts:
            start = len(rounds)
            r = eng.generate(prompt=p, max_new_tokens=a.max_new_tokens, mode=mode)
            rounds[start]["prompt"] = True  # (the first sweep: the prompt, and the first round's drafts)
            st = r.stats["ray"]["stages"]
            rec["tokens"] += len(r.token_ids)
            rec["sweeps"] += r.stats["sweeps"]
            rec["hops"] += st["hops"]
            rec["hidden_bytes"] += st["hidden_bytes"]
            rec["wall_s"] += r.stats["wall_s"]
            rec["token_ids"].append(r.token_ids)
        rec["rounds"] = rounds[first:]
        out[mode] = rec
    return out


def per_stage(rounds: list[dict]) -> list[dict]:
    """Per stage: the median of each figure over the rounds after the first sweeps, its total over every sweep."""
    dec = [r for r in rounds if not r["prompt"]]
    keys = list(rounds[0]["stages"][0])
    return [{"median": {k: med(r["stages"][i][k] for r in dec) for k in keys},
             "total": {k: sum(r["stages"][i][k] for r in rounds) for k in keys}}
            for i in range(len(rounds[0]["stages"]))]


def batch_runs(engines: dict, a) -> list[dict]:
    """generate_batch at every B on every engine, the engines taking turns -> one row per (B, stages)."""
    runs = {(b, n): [] for b in a.batch_sizes for n in engines}
    order = list(engines)
    for rep in range(a.repeat):
        for b in a.batch_sizes:
            for n in (order if rep % 2 == 0 else order[::-1]):
                res = engines[n].generate_batch(PROMPTS, batch_size=b, mode="chain", max_new_tokens=a.max_new_tokens)
                runs[b, n].append({"tokens_per_s": res.stats["tokens_per_s"], "wall_s": res.stats["wall_s"],
                                   "new_tokens": res.stats["new_tokens"], "sweeps": res.stats["sweeps"],
                                   "token_ids": [r.token_ids for r in res]})
                print(f"  batch {b:>2}, stages {n}, run {rep + 1}: {res.stats['tokens_per_s']:.2f} tok/s",
                      file=sys.stderr, flush=True)
    rows = []
    for (b, n), rs in runs.items():
        ref = runs[b, order[0]][0]["token_ids"]
        rows.append({"batch_size": b, "stages": n, "tokens_per_s": med(r["tokens_per_s"] for r in rs),
                     "runs": [round(r["tokens_per_s"], 2) for r in rs], "wall_s": med(r["wall_s"] for r in rs),
                     "new_tokens": rs[0]["new_tokens"], "sweeps": rs[0]["sweeps"],
                     "same_as_one_stage": all(r["token_ids"] == ref for r in rs)})
    return rows


def project(spec: dict, stages: list[int]) -> list[dict]:
    """PROJECTION, not a measurement: (hops x latency + bytes x 8 / bandwidth) / tokens, from part 2's measured
    counts (every sweep: the prompt's hidden states cross once per hop in every mode alike). Two figures: between
    the stages only (the driver on the first stage's node), and with the driver's round trip on its own node too
    (per sweep two hops more: the tokens to the first stage, the last stage's logits back, which grow with the
    rows a round verifies)."""
    rows = []
    for n in stages:
        for mode, r in spec[n].items():
            logits = sum(x["stages"][-1]["sent_bytes"] for x in r["rounds"])
            for bps, lat in LINKS:
                lat_s, byte_s = r["hops"] * lat / r["tokens"], r["hidden_bytes"] * 8 / bps / r["tokens"]
                trip_s = (2 * r["sweeps"] * lat + logits * 8 / bps) / r["tokens"]
                rows.append({"stages": n, "mode": mode, "gbit_s": bps / 1e9, "hop_ms": lat * 1e3,
                             "ms_per_token": 1e3 * (lat_s + byte_s), "latency_ms": 1e3 * lat_s,
                             "bytes_ms": 1e3 * byte_s, "with_driver_ms_per_token": 1e3 * (lat_s + byte_s + trip_s)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="store or named model (default: the embedded SmolLM2-135M fp32)")
    p.add_argument("--draft", default="self-int4", help="draft (default: self-int4)")
    p.add_argument("--stages", default="2,3", help="comma-separated stage counts (default 2,3)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4, help="prompts for parts 1, 2 (default 4: 2 code, 2 chat); "
                                                          f"batches use all {len(PROMPTS)}")
    p.add_argument("--repeat", type=int, default=3, help="batch runs per configuration; the table shows the median")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--threads", type=int, default=1, help="compute threads per actor (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    a = p.parse_args()
    a.stages = [int(s) for s in a.stages.split(",") if s]
    a.batch_sizes = [int(s) for s in a.batch_sizes.split(",") if s]
    if any(n < 2 for n in a.stages):
        p.error("--stages: each count at least 2 (stages=1 is the batch baseline, always run)")

    from streamspec_ray.actors.engine import RayEngine

    here = os.path.dirname(os.path.abspath(__file__))

    def git(*c):
        return subprocess.run(["git", "-C", here, *c], capture_output=True, text=True).stdout.strip()

    # (the code this run imports: taken now, as commits made during a long run would not be in it)
    commit, dirty = git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    t_start = time.time()
    prompts = PROMPTS[: a.prompts]
    engines, layers, rounds = {}, {}, {}
    for n in [1, *a.stages]:
        eng = RayEngine(target=a.target, draft=a.draft, threads=a.threads, stages=n)
        layers[n] = [tuple(s.call("ready")["layers"]) for s in eng._stages]
        eng.generate(prompt=prompts[0], max_new_tokens=4)  # warm-up: kernels, the draft actor
        eng.generate_batch(PROMPTS[:2], batch_size=2, max_new_tokens=4)  # warm-up: the driver's batch draft
        engines[n], rounds[n] = eng, watch(eng.executor)
    spec = {}
    for n in a.stages:
        spec[n] = spec_runs(engines[n], rounds[n], prompts, a)
        print(f"  stages {n}: naive, chain, tree done ({time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)
    batch = batch_runs(engines, a)
    for eng in engines.values():
        eng.close()
    elapsed = time.time() - t_start

    cores = os.cpu_count()
    print(f"machine: {cores} cores, CPU only, {platform.platform()}; {a.threads} compute thread(s) per actor; "
          f"every stage a process on this one machine")
    print(f"target {a.target or 'embedded SmolLM2-135M fp32'}, draft {a.draft}, greedy, chat template, "
          f"max {a.max_new_tokens} new tokens\n")
    print(f"1. Per round, chain (adaptive K), {len(prompts)} prompts: medians over the rounds after each prompt's "
          "first sweep (wait = driver round trip - the stage's own sweep wall)\n")
    print("| stages | stage | layers | rounds | hops/round | KB in/round | compute ms | io ms | stall ms | "
          "stage wall ms | wait ms | driver ms/round |")
    print("|" + "---|" * 12)
    figures = {}
    for n in a.stages:
        rs = spec[n]["chain"]["rounds"]
        dec = [r for r in rs if not r["prompt"]]
        figures[n] = per_stage(rs)
        for i, f in enumerate(figures[n]):
            m = f["median"]
            print(f"| {n} | {i} | {layers[n][i][0]}-{layers[n][i][1] - 1} | {len(dec)} | {n - 1} | "
                  f"{m['received_bytes'] / 1e3:.1f} | {m['compute_s'] * 1e3:.1f} | {m['io_s'] * 1e3:.1f} | "
                  f"{m['stall_s'] * 1e3:.1f} | {m['stage_wall_s'] * 1e3:.1f} | {m['wait_s'] * 1e3:.1f} | "
                  f"{med(r['wall_s'] for r in dec) * 1e3:.1f} |")
    for n in a.stages:
        dec = [r for r in spec[n]["chain"]["rounds"] if not r["prompt"]]
        gap = med(r["wall_s"] - sum(s["stage_wall_s"] for s in r["stages"]) for r in dec)
        print(f"\n{n} stages: per round the driver's round trip exceeds the stages' own walls summed by {gap * 1e3:.1f}"
              " ms (median): submissions, hops, the logits back to the driver")
    print("\nTotals over every chain sweep (prompt sweeps included):\n")
    print("| stages | stage | sweeps | hops | KB received | KB sent | compute s | io s | stall s | wait s |")
    print("|" + "---|" * 10)
    for n in a.stages:
        rs = spec[n]["chain"]["rounds"]
        for i, f in enumerate(figures[n]):
            t = f["total"]
            print(f"| {n} | {i} | {len(rs)} | {(n - 1) * len(rs)} | {t['received_bytes'] / 1e3:.1f} | "
                  f"{t['sent_bytes'] / 1e3:.1f} | {t['compute_s']:.2f} | {t['io_s']:.2f} | {t['stall_s']:.2f} | "
                  f"{t['wait_s']:.2f} |")
    print(f"\n2. Per generated token, the same {len(prompts)} prompts (prompt sweeps included)\n")
    print("| stages | mode | tokens | sweeps | tok/sweep | hops | hops/token | KB between stages | KB/token | "
          "ms/token | = naive |")
    print("|" + "---|" * 11)
    for n in a.stages:
        for mode, r in spec[n].items():
            t = r["tokens"]
            print(f"| {n} | {mode} | {t} | {r['sweeps']} | {t / r['sweeps']:.2f} | {r['hops']} | {r['hops'] / t:.2f} | "
                  f"{r['hidden_bytes'] / 1e3:.1f} | {r['hidden_bytes'] / t / 1e3:.2f} | {1e3 * r['wall_s'] / t:.0f} | "
                  f"{r['token_ids'] == spec[n]['naive']['token_ids']} |")
    print(f"\n3. Batch throughput, chain, {len(PROMPTS)} requests, pipelined rounds (N groups over N stages) "
          f"against stages=1; median of {a.repeat} runs, configurations taking turns\n")
    print("| B | stages | tokens | sweeps | tok/s (median; runs) | x stages=1 | = stages=1 |")
    print("|" + "---|" * 7)
    base = {r["batch_size"]: r["tokens_per_s"] for r in batch if r["stages"] == 1}
    for r in sorted(batch, key=lambda r: (r["batch_size"], r["stages"])):
        print(f"| {r['batch_size']} | {r['stages']} | {r['new_tokens']} | {r['sweeps']} | **{r['tokens_per_s']:.2f}**"
              f"; {', '.join(map(str, r['runs']))} | {r['tokens_per_s'] / base[r['batch_size']]:.2f} | "
              f"{r['same_as_one_stage']} |")
    proj = project(spec, a.stages)
    print("\n4. PROJECTION, computed from part 2's measured hops and bytes (prompt sweeps included), not measured: "
          "transfer ms per generated token = (hops x latency + bytes x 8 / bandwidth) / tokens, between the stages; "
          "after the slash, with the driver's round trip on a node of its own too (tokens out, logits back)\n")
    print("| stages | mode | " + " | ".join(f"{b / 1e9:g} Gbit/s, {lat * 1e3:g} ms/hop" for b, lat in LINKS) + " |")
    print("|" + "---|" * (2 + len(LINKS)))
    for i in range(0, len(proj), len(LINKS)):
        row = proj[i: i + len(LINKS)]
        cells = " | ".join(f"{x['ms_per_token']:.3f} / {x['with_driver_ms_per_token']:.3f}" for x in row)
        print(f"| {row[0]['stages']} | {row[0]['mode']} | {cells} |")
    print(f"\nwhole run: {elapsed:.0f} s; the code of commit {commit}{' with uncommitted changes' if dirty else ''}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": platform.platform(), "cpus": cores, "commit": commit, "uncommitted_changes": dirty,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "elapsed_s": elapsed, "args": vars(a),
                       "prompts": prompts, "batch_prompts": PROMPTS, "layers": layers,
                       "per_stage": figures, "spec": spec, "batch": batch, "projection": proj}, f, indent=1)


if __name__ == "__main__":
    main()
