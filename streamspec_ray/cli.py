"""The `streamspec` command line (also `python -m streamspec_ray`)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .errors import ConfigError, StreamspecError

log = logging.getLogger("streamspec")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        value = int(float(num) * _UNITS[t[len(num):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 200000000, 200MB, 1GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _count_or_policy(flag: str, what: str, policies: tuple[str, ...]):
    """An argparse type: a positive count of `what`, or one of the named policies."""
    def parse(text: str):
        if text in policies:
            return text
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a positive integer or {'/'.join(policies)}, "
                                             f"got {text!r}") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive number of {what}, got {n}")
        return n
    return parse


_k = _count_or_policy("--k", "draft tokens", ("adaptive", "cost", "ema"))
_budget = _count_or_policy("--budget", "tree nodes", ("adaptive", "cost"))


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit 2, no usage dump
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="streamspec", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    # --debug is also accepted after the subcommand (SUPPRESS: an absent flag keeps the global value)
    dbg = dict(action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs")

    c = sub.add_parser("convert", help="convert a HF folder, a .gguf file, 'default' or a named real model "
                                       "(qwen2.5-coder-1.5b, qwen2.5-coder-0.5b) into a layer store")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16", "int4", "int4pack"],
                   help="default: int4pack for named real models, else fp32. int4pack: 4-bit weights in the CPU "
                        "int4 kernel's layout, multiplied straight from the read buffer")
    c.add_argument("--group-size", type=_positive, default=None, help="default: 32 for int4pack, 64 for int4")
    c.add_argument("--int4-scheme", default="asym", choices=["asym", "sym"],
                   help="asym: fp16 scale + zero point per group (0.5625 B/param); sym: scale only (0.53125)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    c.add_argument("--debug", **dbg)

    g = sub.add_parser("generate", help="generate text with a streamed target")
    g.add_argument("prompt", nargs="?")
    g.add_argument("--prompt-ids", type=_ids)
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--target", default=None, help="store path, .gguf file or named real model "
                                                  "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default="self-int4", help="self-int4 | skip:I,J,... | ngram | a named real model "
                                                        "(qwen2.5-coder-0.5b) | .gguf file | store or HF folder")
    g.add_argument("--mode", default="chain", choices=["naive", "chain", "tree"])
    g.add_argument("--k", type=_k, default="adaptive", help="draft tokens per round, or adaptive (cost model) / ema")
    g.add_argument("--budget", type=_budget, default="adaptive",
                   help="tree mode: nodes per tree, or adaptive (cost model, up to 128)")
    g.add_argument("--max-new-tokens", type=_positive, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="most bytes of streamed weights resident at once (e.g. 200MB)")
    g.add_argument("--prefetch-depth", type=int, default=2,
                   help="layers read ahead, that many reads in flight at once (0: no prefetch)")
    g.add_argument("--cold", action="store_true", help="evict each shard from the page cache before reading it")
    g.add_argument("--memory-limit", type=parse_bytes, default=None,
                   help="run under a memory cgroup of this size, page cache included (e.g. 1.2GB); the peak, "
                        "from the kernel's accounting, is reported")
    g.add_argument("--direct", action="store_true", help="read shards with O_DIRECT (bypass the page cache)")
    g.add_argument("--device", default="cpu")
    ray = g.add_mutually_exclusive_group()
    ray.add_argument("--ray", action="store_true", help="run on Ray actors")
    ray.add_argument("--no-ray", action="store_true", help="run in-process (default)")
    g.add_argument("--address", default=None,
                   help="with --ray: join this Ray cluster (default: $RAY_ADDRESS, else start Ray in-process)")
    g.add_argument("--json", action="store_true", help="print one JSON object with the text and the stats")
    g.add_argument("--debug", **dbg)
    j = sub.add_parser("batch", help="generate for every prompt of a JSONL file, many per sweep; resumable")
    j.add_argument("input", metavar="IN.jsonl", help='one {"id", "prompt" | "messages" | "prompt_ids"} per line')
    j.add_argument("output", metavar="OUT.jsonl", help="results appended as they complete; a rerun resumes")
    j.add_argument("--batch-size", type=_positive, default=8, help="sequences sharing each sweep")
    j.add_argument("--mode", default="chain", choices=["naive", "chain", "tree"])
    j.add_argument("--draft", default="self-int4", help="self-int4 | skip:I,J,... | ngram | store or HF folder")
    j.add_argument("--k", type=_k, default="adaptive", help="draft tokens per round, or adaptive / ema")
    j.add_argument("--budget", type=_budget, default="adaptive", help="tree nodes per round (tree mode), or adaptive")
    j.add_argument("--max-new-tokens", type=_positive, default=128, help="default for lines without one")
    j.add_argument("--temperature", type=float, default=0.0, help="default for lines without one")
    j.add_argument("--top-p", type=float, default=1.0)
    j.add_argument("--top-k", type=int, default=0)
    j.add_argument("--seed", type=int, default=0, help="default for lines without one")
    j.add_argument("--chat", action="store_true", help="apply the chat template to plain prompts")
    j.add_argument("--target", default=None, help="store path (default: the embedded SmolLM2-135M-Instruct)")
    j.add_argument("--memory-budget", type=parse_bytes, default=None)
    j.add_argument("--cold", action="store_true", help="evict each shard from the page cache before reading it")
    j.add_argument("--device", default="cpu")
    j.add_argument("--ray", action="store_true", help="run on Ray actors")
    j.add_argument("--replicas", type=_positive, default=1, help="with --ray: pipelines splitting the prompts")
    j.add_argument("--address", default=None, help="with --ray: join this Ray cluster")
    j.add_argument("--debug", **dbg)
    b = sub.add_parser("bench", help="naive vs speculative vs transformers on the same prompts, measured")
    b.add_argument("--target", default=None, help="store path (default: the embedded model)")
    b.add_argument("--dtype", default="fp32", help="store dtype(s) for the embedded model, e.g. fp16,int4")
    b.add_argument("--modes", default="naive,chain,tree",
                   help="comma-separated: naive, chain, tree (adaptive budget), tree:N (N nodes)")
    b.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="most bytes of streamed weights resident at once (e.g. 150MB)")
    b.add_argument("--prefetch-depth", type=int, default=2,
                   help="units read ahead (within --memory-budget): reads overlap drafting and compute")
    b.add_argument("--sweep-cost", action="store_true",
                   help="measure sweep time vs tokens per sweep (default: when a tree mode runs)")
    b.add_argument("--draft", default="self-int4")
    b.add_argument("--k", type=_k, default="adaptive")
    b.add_argument("--tokens", type=_positive, default=128)
    b.add_argument("--prompts", default=None, help="a text file, one prompt per line")
    b.add_argument("--cold", action="store_true")
    b.add_argument("--direct", action="store_true")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers in-memory reference row")
    b.add_argument("--raw", action="store_true", help="prompts without the chat template")
    b.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")

    pl = sub.add_parser("plan", help="PROJECT sweeps and tokens/s for a model size and disk (not a measurement)")
    pl.add_argument("--model-bytes", type=parse_bytes, required=True, help="e.g. 35GB for a 70B INT4 model")
    pl.add_argument("--disk-gbps", type=float, default=None, help="disk read GB/s (default: from --bench)")
    pl.add_argument("--acceptance", type=float, default=None, help="per-token acceptance (default: from --bench)")
    pl.add_argument("--k", type=_positive, default=8)
    pl.add_argument("--draft-ms", type=float, default=None, help="draft ms per token (default: from --bench)")
    pl.add_argument("--compute-ms", type=float, default=0.0, help="target compute ms per sweep")
    pl.add_argument("--bench", default="bench_out/bench.json", help="a `streamspec bench` JSON for defaults")
    return p


def cmd_batch(a) -> int:
    from .batchjob import run

    return run(a)


def cmd_bench(a) -> int:
    from . import bench

    prompts = None
    if a.prompts:
        try:
            with open(a.prompts) as f:
                prompts = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"cannot read --prompts: {e}") from None
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        mode, _, budget = m.partition(":")
        if mode not in ("naive", "chain", "tree") or (budget and not (mode == "tree" and budget.isdigit()
                                                                        and int(budget) > 0)):
            raise ConfigError(f"--modes: unknown mode {m!r} (naive, chain, tree, tree:N with N nodes)")
    rec = bench.run(target=a.target, dtypes=[d for d in a.dtype.split(",") if d], modes=modes, draft=a.draft,
                    k=a.k, tokens=a.tokens, prompts=prompts, cold=a.cold, direct=a.direct, hf=not a.no_hf,
                    chat=not a.raw, out_dir=a.out, sweep_cost=True if a.sweep_cost else None,
                    memory_budget=a.memory_budget, prefetch_depth=a.prefetch_depth)
    print(bench.markdown(rec))
    log.info("wrote %s/bench.json and %s/bench.png", a.out, a.out)
    return 0 if rec["all_identical"] else 1


def cmd_plan(a) -> int:
    from . import plan

    measured = {}
    if os.path.exists(a.bench):
        measured = plan.from_bench(a.bench)
    inputs, sources = {"model_bytes": float(a.model_bytes)}, {}
    for key, given, scale in (("disk_gbps", a.disk_gbps, 1), ("acceptance", a.acceptance, 1),
                              ("draft_s_per_token", a.draft_ms, 1e-3)):
        if given is not None:
            inputs[key] = given * scale
        elif key in measured:
            inputs[key], sources[key] = measured[key], f"measured in {a.bench}"
        elif key == "draft_s_per_token":
            inputs[key] = 0.0
        else:
            raise ConfigError(f"--{key.replace('_', '-')} is needed (no {a.bench} to take it from)")
    if not 0 <= inputs["acceptance"] < 1 + 1e-9:
        raise ConfigError("--acceptance must be in [0, 1]")
    inputs["compute_s_per_sweep"] = a.compute_ms * 1e-3
    p = plan.project(inputs["model_bytes"], inputs["disk_gbps"], inputs["acceptance"], a.k,
                     inputs["draft_s_per_token"], inputs["compute_s_per_sweep"])
    print(plan.report(p, inputs, sources))
    return 0


def cmd_convert(a) -> int:
    from .store.convert import convert

    m = convert(a.src, a.out, dtype=a.dtype, group_size=a.group_size, force=a.force,
                symmetric=a.int4_scheme == "sym")
    total = sum(u.bytes for u in m.units)
    print(f"wrote {a.out}: {m.args.model_type}, {m.args.num_hidden_layers} layers, {m.dtype}, "
          f"{len(m.units)} shards, {total / 1e6:.1f} MB")
    return 0


def cmd_generate(a) -> int:
    from tqdm.auto import tqdm

    from .runtime.memlimit import CGROUP_ENV

    if a.memory_limit is not None and os.environ.get(CGROUP_ENV) is None:  # (not yet in the limited child)
        return generate_limited(a)
    if a.ray:
        from .actors.cli import generate

        return generate(a)
    if a.prompt is None and a.prompt_ids is None:
        raise ConfigError("give a PROMPT or --prompt-ids")
    from .engine import Engine

    eng = Engine(target=a.target, draft=a.draft if a.mode != "naive" else None, memory_budget=a.memory_budget,
                 device=a.device, cold=a.cold, prefetch_depth=a.prefetch_depth, direct=a.direct)
    bar = tqdm(total=a.max_new_tokens, unit="tok", desc=a.mode, disable=None if not a.json else True,
               file=sys.stderr, leave=False)
    out = eng.generate(prompt=a.prompt, prompt_ids=a.prompt_ids, max_new_tokens=a.max_new_tokens, mode=a.mode,
                       k=a.k, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, chat=a.chat,
                       budget=a.budget, on_tokens=lambda toks: bar.update(len(toks)))
    bar.close()
    print_result(a, out)
    return 0


def generate_limited(a) -> int:
    """--memory-limit: resolve (and convert, on first use) the stores here, evict their files from the page cache,
    then run this same command in a child placed in a memory cgroup of that size before it starts, so everything
    it holds, page cache included, is charged to it; report the kernel's peak."""
    from .runtime import memlimit
    from .store.default import resolve_store
    from .store import sources

    reason = memlimit.available()
    if reason is not None:
        raise ConfigError(f"--memory-limit: {reason}")
    target = resolve_store(a.target)
    evict = [target]
    if a.mode != "naive" and (a.draft in sources.NAMED or a.draft.endswith(".gguf") or os.path.isdir(a.draft)):
        draft = resolve_store(a.draft) if not os.path.isdir(a.draft) else a.draft
        evict.append(draft)
    argv = [sys.executable, "-m", "streamspec_ray"] + (a.argv or [])
    run = memlimit.run_limited(argv, a.memory_limit, evict_paths=evict)
    peak = "unknown" if run.peak_bytes is None else f"{run.peak_bytes / 1e9:.3f} GB"
    if run.oom_killed:
        raise StreamspecError(f"killed by the kernel: the run needed more than --memory-limit "
                              f"{a.memory_limit / 1e9:.3f} GB (peak {peak}); raise it or lower --memory-budget")
    log.info("memory limit %.3f GB (cgroup, page cache included): peak %s", a.memory_limit / 1e9, peak)
    return run.returncode


def print_result(a, out, where: str = "") -> None:
    """The text (or the JSON object) on stdout, a one-line summary on stderr."""
    if getattr(a, "memory_limit", None) is not None:  # (in the limited child: its own peak so far)
        from .runtime.memlimit import own_cgroup_peak
        out.stats["memory"] = {"limit_bytes": a.memory_limit, "peak_bytes": own_cgroup_peak(),
                               "accounting": "memory cgroup, page cache included"}
    if a.json:
        print(json.dumps(out.stats))
        return
    print(out.text if out.text is not None else ",".join(map(str, out.token_ids)))
    s = out.stats
    log.info("%d tokens in %.2f s (%.2f tok/s), %d sweeps, %.2f tokens/sweep, %.1f MB read%s",
             s["new_tokens"], s["wall_s"], s["tokens_per_s"], s["sweeps"], s["tokens_per_sweep"],
             s["bytes_read"] / 1e6, where)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if a.debug else logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return {"convert": cmd_convert, "generate": cmd_generate, "batch": cmd_batch, "bench": cmd_bench,
                "plan": cmd_plan}[a.cmd](a)
    except StreamspecError as e:
        if a.debug:
            raise
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
