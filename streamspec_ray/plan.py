"""`streamspec plan`: project naive and speculative streaming speed for a model you have not run.

This is arithmetic, not a measurement. A sweep of an I/O-bound target costs about model_bytes / disk
bandwidth; a chain round with K drafts costs one sweep plus K draft steps and emits
E(K) = (1 - a^(K+1)) / (1 - a) tokens at per-position acceptance a. The inputs default to figures measured
by `streamspec bench` (its JSON), and the output names every input and where it came from.
"""
from __future__ import annotations

import json

from .speculative.draft_length import expected_tokens


def from_bench(path: str) -> dict:
    """Measured inputs from a bench record: raw cold GB/s, chain acceptance, draft seconds per token."""
    with open(path) as f:
        rec = json.load(f)
    out = {}
    raws = [r["raw"]["gb_per_s"] for r in rec["rows"] if "raw" in r]
    if raws:
        out["disk_gbps"] = raws[0]
    chains = [r for r in rec["rows"] if r.get("mode") == "chain"]
    if chains:
        c = chains[0]
        out["acceptance"] = c["acceptance"]
        if c.get("draft_s") and c.get("proposed"):
            out["draft_s_per_token"] = c["draft_s"] / c["proposed"]
    return out


def project(model_bytes: float, disk_gbps: float, acceptance: float, k: int = 8, draft_s_per_token: float = 0.0,
            compute_s_per_sweep: float = 0.0) -> dict:
    sweep_s = model_bytes / (disk_gbps * 1e9) + compute_s_per_sweep
    best = max(range(1, 33), key=lambda kk: expected_tokens(acceptance, kk) / (sweep_s + kk * draft_s_per_token))
    rows = {}
    for name, kk in (("naive", 0), (f"chain K={k}", k), (f"chain best K={best}", best)):
        e = expected_tokens(acceptance, kk) if kk else 1.0
        t = sweep_s + kk * draft_s_per_token
        rows[name] = {"k": kk, "tokens_per_sweep": e, "s_per_round": t, "tokens_per_s": e / t,
                      "sweeps_per_1000_tokens": 1000 / e, "bytes_per_1000_tokens": 1000 / e * model_bytes}
    return {"sweep_s": sweep_s, "rows": rows}


def report(p: dict, inputs: dict, sources: dict) -> str:
    lines = ["PROJECTION (computed, not measured). Inputs:"]
    for k, v in inputs.items():
        lines.append(f"  {k} = {v:.4g}  ({sources.get(k, 'given')})")
    lines.append(f"  -> one I/O-bound sweep = {p['sweep_s']:.3f} s")
    lines.append("| schedule | tokens/sweep | s/round | tokens/s | sweeps per 1000 tokens | TB read per 1000 tokens |")
    lines.append("|---|---|---|---|---|---|")
    for name, r in p["rows"].items():
        lines.append(f"| {name} | {r['tokens_per_sweep']:.2f} | {r['s_per_round']:.3f} | {r['tokens_per_s']:.3f} | "
                     f"{r['sweeps_per_1000_tokens']:.0f} | {r['bytes_per_1000_tokens'] / 1e12:.2f} |")
    return "\n".join(lines)
