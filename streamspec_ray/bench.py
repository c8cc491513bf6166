"""`streamspec bench`: one run, same prompts and store, every mode side by side, all figures measured here.

Rows: the store's raw cold read bandwidth (the physical limit of a sweep, read with as many reads in flight as
the prefetcher keeps), each generation mode, and
transformers' in-memory `generate` on the same weights. Writes a JSON record, a PNG chart and prints a
markdown table.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import ConfigError
from .runtime.embedding import by_rows, head_is_the_table
from .runtime.prefetch import MAX_READERS
from .store import shard
from .store.default import resolve_store
from .store.store import LayerStore

log = logging.getLogger("streamspec")

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "What is the capital of France? Tell me about it.",
    "List three uses of the Python programming language.",
    "Summarize the story of Cinderella in a few sentences.",
]


def raw_cold_bandwidth(store: LayerStore, repeats: int = 3, readers: int = 1, direct: bool = False) -> dict:
    """Evict, then read every streamed shard once with plain reads (no checksum, no parsing), in order with
    `readers` reads in flight at once, as the engine's prefetcher reads at its depth: bytes/s. direct: with
    O_DIRECT, as the engine reads with --direct."""
    units = list(store.stream_units)
    if by_rows(store, torch.float32) and head_is_the_table(store):  # (as StreamingExecutor streams it, fp32)
        units.append(store.manifest.unit("embed"))
    size = max(u.bytes for u in units)
    local = threading.local()

    def read(u):
        local.buf = shard.read_buffer(size, reuse=getattr(local, "buf", None))
        shard.read_into(store.path(u), u.bytes, out=local.buf, direct=direct)

    times = []
    with ThreadPoolExecutor(max(readers, 1)) as pool:
        for _ in range(repeats):
            for u in units:
                shard.evict(store.path(u))
            t0 = time.perf_counter()
            list(pool.map(read, units))
            times.append(time.perf_counter() - t0)
    total = sum(u.bytes for u in units)
    t = statistics.median(times)
    return {"bytes": total, "seconds": t, "gb_per_s": total / t / 1e9, "runs": times, "readers": max(readers, 1)}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def parse_mode(spec: str) -> tuple[str, int | str, bool | None]:
    """A --modes entry -> (mode, tree budget, overlap): "tree:64/serial" -> ("tree", 64, False), "tree" ->
    ("tree", "adaptive", None); no suffix gives overlap None (the engine's default). A bad entry: ConfigError."""
    head, _, suffix = spec.partition("/")
    mode, _, budget = head.partition(":")
    overlap = {"": None, "serial": False, "overlap": True}.get(suffix, "?")
    if mode not in ("naive", "chain", "tree") or overlap == "?" or (
            budget and not (mode == "tree" and budget.isdigit() and int(budget) > 0)):
        raise ConfigError(f"--modes: unknown mode {spec!r} (naive, chain, tree, tree:N with N nodes, each "
                          f"optionally /serial or /overlap)")
    return mode, int(budget) if budget else "adaptive", overlap


def _row(name: str, results: list, ref: dict | None, raw_gbps: float | None) -> dict:
    tokens = sum(r.stats["new_tokens"] for r in results)
    wall = sum(r.stats["wall_s"] for r in results)
    sweeps = sum(r.stats["sweeps"] for r in results)
    bytes_read = sum(r.stats["bytes_read"] for r in results)
    st = [r.stats["stats"] for r in results]
    io, prep, stall, sweep_s, compute = (sum(s[k] for s in st)
                                         for k in ("io_s", "prep_s", "stall_s", "sweep_s", "compute_s"))
    achieved = bytes_read / sweep_s / 1e9 if sweep_s else None
    # The pipeline bound: with drafting and stalls hidden a run takes the larger of its sweeps' read time and
    # compute time. With drafting: where the draft computes on the sweep's cores between sweeps (no lookahead),
    # a round takes at least the larger of its reads and its drafting plus compute; the gap between the two
    # bounds is what drafting costs. The I/O limit: its bytes at the store's raw cold bandwidth (raw_gbps).
    bound = max(io + prep, compute)
    drafted = sum(s["draft_s"] for s in st)
    with_draft = max(io + prep, compute + drafted)
    io_limit = bytes_read / (raw_gbps * 1e9) if raw_gbps else None
    return {
        "name": name, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "sweeps": sweeps,
        "tokens_per_sweep": tokens / sweeps if sweeps else None, "bytes_per_token": bytes_read / tokens,
        "achieved_gb_per_s": achieved, "vs_raw": achieved / raw_gbps if achieved and raw_gbps else None,
        "overlap_efficiency": 1 - stall / (io + prep) if io + prep else None, "draft_s": drafted,
        "io_s": io, "stall_s": stall, "sweep_s": sweep_s, "compute_s": compute,
        "pipeline_bound_s": bound, "x_pipeline_bound": _ratio(wall, bound),
        "draft_bound_s": with_draft, "x_draft_bound": _ratio(wall, with_draft),
        "raw_gb_per_s": raw_gbps, "io_limit_s": io_limit, "x_io_limit": _ratio(wall, io_limit) if io_limit else None,
        # drafting per round: on the critical path (the round waited for it) and done during the sweep
        "draft_ms_per_round": 1e3 * drafted / sweeps if sweeps else None,
        "hidden_ms_per_round": 1e3 * sum(s["draft_hidden_s"] for s in st) / sweeps if sweeps else None,
        "reuse_rate": _ratio(sum(s["lookahead_reused"] for s in st), sum(s["lookahead_prepared"] for s in st)),
        "acceptance": statistics.mean(r.stats["acceptance_rate"] for r in results),
        "proposed": sum(sum(s["k_per_round"]) for s in st),
        "identical": None if ref is None else all(r.token_ids == ref[i] for i, r in enumerate(results)),
        "token_ids": [r.token_ids for r in results],
    }


def run(target=None, dtypes=(None,), modes=("naive", "chain"), draft="self-int4", k="adaptive", tokens=128,
        prompts=None, cold=False, direct=None, hf=True, chat=True, out_dir="bench_out",
        sweep_cost: bool | None = None, memory_budget: float | None = None, prefetch_depth: int | None = None) -> dict:
    """modes: naive, chain, tree (adaptive budget) or tree:N (budget N). dtypes: the store dtypes of a target
    converted on first use (None: fp32 for the embedded model, int4pack for a named one; a store is its own).
    sweep_cost (default: when a tree mode runs) also measures the target's sweep time versus the number of tokens
    in the sweep (1..128). direct and prefetch_depth None: as the engine chooses (O_DIRECT when cold or when the
    page cache cannot keep a sweep; read-ahead as far as memory leaves room for), reported per row."""
    from .engine import Engine

    prompts = prompts or PROMPTS
    if sweep_cost is None:
        sweep_cost = any(m.startswith("tree") for m in modes)
    record = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "threads": torch.get_num_threads()},
              "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "config": {"target": target, "dtypes": list(dtypes), "modes": list(modes), "draft": draft, "k": k,
                         "tokens": tokens, "prompts": prompts, "cold": cold, "direct": direct, "chat": chat,
                         "memory_budget": memory_budget, "prefetch_depth": prefetch_depth},
              "rows": []}
    for dtype in dtypes:
        store = LayerStore(resolve_store(target, dtype))
        dtype = store.manifest.dtype  # (None above: the target's default)
        # (the raw read as the engine's reads will go: O_DIRECT where it will choose it, up to 4 reads at once)
        raw_direct = direct if direct is not None else cold
        readers = MAX_READERS if prefetch_depth is None else max(1, min(prefetch_depth, MAX_READERS))
        raw = raw_cold_bandwidth(store, readers=readers, direct=raw_direct)
        how = "O_DIRECT" if raw_direct else "cold"
        fs = shard.filesystem(store.root)  # (tmpfs: the "disk" read is a copy from memory)
        record["rows"].append({"name": f"{dtype} raw {how} read ({raw['readers']} at once)", "dtype": dtype,
                               "raw": raw, "filesystem": fs})
        log.info("%s: raw cold read %.2f GB/s (%.0f MB in %.3f s)%s", dtype, raw["gb_per_s"], raw["bytes"] / 1e6,
                 raw["seconds"], f", from {fs}: memory, not a disk" if fs in shard.MEMORY_FILESYSTEMS else "")
        ref = None
        engines = {}
        before = raw
        for spec in modes:
            mode, budget, overlap = parse_mode(spec)
            with_draft = mode != "naive"
            if with_draft not in engines:  # one engine per kind: the draft is built once
                engines[with_draft] = Engine(target=store.root, draft=draft if with_draft else None, cold=cold,
                                             direct=direct, memory_budget=memory_budget,
                                             prefetch_depth=prefetch_depth)
            eng = engines[with_draft]
            results = [eng.generate(**_prompt_kw(p), max_new_tokens=tokens, mode=mode, k=k, budget=budget, chat=chat,
                                    overlap=overlap) for p in prompts]
            if ref is None:
                ref = [r.token_ids for r in results]
            name = f"{dtype} {mode}" + (f" budget {budget}" if mode == "tree" else "")
            name += {None: "", False: ", serial", True: ", overlap"}[overlap]
            # The disk's speed drifts within a run (this project's cloud VM reads short bursts at twice its
            # sustained rate), so a row's I/O limit takes the raw bandwidth measured just before and after it.
            after = raw_cold_bandwidth(store, readers=raw["readers"], direct=raw_direct)
            near = raw["bytes"] / statistics.median(before["runs"] + after["runs"]) / 1e9
            before = after
            row = _row(name, results, ref, near)
            ex = eng.executor
            row.update(dtype=dtype, mode=mode, budget=budget if mode == "tree" else None,
                       overlap=overlap if overlap is not None else mode == "chain",
                       # what the engine chose, where the flags left it to
                       chosen={"direct": bool(ex.direct), "prefetch_depth": ex.depth, "held_units": len(ex.held),
                               "units": len(ex.sweep_names),
                               "memory_plan": ex.memory_plan.as_dict() if ex.memory_plan else None,
                               "threads_why": ex.threads_why(eng.threads_why)})
            record["rows"].append(row)
            log.info("%s %s: %.2f tok/s, %.2f tok/sweep, identical=%s", dtype, mode, row["tokens_per_s"],
                     row["tokens_per_sweep"], row["identical"])
        if sweep_cost:
            eng = engines.get(False) or next(iter(engines.values()))
            record.setdefault("sweep_cost", {})[dtype] = sweep_costs(eng.executor)
        if hf:
            record["rows"].append(_hf_row(store, prompts, tokens, chat, ref, dtype))
    _check_identical(record)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(record, f, indent=1)
    _plot(record, os.path.join(out_dir, "bench.png"))
    return record


def sweep_costs(executor, sizes=(1, 2, 4, 8, 16, 32, 64, 128), context: int = 64, repeats: int = 3) -> list[dict]:
    """The target's sweep time versus the tokens it carries, after `context` cached tokens (as in a round):
    the median of `repeats` sweeps per size (cold if the executor is). A streamed sweep costs about the same
    for few or many tokens until compute overtakes the reads: the curve tree budgets are chosen from."""
    out = []
    ids = [(7 * i + 3) % executor.args.vocab_size for i in range(context + max(sizes))]
    cache = executor.new_cache()
    executor.sweep(ids[:context], cache)
    for n in sizes:
        times, read = [], 0
        for _ in range(repeats):
            cache.truncate(context)
            _, st = executor.sweep(ids[context : context + n], cache, logits_from=n - 1)
            times.append(st.wall_s)
            read = st.bytes_read
        out.append({"tokens": n, "seconds": statistics.median(times), "runs": times, "bytes_read": read})
        log.info("sweep of %d tokens: %.3f s (median of %d)", n, out[-1]["seconds"], repeats)
    return out


def _hf_row(store, prompts, tokens, chat, ref, dtype) -> dict:
    from .engine import encode_prompt, load_tokenizer
    from .hfref import hf_model

    model, tok = hf_model(store), load_tokenizer(store)
    outs, wall, n = [], 0.0, 0
    eos = store.args.eos_token_id
    for p in prompts:
        ids = encode_prompt(tok, **_prompt_kw(p), chat=chat)
        t0 = time.perf_counter()
        with torch.no_grad():
            o = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                               pad_token_id=eos[0] if eos else 0)
        wall += time.perf_counter() - t0
        outs.append(o[0, len(ids):].tolist())
        n += len(outs[-1])
    identical = None if ref is None else all(a == b for a, b in zip(outs, ref))
    log.info("%s transformers generate (in memory): %.2f tok/s, identical=%s", dtype, n / wall, identical)
    return {"name": f"{dtype} transformers in-memory", "dtype": dtype, "mode": "hf", "tokens": n, "wall_s": wall,
            "tokens_per_s": n / wall, "identical": identical}


def _prompt_kw(p) -> dict:
    """A prompt is text, or a list of token ids (for stores without a tokenizer)."""
    return {"prompt": None, "prompt_ids": p} if isinstance(p, list) else {"prompt": p, "prompt_ids": None}


def _check_identical(record) -> None:
    bad = [r["name"] for r in record["rows"] if r.get("identical") is False]
    record["all_identical"] = not bad
    if bad:
        log.warning("outputs differ from naive in: %s", ", ".join(bad))


def _commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def markdown(record: dict) -> str:
    lines = ["| row | tokens | wall s | tok/s | ms/token | sweeps | tok/sweep | MB read/token | GB/s in sweeps "
             "| vs raw cold | overlap eff. | draft ms/round (critical / hidden) | reuse "
             "| pipeline bound s (wall x) | bound with drafting s (wall x) | I/O limit s at raw GB/s (wall x) "
             "| = naive |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        if "raw" in r:
            raw = r["raw"]
            lines.append(f"| {r['name']} | - | {raw['seconds']:.3f} | - | - | - | - | {raw['bytes'] / 1e6:.0f} per sweep "
                         f"| {raw['gb_per_s']:.2f} | 1.00 | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['name']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.2f} | "
                     f"{1e3 * r['wall_s'] / r['tokens']:.0f} | "
                     f"{_fmt(r.get('sweeps'), 'd')} | {_fmt(r.get('tokens_per_sweep'))} | "
                     f"{_fmt(r['bytes_per_token'] / 1e6 if r.get('bytes_per_token') else None, '.1f')} | "
                     f"{_fmt(r.get('achieved_gb_per_s'))} | {_fmt(r.get('vs_raw'))} | "
                     f"{_fmt(r.get('overlap_efficiency'))} | "
                     f"{_fmt(r.get('draft_ms_per_round') if r.get('mode') != 'naive' else None, '.0f')} / "
                     f"{_fmt(r.get('hidden_ms_per_round') if r.get('mode') != 'naive' else None, '.0f')} | "
                     f"{_fmt(r.get('reuse_rate'))} | "
                     f"{_fmt(r.get('pipeline_bound_s'))} ({_fmt(r.get('x_pipeline_bound'))}) | "
                     f"{_fmt(r.get('draft_bound_s'))} ({_fmt(r.get('x_draft_bound'))}) | "
                     f"{_fmt(r.get('io_limit_s'))} at {_fmt(r.get('raw_gb_per_s'))} ({_fmt(r.get('x_io_limit'))}) | "
                     f"{r.get('identical')} |")
    chosen = {(c["direct"], c["prefetch_depth"], c.get("held_units", 0), c.get("units", 0))
              for r in record["rows"] if (c := r.get("chosen"))}
    cfg = record.get("config", {})
    how = ("the engine's choice" if cfg.get("direct") is None and cfg.get("prefetch_depth") is None
           else "as --direct / --prefetch-depth asked, the engine choosing the rest")
    for direct, depth, held, units in sorted(chosen):
        lines += ["", f"reads: {'O_DIRECT' if direct else 'through the page cache'}, {held} of {units} units held "
                  f"in memory, {depth} units read ahead ({how})"]
    for dtype, curve in record.get("sweep_cost", {}).items():
        lines += ["", f"{dtype} target sweep time vs tokens in the sweep (median): "
                  + ", ".join(f"{c['tokens']}: {c['seconds'] * 1e3:.0f} ms" for c in curve)]
    return "\n".join(lines)


def _plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["rows"] if "tokens_per_s" in r]
    curves = record.get("sweep_cost", {})
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(14 if curves else 8, 0.5 * len(rows) + 2),
                             squeeze=False)
    ax = axes[0][0]
    ax.barh([r["name"] for r in rows], [r["tokens_per_s"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"], i, f" {r['tokens_per_s']:.2f}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (measured)")
    cfg = record["config"]
    ax.set_title(f"streamspec bench: {cfg['tokens']} tokens x {len(cfg['prompts'])} prompts, "
                 f"{'cold' if cfg['cold'] else 'warm'}, commit {record['commit']}")
    if curves:
        cx = axes[0][1]
        for dtype, curve in curves.items():
            cx.plot([c["tokens"] for c in curve], [c["seconds"] * 1e3 for c in curve], "o-", label=dtype)
        cx.set_xscale("log", base=2)
        cx.set_xlabel("tokens verified in one sweep")
        cx.set_ylabel("target sweep time, ms (median, measured)")
        cx.set_ylim(bottom=0)
        cx.set_title("sweep cost vs tokens: what a tree budget buys")
        cx.legend()
        cx.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
