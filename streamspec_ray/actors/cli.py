"""`streamspec generate --ray`: the same job and output as the in-process path, on RayEngine (with --stages /
--split: the target's layers on pipeline stage actors, actors/stages.py)."""
from __future__ import annotations

import logging

log = logging.getLogger("streamspec")


def generate(a) -> int:
    from ..cli_run import chat_flag, run_generation
    from .engine import RayEngine

    eng = RayEngine(target=a.target, draft=a.draft if a.mode != "naive" else None, memory_budget=a.memory_budget,
                    device=a.device, cold=a.cold, prefetch_depth=a.prefetch_depth,
                    direct=getattr(a, "direct", None), threads=a.threads or "auto",
                    expert_cache=getattr(a, "expert_cache", None), address=getattr(a, "address", None),
                    stages=getattr(a, "stages", None), split=getattr(a, "split", None))
    try:
        ids = eng.encode(a.prompt, a.prompt_ids, chat_flag(a))
        eng.check_length(len(ids), a.max_new_tokens)
        return run_generation(a, eng, ids, " (Ray actors)")
    finally:
        eng.close()
