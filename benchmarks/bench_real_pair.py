"""The real pair, cold, under a memory limit: Qwen2.5-Coder-1.5B-Instruct (int4pack store, 4-bit) streamed as the
target, Qwen2.5-Coder-0.5B-Instruct (int4pack, in memory) as the draft.

    python benchmarks/bench_real_pair.py --memory-limit 1.2GB --tokens 64
    python benchmarks/bench_real_pair.py --prompts mine.jsonl --rows naive,chain --repeat 3 \
        --memory-limit 1.2GB,1.5GB,2GB,none        # your own prompts, medians of 3, under each limit in turn

--prompts takes one {"kind": "code" | "chat" | ..., "text": ..., "raw": true | false} object a line (raw: the text as
it is; else the chat template is applied), for prompts the bench has never seen. Each row's breakdown per sweep
(compute, reads, stall), its compute threads, drafting per round, and the pressure counters (major page faults,
the cgroup's refaults) show when a limit is too tight. --target-dtype gguf streams the file's own blocks (the
GGUF's model exactly) instead of int4pack; --threads overrides the engine's thread choice.

Each row runs in its own process inside a memory cgroup of --memory-limit (page cache included, the store files
evicted first), with every shard evicted again before it is read (--cold), so every sweep reads from disk. The
row's peak is the kernel's (memory.max_usage_in_bytes). The transformers row is the floor: the same weights
dequantized to fp32 and held in memory (no limit; its peak is the process's max RSS). Prints a markdown table and
writes bench_out/real_pair.json; every figure is measured in this run.

    python benchmarks/bench_real_pair.py --rows naive,chain,chain8,tree --llama-cpp ~/llama.cpp/build/bin

also runs llama.cpp's binaries from that folder on the same GGUF files (assembled from the part packages into
--gguf-dir) under every limit the engine's rows run at. Each run (one binary, one prompt) is the binary alone in a
fresh memory cgroup of the limit, started from this process (no Python beside it, page cache charged as for the
engine's rows), its GGUF files evicted first; under "none" the files are evicted and it runs without a cgroup (its
peak unknown, as the engine's). The rows: `llama-completion -no-cnv` (the target alone; it took over llama-cli's
non-interactive mode) and `llama-speculative-simple --spec-type draft-simple -md <0.5B> --spec-draft-n-max 8` (and
16, --spec-draft-n-min 0; greedy drafts of n_max tokens, its default p_min 0). Both get the same text, the chat
template written out (so the same tokens; --no-escape keeps it as it is), -n --tokens, greedy (--temp 0, -s 0), 2
threads (-t 2 -tb 2, the draft's -td 2 -tbd 2), -c 512 -b 512 -ub 128, the weights mapped from the file (llama.cpp's
default load mode). Each prompt runs twice, with --no-repack and without, in turns: repacking copies the weights
that llama.cpp has repacked CPU kernels for (on this AVX2 machine too) into anonymous memory at load, which a tight
limit squeezes or kills; --no-repack leaves them mapped from the file, which is what lets llama.cpp run a model
larger than memory. The row shows the faster of the two variants that ran every prompt without being killed (its
ms/token over all prompts; a variant more than DROP_SLOWER = 2x slower than the other on a prompt is not run on the
later ones, a repacked run thrashing below the file's size taking minutes a prompt; a run past --llama-timeout,
300 s, is stopped and fails its variant); the table names it and gives the other's ms/token or "killed", and the
JSON keeps both variants' runs (peak, oom_killed, output). llama.cpp's warmup (an empty decode at load that faults the weights in)
is left on: llama-speculative-simple has no --no-warmup, and llama-completion keeps it too, so that the two load
alike. A llama.cpp row's ms/token is its own prompt and decode time over the tokens it generated: llama-completion's
"prompt eval" + "eval" timers over the eval runs plus the first token; llama-speculative-simple's "encoded" +
"decoded" over the tokens decoded (it checks -n only after a round, so it may decode up to n_max + 1 past it). Model
loading, warmup and repacking are not counted, as the engine's start-up is not. llama.cpp runs the file's weights as
they are; the engine's int4pack stores re-quantize its Q6_K tensors (docs/formats.md), so the "= naive" column is
left empty for llama.cpp rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

CODE = ["Write a Python function that checks whether a number is prime.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that removes duplicates from an array.",
        "Write a SQL query that lists the ten customers with the highest total order value."]
CHAT = ["What is the capital of France? Answer in one sentence.",
        "Give me three tips for sleeping better.",
        "Explain in two sentences why the sky is blue.",
        "Say hello in French, Spanish and German."]
ROWS = {  # key -> (what the table calls it, generate options); overlap: the draft works during the sweep (the
    # default: in chain mode, not in tree mode)
    "naive": ("naive", dict(mode="naive", draft=None)),
    "chain8": ("chain, 0.5B draft, K=8", dict(mode="chain", draft="qwen2.5-coder-0.5b", k=8)),
    "chain8-serial": ("chain, 0.5B draft, K=8, no overlap", dict(mode="chain", draft="qwen2.5-coder-0.5b", k=8,
                                                                 overlap=False)),
    "chain": ("chain, 0.5B draft, adaptive K", dict(mode="chain", draft="qwen2.5-coder-0.5b", k="adaptive")),
    "tree16": ("tree, 0.5B draft, budget 16", dict(mode="tree", draft="qwen2.5-coder-0.5b", budget=16)),
    "tree16-overlap": ("tree, 0.5B draft, budget 16, overlap", dict(mode="tree", draft="qwen2.5-coder-0.5b",
                                                                    budget=16, overlap=True)),
    "tree32": ("tree, 0.5B draft, budget 32", dict(mode="tree", draft="qwen2.5-coder-0.5b", budget=32)),
    "tree64": ("tree, 0.5B draft, budget 64", dict(mode="tree", draft="qwen2.5-coder-0.5b", budget=64)),
    "tree": ("tree, 0.5B draft, adaptive budget", dict(mode="tree", draft="qwen2.5-coder-0.5b", budget="adaptive")),
    "self": ("chain, self-int4 draft, K=8", dict(mode="chain", draft="self-int4", k=8)),
}
DEFAULT_ROWS = "naive,chain8,chain8-serial,tree16,tree16-overlap,tree32,self"
LLAMA_ROWS = {  # key -> (what the table calls it, binary, extra arguments)
    "llama.cpp": ("llama.cpp, target alone", "llama-completion", ["-no-cnv"]),
    "llama.cpp-spec8": ("llama.cpp speculative, 0.5B draft, n_max 8", "llama-speculative-simple",
                        ["--spec-type", "draft-simple", "--spec-draft-n-max", "8", "--spec-draft-n-min", "0"]),
    "llama.cpp-spec16": ("llama.cpp speculative, 0.5B draft, n_max 16", "llama-speculative-simple",
                         ["--spec-type", "draft-simple", "--spec-draft-n-max", "16", "--spec-draft-n-min", "0"]),
}


def load_prompts(path: str | None) -> list[tuple[str, str, bool]]:
    """(kind, text, raw) for every prompt: the bench's own (chat template applied), or a JSON-lines file of
    {"kind": "code" | "chat" | ..., "text": str, "raw": bool} (raw: the text as it is, no chat template)."""
    if path is None:
        return [(kind, p, False) for kind, ps in (("code", CODE), ("chat", CHAT)) for p in ps]
    with open(path) as f:
        return [(d["kind"], d["text"], bool(d.get("raw", False))) for d in map(json.loads, f) if d]


def worker(row: str, tokens: int, cold: bool, prompts_path: str | None, target_dtype: str | None,
           threads: int | None) -> None:
    """One row, all prompts, in this process: one JSON line per prompt on stdout."""
    from streamspec_ray import Engine

    opts = dict(ROWS[row][1])
    eng = Engine(target="qwen2.5-coder-1.5b", draft=opts.pop("draft"), cold=cold, target_dtype=target_dtype,
                 threads=threads or "auto")
    for kind, p, raw in load_prompts(prompts_path):
        out = eng.generate(prompt=p, chat=not raw, max_new_tokens=tokens, temperature=0.0, **opts)
        s = out.stats
        print(json.dumps({"kind": kind, "prompt": p, "token_ids": out.token_ids, "sweeps": s["sweeps"],
                          "wall_s": s["wall_s"], "bytes_read": s["bytes_read"],
                          "acceptance_rate": s["acceptance_rate"] if opts["mode"] != "naive" else None,
                          "draft_s": s["stats"]["draft_s"], "draft_hidden_s": s["stats"]["draft_hidden_s"],
                          "prepared": s["stats"]["lookahead_prepared"],
                          "reused": s["stats"]["lookahead_reused"],
                          "io_s": s["stats"]["io_s"], "compute_s": s["stats"]["compute_s"],
                          "stall_s": s["stats"]["stall_s"], "threads": s["threads"],
                          "k_per_round": s["stats"]["k_per_round"], "pressure": s.get("pressure", {}),
                          "memory_plan": s.get("memory_plan")}), flush=True)


def prompt_texts(prompts_path: str | None) -> list[tuple[str, str, str]]:
    """(kind, prompt, the text the engine's tokens spell: the chat template written out unless raw)."""
    from transformers import AutoTokenizer

    from streamspec_ray.store.default import resolve_store

    tok = AutoTokenizer.from_pretrained(os.path.join(resolve_store("qwen2.5-coder-1.5b"), "tokenizer"))
    return [(kind, p, p if raw else tok.apply_chat_template([{"role": "user", "content": p}],
                                                            add_generation_prompt=True, tokenize=False))
            for kind, p, raw in load_prompts(prompts_path)]


_MS = r"([0-9.]+) ms /\s*([0-9]+) (?:tokens|runs)"


DROP_SLOWER = 2.0  # a llama.cpp variant this many times slower than the other on a prompt is not run again


def llama_argv(row: str, a, repack: bool, text: str) -> list[str]:
    """One llama.cpp run of `row` on one prompt's text (the chat template already written out)."""
    _name, binary, extra = LLAMA_ROWS[row]
    argv = [os.path.join(a.llama_cpp, binary), "-m", a.ggufs[0], "-p", text, "--no-escape", "-n", str(a.tokens),
            "--temp", "0", "-s", "0", "-t", "2", "-tb", "2", "-c", "512", "-b", "512", "-ub", "128", *extra]
    if binary == "llama-speculative-simple":
        argv += ["-md", a.ggufs[1], "-td", "2", "-tbd", "2"]
    return argv + ([] if repack else ["--no-repack"])


def parse_llama(binary: str, err: str) -> dict:
    """Timings from a llama.cpp run's log: {wall_s, n_tokens} (and acceptance for speculation), or {} if absent."""
    import re

    rec = {}
    if binary == "llama-completion":
        pe = re.search(r"prompt eval time =\s*" + _MS, err)
        ev = re.search(r"\beval time =\s*" + _MS + r"\s*\(", err.split("prompt eval time")[-1])
        if pe and ev:  # the first token comes from the prompt's pass, one more from each eval run
            rec.update(wall_s=(float(pe[1]) + float(ev[1])) / 1e3, n_tokens=int(ev[2]) + 1, prompt_tokens=int(pe[2]))
    else:  # "encoded": the prompt but its last token, through the target and the draft; "decoded": the rest
        enc = re.search(r"encoded\s+([0-9]+) tokens in\s+([0-9.]+) seconds", err)
        dec = re.search(r"decoded\s+([0-9]+) tokens in\s+([0-9.]+) seconds", err)
        acc = re.search(r"n_drafted\s*=\s*([0-9]+)\s+.*?n_accept\s*=\s*([0-9]+)", err, re.S)
        if enc and dec:
            rec.update(wall_s=float(enc[2]) + float(dec[2]), n_tokens=int(dec[1]), prompt_tokens=int(enc[1]),
                       acceptance_rate=int(acc[2]) / int(acc[1]) if acc and int(acc[1]) else None)
    load = re.search(r"load time =\s*([0-9.]+) ms", err)  # (the target's, warmup excluded; not counted)
    return {**rec, "load_s": float(load[1]) / 1e3} if load else rec


def llama_run(argv: list[str], ggufs: list[str], limit: int | None, timeout_s: float = 0) -> dict:
    """The binary alone, in a fresh cgroup of `limit` (none: no cgroup), its GGUF files evicted first; stopped
    (SIGKILL, by coreutils' timeout) after timeout_s seconds where that is not 0: a repacked run below the file's
    size thrashes for minutes a prompt (630 s on one at 0.8 GB)."""
    import tempfile

    from streamspec_ray.runtime import memlimit

    binary = os.path.basename(argv[0])
    if timeout_s:
        argv = ["timeout", "--signal=KILL", f"{timeout_s:g}", *argv]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        if limit is None:  # (no cgroup: the files evicted all the same, the peak is unknown)
            memlimit.evict(ggufs)
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            run = memlimit.LimitedRun(proc.returncode, None, 0, False)
        else:
            run = memlimit.run_limited(argv, limit, evict_paths=ggufs, stdout=out, stderr=err)
        out.seek(0)
        err.seek(0)
        text, log = out.read(), err.read()
    rec = {"returncode": run.returncode, "oom_killed": run.oom_killed, "peak_bytes": run.peak_bytes,
           **parse_llama(binary, log), "output": text[-400:]}
    timed_out = bool(timeout_s) and run.returncode in (124, 137, -9) and not run.oom_killed
    if run.returncode or "wall_s" not in rec:
        rec["error"] = ("killed: out of memory; " if run.oom_killed else f"stopped after {timeout_s:g} s; "
                        if timed_out else f"exit {run.returncode}; ") + log[-1500:]
    rec["timed_out"] = timed_out
    return rec


def llama_row(row: str, a, limit: int | None) -> dict:
    """One llama.cpp row, every prompt, each run of the binary alone in its own cgroup: with --no-repack (the
    weights stay mapped from the file) and without (repacking copies them into anonymous memory), the two taking
    turns prompt by prompt. The row is the variant that ran every prompt with the lower ms/token over all of them;
    a variant that failed a prompt (killed, or no timings) is not run on the later ones, nor is one that took more
    than DROP_SLOWER times the other's ms/token on a prompt (a repacked run thrashing under a limit below the file
    takes minutes a prompt: it is recorded as dropped, with the ms/token of the prompts it ran)."""
    if getattr(a, "texts", None) is None:
        a.texts = prompt_texts(a.prompts)
    variants = {False: [], True: []}  # repack -> its prompts
    dropped = set()
    for kind, prompt, text in a.texts:
        for repack, done in variants.items():
            if not any(p.get("error") for p in done) and repack not in dropped:
                done.append({"kind": kind, "prompt": prompt, "token_ids": [], "repack": repack,
                             **llama_run(llama_argv(row, a, repack, text), a.ggufs, limit, a.llama_timeout)})
        last = {r: ps[-1] for r, ps in variants.items() if ps and ps[-1]["prompt"] == prompt
                and not ps[-1].get("error")}
        if len(last) == 2:
            ms = {r: p["wall_s"] / p["n_tokens"] for r, p in last.items()}
            slow = max(ms, key=ms.get)
            if ms[slow] > DROP_SLOWER * ms[not slow]:
                dropped.add(slow)
    info = {}
    for repack, ps in variants.items():
        good = (len(ps) == len(a.texts) and not any(p.get("error") for p in ps)
                and sum(p.get("n_tokens", 0) for p in ps))
        ran = [p for p in ps if not p.get("error")]
        info[repack] = {"ms_per_token": 1e3 * sum(p["wall_s"] for p in ps) / sum(p["n_tokens"] for p in ps)
                        if good else None, "oom_killed": any(p["oom_killed"] for p in ps), "failed": not good,
                        "dropped": repack in dropped, "prompts_run": len(ran),
                        "ms_per_token_ran": 1e3 * sum(p["wall_s"] for p in ran) / sum(p["n_tokens"] for p in ran)
                        if ran and sum(p["n_tokens"] for p in ran) else None,
                        "peak_bytes": max((p["peak_bytes"] or 0 for p in ps), default=0) or None, "prompts": ps}
        for p in [p for p in ps if p.get("error")]:
            print(f"{LLAMA_ROWS[row][0]} ({'repack' if repack else 'no repack'}): {p['prompt']!r}: {p['error']}",
                  file=sys.stderr)
    ok = sorted((v["ms_per_token"], repack) for repack, v in info.items() if not v["failed"])
    chosen = ok[0][1] if ok else None
    bad = [p for ps in variants.values() for p in ps if p.get("error")]
    return {"row": LLAMA_ROWS[row][0], "limit": limit, "repack": chosen,
            "returncode": 0 if ok else next((p["returncode"] for p in bad if p["returncode"]), 1),
            "oom_killed": not ok and all(v["oom_killed"] for v in info.values()),
            "peak_bytes": info[chosen]["peak_bytes"] if ok else max((v["peak_bytes"] or 0 for v in info.values()))
            or None, "prompts": variants[chosen] if ok else [],
            "variants": {("repack" if r else "no_repack"): v for r, v in info.items()}}


def hf_row(tokens: int, prompts_path: str | None) -> list[dict]:
    """transformers in memory on the same GGUF (fp32): the floor."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamspec_ray.store import sources

    with tempfile.TemporaryDirectory() as d:
        path = sources.assemble("qwen2.5-coder-1.5b", os.path.join(d, "q15.gguf"))
        tok = AutoTokenizer.from_pretrained(d, gguf_file="q15.gguf")
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    out = []
    for kind, p, raw in load_prompts(prompts_path):
        ids = tok(p)["input_ids"] if raw else tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                                 eos_token_id=model.config.eos_token_id, pad_token_id=tok.pad_token_id)
        new = gen[0, len(ids):].tolist()
        if model.config.eos_token_id in new:  # as ours: the EOS token ends the output and is kept
            new = new[: new.index(model.config.eos_token_id) + 1]
        out.append({"kind": kind, "prompt": p, "token_ids": new, "wall_s": time.perf_counter() - t0})
    return out


def run_row(row: str, a, limit: int | None) -> dict:
    from streamspec_ray.runtime import memlimit
    from streamspec_ray.store.default import resolve_store

    if row in LLAMA_ROWS:
        return llama_row(row, a, limit)
    stores = [resolve_store("qwen2.5-coder-1.5b", a.target_dtype), resolve_store("qwen2.5-coder-0.5b")]
    argv = [sys.executable, os.path.abspath(__file__), "--worker", row, "--tokens", str(a.tokens)]
    if not a.cold:
        argv.append("--no-cold")
    if a.prompts:
        argv += ["--prompts", a.prompts]
    if a.target_dtype:
        argv += ["--target-dtype", a.target_dtype]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    with open(os.path.join(a.out, f"row-{len(os.listdir(a.out))}.jsonl"), "w+") as f:
        if limit is None:  # (no cgroup: the files evicted all the same, the peak is unknown)
            memlimit.evict(stores)
            proc = subprocess.run(argv, stdout=f)
            run = memlimit.LimitedRun(proc.returncode, None, 0, False)
        else:
            run = memlimit.run_limited(argv, limit, evict_paths=stores, stdout=f)
        f.seek(0)
        prompts = [json.loads(line) for line in f if line.strip()]
    bad = [p for p in prompts if p.get("error")]
    if bad:
        print(f"{row}: {bad[0]['prompt']!r}: {bad[0]['error']}", file=sys.stderr)
    return {"row": ROWS[row][0], "limit": limit,
            "returncode": run.returncode or int(bool(bad)), "oom_killed": run.oom_killed,
            "peak_bytes": run.peak_bytes, "prompts": prompts}


def summarize(rec: dict, naive: dict | None) -> dict:
    out = {}
    for kind in sorted({p["kind"] for p in rec["prompts"]}) + ["all"]:
        ps = [p for p in rec["prompts"] if kind == "all" or p["kind"] == kind]
        if not ps:
            continue
        n = sum(p.get("n_tokens", len(p["token_ids"])) for p in ps)
        sweeps = sum(p.get("sweeps", 0) for p in ps)
        same = None
        if naive is not None and not rec["row"].startswith("llama.cpp"):  # (another model: see the docstring)
            ref = {p["prompt"]: p["token_ids"] for p in naive["prompts"]}
            same = all(ref.get(p["prompt"]) == p["token_ids"] for p in ps)
        acc = [p["acceptance_rate"] for p in ps if p.get("acceptance_rate") is not None]
        per_sweep = lambda key: 1e3 * sum(p.get(key, 0) for p in ps) / sweeps if sweeps else None  # noqa: E731
        pressure = lambda key: sum(p.get("pressure", {}).get(key, 0) for p in ps)  # noqa: E731
        out[kind] = {"tokens": n, "wall_s": sum(p["wall_s"] for p in ps), "sweeps": sweeps,
                     "tokens_per_sweep": n / sweeps if sweeps else None,
                     "acceptance": sum(acc) / len(acc) if acc else None,
                     "ms_per_token": 1e3 * sum(p["wall_s"] for p in ps) / n,
                     "mb_read_per_token": sum(p.get("bytes_read", 0) for p in ps) / n / 1e6,
                     # drafting per round: on the critical path, and done during the sweep; prepared rounds used
                     "draft_ms_per_round": per_sweep("draft_s"), "hidden_ms_per_round": per_sweep("draft_hidden_s"),
                     # a sweep's breakdown: its compute, its reads (on the reader, overlapped) and its waits for them
                     "compute_ms_per_sweep": per_sweep("compute_s"), "io_ms_per_sweep": per_sweep("io_s"),
                     "stall_ms_per_sweep": per_sweep("stall_s"),
                     "threads": sorted({p["threads"] for p in ps if p.get("threads")}),
                     # pages this process read back from disk (its code and libraries included), and those the
                     # cgroup's kernel evicted and read again: non-zero when the limit is too tight
                     # (not measured for llama.cpp and transformers rows: None, not 0)
                     "major_faults": pressure("major_faults") if any("pressure" in p for p in ps) else None,
                     "refaults": pressure("cgroup_workingset_refault_file") + pressure("cgroup_workingset_refault_anon")
                     if any("pressure" in p for p in ps) else None,
                     "reuse_rate": (sum(p.get("reused", 0) for p in ps) / sum(p.get("prepared", 0) for p in ps)
                                    if sum(p.get("prepared", 0) for p in ps) else None),
                     "identical_to_naive": same}
        if rec.get("variants"):  # (llama.cpp: the variant chosen, and each variant's ms/token on these prompts)
            out[kind]["repack"] = rec["repack"]
            out[kind]["variants"] = {name: {"oom_killed": v["oom_killed"], "ms_per_token": None if v["failed"] else
                                            1e3 * sum(p["wall_s"] for p in v["prompts"] if kind in ("all", p["kind"]))
                                            / sum(p["n_tokens"] for p in v["prompts"] if kind in ("all", p["kind"])),
                                            "dropped": v.get("dropped"), "prompts_run": v.get("prompts_run"),
                                            "ms_per_token_ran": v.get("ms_per_token_ran")}
                                     for name, v in rec["variants"].items()}
    return out


def median_run(runs: list[dict]) -> dict:
    """Repeated runs of one row -> one record: per kind of prompt the run with the median ms/token (the middle
    one; the slower of the two middle ones for an even count), every run's ms/token kept beside it."""
    ok = [r for r in runs if not r["returncode"]]
    if not ok:
        return runs[0]
    out = dict(ok[0], runs=len(runs), failed=len(runs) - len(ok), summary={})
    for kind in ok[0]["summary"]:
        by = sorted((r["summary"][kind]["ms_per_token"], i) for i, r in enumerate(ok) if kind in r["summary"])
        mid = ok[by[len(by) // 2][1]]
        out["summary"][kind] = dict(mid["summary"][kind], ms_per_token_runs=[round(ms, 1) for ms, _ in by],
                                    identical_to_naive=None if any(r["summary"][kind]["identical_to_naive"] is None
                                                                   for r in ok)
                                    else all(r["summary"][kind]["identical_to_naive"] for r in ok))
    out["peak_bytes"] = max((r["peak_bytes"] or 0) for r in ok) or None
    return out


def table(records: list[dict]) -> str:
    lines = ["| limit | row | prompts | tokens | tok/sweep | acceptance | ms/token (median; runs) | x naive | "
             "compute / reads / stall ms per sweep | threads | draft ms/round (critical / hidden) | major faults | "
             "refaults | peak memory | = naive |", "|" + "---|" * 15]
    base = {}
    for r in records:
        lim = "none" if not r.get("limit") else f"{r['limit'] / 1e9:.1f} GB"
        if r.get("returncode"):
            why = "killed: out of memory" if r.get("oom_killed") else f"exit {r['returncode']}"
            lines.append(f"| {lim} | {_label(r, None)} |" + " - |" * 12 + f" {_gb(r.get('peak_bytes'))} | {why} |")
            continue
        if r["row"] == "naive":
            base[r.get("limit")] = {k: v["ms_per_token"] for k, v in r["summary"].items()}
        b = base.get(r.get("limit"), {})
        for kind, s in r["summary"].items():
            f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
            runs = s.get("ms_per_token_runs")
            lines.append(f"| {lim} | {_label(r, s)} | {kind} | {s['tokens']} | {f(s['tokens_per_sweep'], '{:.2f}')} | "
                         f"{f(s['acceptance'], '{:.2f}')} | **{s['ms_per_token']:.0f}**"
                         f"{'; ' + ', '.join(f'{x:.0f}' for x in runs) if runs and len(runs) > 1 else ''} | "
                         f"{f(b.get(kind) and b[kind] / s['ms_per_token'], '{:.2f}x')} | "
                         f"{f(s.get('compute_ms_per_sweep'), '{:.0f}')} / {f(s.get('io_ms_per_sweep'), '{:.0f}')} / "
                         f"{f(s.get('stall_ms_per_sweep'), '{:.0f}')} | {','.join(map(str, s.get('threads') or [])) or '-'} | "
                         f"{f(s.get('draft_ms_per_round') or None, '{:.0f}')} / "
                         f"{f(s.get('hidden_ms_per_round') or None, '{:.0f}')} | {f(s.get('major_faults'), '{}')} | "
                         f"{f(s.get('refaults'), '{}')} | {_gb(r.get('peak_bytes'))} | "
                         f"{f(s['identical_to_naive'], '{}')} |")
    return "\n".join(lines)


def _label(r: dict, s: dict | None) -> str:
    """The row's name; for llama.cpp, the variant shown and how the other did (its ms/token, or why it failed)."""
    if "variants" not in r:
        return r["row"]
    if s is None:  # (both failed)
        return r["row"] + " (" + "; ".join(f"{k.replace('_', ' ')}: {'killed' if v['oom_killed'] else 'failed'}"
                                           for k, v in r["variants"].items()) + ")"
    other = "no_repack" if s["repack"] else "repack"
    v = s["variants"][other]
    how = (f"{v['ms_per_token']:.0f} ms/token" if v["ms_per_token"] is not None
           else f"{v['ms_per_token_ran']:.0f} ms/token on {v['prompts_run']} prompt(s), then dropped"
           if v.get("dropped") and v.get("ms_per_token_ran") else "killed" if v["oom_killed"] else "failed")
    return f"{r['row']} ({'repacked' if s['repack'] else '--no-repack'}; {other.replace('_', ' ')}: {how})"


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.3f} GB"


def save(records: list[dict], a) -> None:
    here = os.path.dirname(os.path.abspath(__file__))  # (the project's commit whatever folder the bench runs in)
    commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(os.path.join(a.out, "real_pair.json"), "w") as f:
        json.dump({"machine": platform.platform(), "cpus": os.cpu_count(), "commit": commit,
                   "memory_limits": a.limits, "tokens": a.tokens, "cold": a.cold, "repeat": a.repeat,
                   "prompts": a.prompts, "target_dtype": a.target_dtype, "threads": a.threads,
                   "llama_cpp": a.llama_cpp and {"bindir": os.path.abspath(a.llama_cpp), "commands": a.llama_commands},
                   "rows": records}, f, indent=1)
    print(table(records), file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-limit", default="1.2GB",
                   help="comma-separated limits, each row run under each (none: no cgroup), e.g. 1.2GB,1.5GB,2GB,none")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rows", default=DEFAULT_ROWS,
                   help=f"comma-separated, of {', '.join(ROWS)} (default: {DEFAULT_ROWS})")
    p.add_argument("--prompts", default=None, metavar="JSONL",
                   help='prompts to run instead of the bench\'s own: one {"kind", "text", "raw"} object a line')
    p.add_argument("--repeat", type=int, default=1, help="runs of each row; the table shows the median")
    p.add_argument("--threads", type=int, default=None, help="the engine's compute threads (default: its choice)")
    p.add_argument("--target-dtype", default=None, help="the target's store dtype (default int4pack; gguf: the "
                                                        "file's own blocks, the file's model exactly)")
    p.add_argument("--no-cold", dest="cold", action="store_false")
    p.add_argument("--no-hf", dest="hf", action="store_false")
    p.add_argument("--out", default="bench_out/real_pair")
    p.add_argument("--llama-cpp", default=None, metavar="BINDIR",
                   help="llama.cpp's build/bin folder: also run the llama.cpp rows (--llama-rows) under each limit, "
                        "each run of a binary alone in its own cgroup")
    p.add_argument("--llama-rows", default="llama.cpp,llama.cpp-spec8,llama.cpp-spec16",
                   help=f"comma-separated, of {', '.join(LLAMA_ROWS)}")
    p.add_argument("--llama-timeout", type=float, default=300,
                   help="seconds a llama.cpp run (one prompt) may take before it is stopped and its variant dropped "
                        "(0: no limit)")
    p.add_argument("--gguf-dir", default="bench_out/gguf", help="where the GGUF files are assembled for llama.cpp")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    unknown = [r for r in a.rows.split(",") + (a.llama_rows.split(",") if a.llama_cpp else [])
               if r and r not in ROWS and r not in LLAMA_ROWS]
    if unknown:  # (before any row runs: a typo at the end of the list would lose the rows before it)
        p.error(f"--rows: unknown row {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    if a.prompts:
        a.prompts = os.path.abspath(a.prompts)
        load_prompts(a.prompts)  # (a bad file fails here, not in the first row's worker)
    import torch
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if a.worker == "hf":
        for rec in hf_row(a.tokens, a.prompts):
            print(json.dumps(rec), flush=True)
        print("peak_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
        return None
    a.ggufs = [os.path.abspath(os.path.join(a.gguf_dir, n + ".gguf"))
               for n in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]
    if a.worker:
        return worker(a.worker, a.tokens, a.cold, a.prompts, a.target_dtype, a.threads)
    from streamspec_ray.cli_args import parse_bytes

    a.limits = [None if x.strip() == "none" else parse_bytes(x) for x in a.memory_limit.split(",") if x.strip()]
    os.makedirs(a.out, exist_ok=True)
    rows = [r for r in a.rows.split(",") if r]
    if a.llama_cpp:
        from streamspec_ray.store import sources

        rows += [r for r in a.llama_rows.split(",") if r]
        missing = sorted({LLAMA_ROWS[r][1] for r in rows if r in LLAMA_ROWS
                          and not os.access(os.path.join(a.llama_cpp, LLAMA_ROWS[r][1]), os.X_OK)})
        if missing:
            p.error(f"--llama-cpp: no {', '.join(missing)} in {a.llama_cpp}")
        a.llama_commands = {r: {v: " ".join(llama_argv(r, a, v == "repack", "<prompt>"))
                                for v in ("no_repack", "repack")} for r in rows if r in LLAMA_ROWS}
        for name, path in zip(("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"), a.ggufs):
            if not os.path.exists(path):  # (assembled once, the sha256 checked; kept for the next run)
                os.makedirs(a.gguf_dir, exist_ok=True)
                sources.assemble(name, path)
    records = []
    naive = None  # (greedy naive output is the reference for every limit: one naive row is enough)

    def one(row: str, limit) -> dict:
        t0 = time.time()
        rec = run_row(row, a, limit)
        rec["summary"] = summarize(rec, naive) if not rec["returncode"] else {}
        print(f"{rec['row']} at {_gb(limit)}: {time.time() - t0:.0f} s, peak {_gb(rec['peak_bytes'])}, "
              f"rc {rec['returncode']}" + (f", repacked: {rec['repack']}" if "variants" in rec else ""),
              file=sys.stderr, flush=True)
        return rec

    for limit in a.limits:
        if "naive" in rows and naive is None:
            rec = one("naive", limit)
            naive = None if rec["returncode"] else rec
            records.append(rec)
        timed = [r for r in rows if r != "naive"]
        # repeats go round the rows (a, b, a, b, ...), not a row at a time: the disk's speed drifts by tens of
        # percent within minutes here, and rows run back to back would compare the minutes as much as the rows
        runs = {r: [] for r in timed}
        for _ in range(a.repeat):
            for row in timed:
                runs[row].append(one(row, limit))
        records += [median_run(runs[row]) for row in timed]
        save(records, a)  # (after every limit: a later one that fails loses nothing)
    if a.hf:  # in its own process (6 GB of fp32 weights, not limited): a failure there loses no other row
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "hf", "--tokens", str(a.tokens)]
        run = subprocess.run(argv + (["--prompts", a.prompts] if a.prompts else []), capture_output=True, text=True)
        prompts = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        peak = next((int(x.split()[1]) for x in run.stdout.splitlines() if x.startswith("peak_rss ")), None)
        hf = {"row": "transformers in memory (fp32, no limit)", "returncode": run.returncode, "prompts": prompts,
              "peak_bytes": peak}
        if run.returncode:
            print(f"transformers row: exit {run.returncode}: {run.stderr[-2000:]}", file=sys.stderr)
        hf["summary"] = summarize(hf, naive) if not run.returncode else {}
        records.append(hf)
        save(records, a)
    print(table(records))


if __name__ == "__main__":
    main()
