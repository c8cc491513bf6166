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


def _number(flag: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            integer: bool = False, hint: str = ""):
    """An argparse type: a finite number (an integer if `integer`) in [lo, hi] ((lo, hi] if lo_open)."""
    import math

    def parse(text: str):
        try:
            v = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {'an integer' if integer else 'a number'}, "
                                             f"got {text!r}") from None
        bad = not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or \
            (hi is not None and v > hi)
        if bad:
            if lo is not None and hi is not None:
                rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            elif lo is not None:
                rng = f"{'>' if lo_open else '>='} {lo:g}"
            else:
                rng = f"<= {hi:g}"
            raise argparse.ArgumentTypeError(f"{flag} must be {rng}{hint}, got {text}")
        return v
    return parse


_temperature = _number("--temperature", 0.0, hint=" (0 means greedy)")
_top_p = _number("--top-p", 0.0, 1.0, lo_open=True, hint=" (1 turns it off)")
_top_k = _number("--top-k", 0, integer=True, hint=" (0 turns it off)")
_seed = _number("--seed", 0, 2**63 - 1, integer=True)
_prefetch = _number("--prefetch-depth", 0, 64, integer=True, hint=" (0: no read-ahead)")
_threads = _number("--threads", 1, 4096, integer=True)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit 2, no usage dump
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


STORE_DTYPES = ["fp32", "bf16", "fp16", "int4", "int4pack", "gguf"]  # (store/convert.DTYPES)
TARGET_DTYPE_HELP = ("store dtype of a target converted on first use (a named model, a .gguf file, a HF folder): "
                     "int4pack (4-bit, close to the GGUF), gguf (the GGUF's own blocks: its exact model at its "
                     "bytes per sweep), fp32, ... (default: int4pack for named models, else fp32)")


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
    c.add_argument("--dtype", default=None, choices=STORE_DTYPES,
                   help="default: int4pack for named real models, else fp32. int4pack: 4-bit weights in the CPU "
                        "int4 kernel's layout, multiplied straight from the read buffer; gguf (GGUF sources): "
                        "the file's own blocks, dequantized as each layer is streamed (the fp32 store's model at "
                        "the file's bytes)")
    c.add_argument("--group-size", type=_positive, default=None, help="default: 32 for int4pack, 64 for int4")
    c.add_argument("--int4-scheme", default="asym", choices=["asym", "sym"],
                   help="asym: fp16 scale + zero point per group (0.5625 B/param); sym: scale only (0.53125)")
    c.add_argument("--force", action="store_true",
                   help="replace OUT if it holds a store (a folder of other files, or a file, is never replaced)")
    c.add_argument("--debug", **dbg)

    g = sub.add_parser("generate", help="generate text with a streamed target")
    g.add_argument("prompt", nargs="?")
    g.add_argument("--prompt-ids", type=_ids)
    tmpl = g.add_mutually_exclusive_group()
    tmpl.add_argument("--chat", action="store_true",
                      help="apply the model's chat template (the default when the model has one)")
    tmpl.add_argument("--raw", action="store_true", help="send the text as it is, without the chat template")
    g.add_argument("--target", default=None, help="store path, .gguf file or named real model "
                                                  "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--target-dtype", default=None, choices=STORE_DTYPES, help=TARGET_DTYPE_HELP)
    g.add_argument("--draft", default="self-int4", help="self-int4 | skip:I,J,... | ngram | mtp (DeepSeek V3's "
                                                        "own MTP layer) | a named real model (qwen2.5-coder-0.5b) | "
                                                        ".gguf file | store or HF folder")
    g.add_argument("--mode", default="chain", choices=["naive", "chain", "tree"])
    g.add_argument("--k", type=_k, default="adaptive", help="draft tokens per round, or adaptive (cost model) / ema")
    g.add_argument("--budget", type=_budget, default="adaptive",
                   help="tree mode: nodes per tree, or adaptive (cost model, up to 128)")
    g.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="greedy rounds: draft the next round while the target sweeps (auto: in chain mode, not "
                        "in tree mode)")
    g.add_argument("--max-new-tokens", type=_positive, default=128)
    g.add_argument("--temperature", type=_temperature, default=0.0, help="0 (the default) means greedy, as does anything below 1e-5")
    g.add_argument("--top-p", type=_top_p, default=1.0)
    g.add_argument("--top-k", type=_top_k, default=0)
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="most bytes of streamed weights resident at once (e.g. 200MB)")
    g.add_argument("--expert-cache", type=parse_bytes, default=None,
                   help="MoE stores: bytes of recently used routed experts kept in memory, within --memory-budget "
                        "(default: none)")
    g.add_argument("--prefetch-depth", type=_prefetch, default=None,
                   help="layers read ahead, up to 4 reads in flight at once (0: no prefetch; default: 2, or under a "
                        "memory limit as many as the limit leaves room for)")
    g.add_argument("--cold", action="store_true", help="evict each shard from the page cache before reading it")
    g.add_argument("--memory-limit", type=parse_bytes, default=None,
                   help="run under a memory cgroup of this size, page cache included (e.g. 1.2GB); the peak, "
                        "from the kernel's accounting, is reported")
    g.add_argument("--direct", action=argparse.BooleanOptionalAction, default=None,
                   help="read shards with O_DIRECT, bypassing the page cache (default: when the page cache cannot "
                        "hold a sweep's bytes: a store bigger than the memory available or than --memory-limit "
                        "leaves)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=_threads, default=None,
                   help="torch compute threads (default: the free cores minus one for the reader thread)")
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
    j.add_argument("--temperature", type=_temperature, default=0.0, help="default for lines without one")
    j.add_argument("--top-p", type=_top_p, default=1.0)
    j.add_argument("--top-k", type=_top_k, default=0)
    j.add_argument("--seed", type=_seed, default=0, help="default for lines without one")
    jt = j.add_mutually_exclusive_group()
    jt.add_argument("--chat", action="store_true",
                    help="apply the chat template to text prompts (the default when the model has one)")
    jt.add_argument("--raw", action="store_true", help='send text prompts as they are (a line\'s "raw": true too)')
    j.add_argument("--threads", type=_threads, default=None, help="torch compute threads (default: chosen)")
    j.add_argument("--target", default=None, help="store path (default: the embedded SmolLM2-135M-Instruct)")
    j.add_argument("--target-dtype", default=None, choices=STORE_DTYPES, help=TARGET_DTYPE_HELP)
    j.add_argument("--memory-budget", type=parse_bytes, default=None)
    j.add_argument("--cold", action="store_true", help="evict each shard from the page cache before reading it")
    j.add_argument("--device", default="cpu")
    j.add_argument("--ray", action="store_true", help="run on Ray actors")
    j.add_argument("--replicas", type=_positive, default=1, help="with --ray: pipelines splitting the prompts")
    j.add_argument("--address", default=None, help="with --ray: join this Ray cluster")
    j.add_argument("--debug", **dbg)
    b = sub.add_parser("bench", help="naive vs speculative vs transformers on the same prompts, measured")
    b.add_argument("--target", default=None, help="store path (default: the embedded model)")
    b.add_argument("--dtype", "--target-dtype", dest="dtype", default="",
                   help="comma-separated store dtype(s) of the target converted on first use, e.g. fp16,int4 or "
                        "int4pack,gguf (default: fp32 for the embedded model, int4pack for a named one)")
    b.add_argument("--modes", default="naive,chain,tree",
                   help="comma-separated: naive, chain, tree (adaptive budget), tree:N (N nodes); a /serial "
                        "or /overlap suffix drafts after each sweep or during it (default: during it for chain, "
                        "after it for tree)")
    b.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="most bytes of streamed weights resident at once (e.g. 150MB)")
    b.add_argument("--prefetch-depth", type=_prefetch, default=None,
                   help="units read ahead (within --memory-budget): reads overlap drafting and compute (default: "
                        "as far as memory leaves room for)")
    b.add_argument("--sweep-cost", action="store_true",
                   help="measure sweep time vs tokens per sweep (default: when a tree mode runs)")
    b.add_argument("--draft", default="self-int4")
    b.add_argument("--k", type=_k, default="adaptive")
    b.add_argument("--tokens", type=_positive, default=128)
    b.add_argument("--prompts", default=None, help="a text file, one prompt per line (a line in double quotes is "
                                                    "a JSON string, for a prompt with newlines)")
    b.add_argument("--cold", action="store_true")
    b.add_argument("--direct", action=argparse.BooleanOptionalAction, default=None,
                   help="read the store with O_DIRECT (default: when --cold, or when the page cache cannot keep a "
                        "sweep)")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers in-memory reference row")
    b.add_argument("--raw", action="store_true", help="prompts without the chat template")
    b.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server; concurrent requests share every sweep")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default: this machine only; 0.0.0.0 exposes the model to the network)")
    sv.add_argument("--port", type=_number("--port", 1, 65535, integer=True), default=8000)
    sv.add_argument("--target", default=None, help="as generate's (default: the embedded SmolLM2-135M-Instruct)")
    sv.add_argument("--target-dtype", default=None, choices=STORE_DTYPES, help=TARGET_DTYPE_HELP)
    sv.add_argument("--draft", default="self-int4", help="as generate's")
    sv.add_argument("--mode", default="chain", choices=["naive", "chain", "tree"])
    sv.add_argument("--k", type=_k, default="adaptive")
    sv.add_argument("--budget", type=_budget, default="adaptive")
    sv.add_argument("--batch-size", type=_positive, default=8, help="requests sharing each sweep")
    sv.add_argument("--max-queue", type=_positive, default=64,
                    help="requests waiting for a slot before new ones get 429")
    sv.add_argument("--max-new-tokens", type=_positive, default=256,
                    help="chat completions without max_tokens stop here (completions: 16, as OpenAI's)")
    sv.add_argument("--memory-budget", type=parse_bytes, default=None)
    sv.add_argument("--cold", action="store_true", help="evict each shard from the page cache before reading it")
    sv.add_argument("--device", default="cpu")
    sv.add_argument("--threads", type=_threads, default=None, help="torch compute threads (default: chosen)")
    sv.add_argument("--ray", action="store_true", help="run the store and verifier on Ray actors")
    sv.add_argument("--address", default=None, help="with --ray: join this Ray cluster")
    sv.add_argument("--controller-name", default="streamspec",
                    help="with --ray: the ControllerActor's name, for RayEngine.attach(NAME) in other processes")
    key = sv.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require `Authorization: Bearer KEY` on /v1/* and /metrics (prefer --api-key-file or "
                          "$STREAMSPEC_API_KEY: a key on the command line is visible to every user in `ps`)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="as --api-key, the key being the file's first line (default: $STREAMSPEC_API_KEY if set)")
    sv.add_argument("--max-body-bytes", type=parse_bytes, default=4 << 20,
                    help="largest request body; a larger one gets 413 (default: 4MiB)")
    sv.add_argument("--shutdown-timeout", type=_number("--shutdown-timeout", 0.0, lo_open=True), default=5.0,
                    help="seconds from SIGTERM or Ctrl-C to exit: requests still generating at half of it are "
                         "cancelled (finish_reason \"cancelled\"), what is still open at the end is closed "
                         "(default: 5)")
    sv.add_argument("--model-name", default=None, help="the model id clients use (default: the store's name)")
    sv.add_argument("--debug", **dbg)

    pl = sub.add_parser("plan", help="PROJECT sweeps and tokens/s for a model size and disk (not a measurement)")
    pl.add_argument("--model-bytes", type=parse_bytes, required=True, help="e.g. 35GB for a 70B INT4 model")
    pl.add_argument("--disk-gbps", type=_number("--disk-gbps", 0.0, lo_open=True), default=None,
                    help="disk read GB/s (default: from --bench)")
    pl.add_argument("--acceptance", type=_number("--acceptance", 0.0, 1.0), default=None,
                    help="per-token acceptance (default: from --bench)")
    pl.add_argument("--k", type=_positive, default=8)
    pl.add_argument("--draft-ms", type=_number("--draft-ms", 0.0), default=None,
                    help="draft ms per token (default: from --bench)")
    pl.add_argument("--compute-ms", type=_number("--compute-ms", 0.0), default=0.0,
                    help="target compute ms per sweep")
    pl.add_argument("--bench", default="bench_out/bench.json", help="a `streamspec bench` JSON for defaults")
    return p


def resolve_target(a) -> None:
    """--target-dtype: the target converted to that dtype on first use, --target then its store (so every path,
    in process or on Ray actors, a memory-limited child too, opens that store)."""
    if getattr(a, "target_dtype", None) is not None:
        from .store.default import resolve_store

        a.target = resolve_store(a.target, a.target_dtype)


def cmd_batch(a) -> int:
    from .batchjob import run

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


def chat_flag(a) -> bool | None:
    """--chat: True, --raw: False, neither: None (the model's chat template when it has one)."""
    return True if getattr(a, "chat", False) else False if getattr(a, "raw", False) else None


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


def run_generation(a, eng, ids: list[int], where: str = "") -> int:
    """Generate with a progress bar on a terminal; the text (or --json's object) on stdout, a summary on stderr.
    Ctrl-C or a failure mid-way still prints the tokens generated so far, then "interrupted" / the error."""

    from tqdm.auto import tqdm

    bar = tqdm(total=a.max_new_tokens, unit="tok", desc=a.mode + where, disable=None if not a.json else True,
               file=sys.stderr, leave=False, dynamic_ncols=True)
    got, first = [], []

    def on_tokens(toks):
        if not first:
            first.append(since_start())
        got.extend(toks)
        bar.update(len(toks))

    startup = since_start()
    try:
        out = eng.generate(prompt_ids=ids, max_new_tokens=a.max_new_tokens, mode=a.mode, k=a.k,
                           temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, budget=a.budget,
                           on_tokens=on_tokens, overlap={"auto": None, "on": True, "off": False}[a.overlap])
    except (KeyboardInterrupt, StreamspecError) as e:
        bar.close()
        tokens = getattr(e, "token_ids", None) or got
        if tokens:  # keep what was generated: on stdout, then the error line (or "interrupted") on stderr
            text = eng.decode(tokens) if getattr(e, "text", None) is None else e.text
            if a.json:
                print(json.dumps({"text": text, "token_ids": tokens, "new_tokens": len(tokens), "partial": True,
                                  "finish_reason": "interrupted" if isinstance(e, KeyboardInterrupt) else "error",
                                  **({} if isinstance(e, KeyboardInterrupt) else {"error": str(e)})}))
            else:
                print(text if text is not None else ",".join(map(str, tokens)), flush=True)
        raise
    bar.close()
    out.stats.update(startup_s=round(startup, 3), first_token_s=round(first[0], 3) if first else None,
                     threads=getattr(eng, "threads", None))
    print_result(a, out, where)
    return 0


_T0 = None


def since_start() -> float:
    """Seconds since this process started (the kernel's start time, so imports count), else since main()."""
    import time

    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - (_T0 or time.perf_counter())


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
    startup = "" if s.get("startup_s") is None else \
        f"; start-up {s['startup_s']:.1f} s, first token {s['first_token_s'] or 0:.1f} s after the command"
    log.info("%d tokens in %.2f s of generation (%.2f tok/s, start-up not included), %d sweeps, %.2f tokens/sweep, "
             "%.1f MB read%s%s", s["new_tokens"], s["wall_s"], s["tokens_per_s"], s["sweeps"],
             s["tokens_per_sweep"], s["bytes_read"] / 1e6, where, startup)


def main(argv=None) -> int:
    global _T0
    import time

    _T0 = time.perf_counter()
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
