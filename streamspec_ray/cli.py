"""The `streamspec` command line (also `python -m streamspec_ray`)."""
from __future__ import annotations

import json
import logging
import os
import sys

from .cli_args import STORE_DTYPES, build_parser, check_stage_flags
from .cli_run import chat_flag, mark_start, run_generation
from .errors import ConfigError, StreamspecError

log = logging.getLogger("streamspec")


def resolve_target(a) -> None:
    """--target-dtype: the target converted to that dtype on first use, --target then its store (so every path,
    in process or on Ray actors, a memory-limited child too, opens that store)."""
    if getattr(a, "target_dtype", None) is not None:
        from .store.default import resolve_store

        a.target = resolve_store(a.target, a.target_dtype)


def cmd_batch(a) -> int:
    from .batchjob import run

    check_stage_flags(a)
    resolve_target(a)
    return run(a)


def cmd_bench(a) -> int:
    from . import bench

    prompts = None
    if a.prompts:
        try:
            with open(a.prompts) as f:  # (a line in double quotes is a JSON string: a prompt with newlines)
                prompts = [json.loads(line) if line.startswith('"') else line.strip() for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"cannot read --prompts: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--prompts: a line in double quotes must be a JSON string: {e}") from None
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:  # (every entry checked before any measuring)
        bench.parse_mode(m)
    dtypes = [d for d in a.dtype.split(",") if d] or [None]
    bad = [d for d in dtypes if d is not None and d not in STORE_DTYPES]
    if bad:
        raise ConfigError(f"--dtype {bad[0]!r} is not a store dtype ({', '.join(STORE_DTYPES)})")
    rec = bench.run(target=a.target, dtypes=dtypes, modes=modes, draft=a.draft,
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
        try:
            measured = plan.from_bench(a.bench)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"cannot read the bench record {a.bench} ({type(e).__name__}: {e}): give "
                              f"--disk-gbps and --acceptance, or another --bench") from None
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


def cmd_serve(a) -> int:
    from .serve import serve

    check_stage_flags(a)
    resolve_target(a)
    return serve(a)


def cmd_convert(a) -> int:
    from .store.convert import convert

    m = convert(a.src, a.out, dtype=a.dtype, group_size=a.group_size, force=a.force,
                symmetric=a.int4_scheme == "sym")
    total = sum(u.bytes for u in m.units)
    print(f"wrote {a.out}: {m.args.model_type}, {m.args.num_hidden_layers} layers, {m.dtype}, "
          f"{len(m.units)} shards, {total / 1e6:.1f} MB")
    return 0


def check_prompt_flags(a) -> None:
    """What can be refused before any loading: a missing or empty prompt (the sampling values were range-checked
    as the flags were parsed)."""
    if a.prompt is None and a.prompt_ids is None:
        raise ConfigError("give a PROMPT or --prompt-ids")
    if a.prompt is not None and a.prompt_ids is not None:
        raise ConfigError("give a PROMPT or --prompt-ids, not both")
    if a.prompt is not None and not a.prompt.strip():
        raise ConfigError("the prompt is empty")
    if a.prompt_ids is not None and not a.prompt_ids:
        raise ConfigError("--prompt-ids is empty")


def cmd_generate(a) -> int:
    from .runtime.memlimit import CGROUP_ENV

    check_prompt_flags(a)
    check_stage_flags(a)
    resolve_target(a)
    if a.memory_limit is not None and os.environ.get(CGROUP_ENV) is None:  # (not yet in the limited child)
        return generate_limited(a)
    if a.ray:
        from .actors.cli import generate

        return generate(a)
    from .engine import Engine

    eng = Engine(target=a.target, draft=None, memory_budget=a.memory_budget, device=a.device, cold=a.cold,
                 prefetch_depth=a.prefetch_depth, direct=a.direct, threads=a.threads or "auto",
                 expert_cache=a.expert_cache)
    # the prompt is checked against the tokenizer and the context before the draft is built
    ids = eng.encode(a.prompt, a.prompt_ids, chat_flag(a))
    eng.check_length(len(ids), a.max_new_tokens)
    if a.mode != "naive":
        eng.set_draft(a.draft)
    return run_generation(a, eng, ids)


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


def main(argv=None) -> int:
    mark_start()
    a = build_parser().parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    root = logging.getLogger()
    if not root.handlers:  # (a program or test harness that set up logging keeps its own handlers)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        show_status = a.debug or sys.stderr.isatty()  # what is being done (loading, converting): on a terminal
        handler.addFilter(lambda record: show_status or not getattr(record, "status", False))
        root.addHandler(handler)
        root.setLevel(logging.DEBUG if a.debug else logging.INFO)
    for noisy in ("transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return {"convert": cmd_convert, "generate": cmd_generate, "batch": cmd_batch, "bench": cmd_bench,
                "plan": cmd_plan, "serve": cmd_serve}[a.cmd](a)
    except StreamspecError as e:
        if a.debug:
            raise
        sys.stderr.write(f"error: {e}\n")
        return 2
    except OSError as e:  # a path that cannot be read or written (read-only, full, missing): one line
        if a.debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        sys.stderr.write(f"error: {e.strerror or e}{where}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
