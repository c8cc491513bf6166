"""One `streamspec generate` run on a built engine, in process (cli.py) or on Ray actors (actors/cli.py): the
progress bar, the tokens kept when it is interrupted or fails, the result on stdout and a summary on stderr."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from .errors import StreamspecError

log = logging.getLogger("streamspec")
_T0 = None


def mark_start() -> None:
    """Called by main() first: since_start's origin where the kernel's start time cannot be read."""
    global _T0
    _T0 = time.perf_counter()


def chat_flag(a) -> bool | None:
    """--chat: True, --raw: False, neither: None (the model's chat template when it has one)."""
    return True if getattr(a, "chat", False) else False if getattr(a, "raw", False) else None


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


def since_start() -> float:
    """Seconds since this process started (the kernel's start time, so imports count), else since main()."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - (_T0 or time.perf_counter())


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
