"""`streamspec generate --ray`: the same job and output as the in-process path, on RayEngine."""
from __future__ import annotations

import json
import logging
import sys

from ..errors import ConfigError, StreamspecError

log = logging.getLogger("streamspec")


def generate(a) -> int:
    from tqdm.auto import tqdm

    from .engine import RayEngine

    if a.prompt is None and a.prompt_ids is None:
        raise ConfigError("give a PROMPT or --prompt-ids")
    eng = RayEngine(target=a.target, draft=a.draft if a.mode != "naive" else None, memory_budget=a.memory_budget,
                    device=a.device, cold=a.cold, prefetch_depth=a.prefetch_depth,
                    direct=getattr(a, "direct", False), address=getattr(a, "address", None))
    bar = tqdm(total=a.max_new_tokens, unit="tok", desc=f"{a.mode} (ray)", disable=None if not a.json else True,
               file=sys.stderr, leave=False)
    try:
        out = eng.generate(prompt=a.prompt, prompt_ids=a.prompt_ids, max_new_tokens=a.max_new_tokens, mode=a.mode,
                           k=a.k, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, chat=a.chat,
                           budget=a.budget, on_tokens=lambda toks: bar.update(len(toks)))
    except StreamspecError as e:
        bar.close()
        got = getattr(e, "token_ids", None)
        if got:  # keep what was generated before the failure: on stdout, then the error line on stderr
            text = getattr(e, "text", None)
            if a.json:
                print(json.dumps({"text": text, "token_ids": got, "new_tokens": len(got), "partial": True,
                                  "error": str(e)}))
            else:
                print(text if text is not None else ",".join(map(str, got)))
        raise
    finally:
        eng.close()
    bar.close()
    from ..cli import print_result

    print_result(a, out, " (Ray actors)")
    return 0
