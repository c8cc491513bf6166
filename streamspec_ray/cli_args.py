"""The `streamspec` command line's arguments: the parser of every subcommand, and the argparse types that check
each value as it is parsed (a byte count, a positive count or a policy, a number in range), so that a bad flag is
one `error:` line before anything loads, and the checks across flags that can run that early too
(check_stage_flags). The commands are in cli.py."""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = "The `streamspec` command line (also `python -m streamspec_ray`)."
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


def _split(text: str) -> str:
    """--split "0:12,12:24": half-open layer ranges that follow each other from layer 0. Where the last one must
    end (the model's layer count) is checked once the store is open."""
    from .errors import ConfigError
    from .runtime.split import parse_split

    try:
        parse_split(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--split: ")) from None
    return text


def _stage_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=_positive, default=None, metavar="N",
                   help="with --ray: the target's layers split into N pipeline stages, one actor each (on the nodes "
                        "with the streamspec_stage resource, each node's share of the bytes set by its Ray memory)")
    p.add_argument("--split", type=_split, default=None, metavar="RANGES",
                   help="with --ray: the stages' layer ranges, half-open START:END, e.g. 0:12,12:24 (instead of "
                        "shares by memory)")


def check_stage_flags(a) -> None:
    """--stages / --split: Ray only, and the same number of stages if both are given (before any loading)."""
    from .errors import ConfigError

    stages, split = getattr(a, "stages", None), getattr(a, "split", None)
    for flag, value in (("--stages", stages), ("--split", split)):
        if value is not None and not getattr(a, "ray", False):
            raise ConfigError(f"{flag} needs --ray (stages are Ray actors)")
    if stages is not None and split is not None and stages != len(split.split(",")):
        raise ConfigError(f"--stages {stages} but --split gives {len(split.split(','))} ranges")


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
                     "bytes per sweep), fp32, ... (default: int4pack for named models and 4-bit GGUF files, "
                     "else fp32)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="streamspec", description=DESCRIPTION)
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    # --debug is also accepted after the subcommand (SUPPRESS: an absent flag keeps the global value)
    dbg = dict(action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs")

    c = sub.add_parser("convert", help="convert a HF folder, a .gguf file, 'default' or a named real model "
                                       "(qwen2.5-coder-1.5b, qwen2.5-coder-0.5b) into a layer store")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--dtype", default=None, choices=STORE_DTYPES,
                   help="default: int4pack for named real models and 4-bit GGUF files (Q4_0, Q4_1, Q4_K_S, "
                        "Q4_K_M), else fp32. int4pack: 4-bit weights in the CPU "
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
    _stage_flags(g)
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
    _stage_flags(j)
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
    _stage_flags(sv)
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
