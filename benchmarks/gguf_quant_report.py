"""Fidelity and bytes of the 4-bit store dtypes on a real GGUF, against the GGUF's own weights.

    python benchmarks/gguf_quant_report.py [--model qwen2.5-coder-1.5b] [--layers 0,13,27]

For every matrix of the chosen layers (and the head), the GGUF tensor dequantized exactly (gguf-py, fp32) is the
reference; printed per tensor type: the relative RMS error and bytes per parameter of
  int4pack g32  what `convert --dtype int4pack` stores: Q4_K's own codes (scale/zero rounded to bf16 for the
                kernel), other types re-quantized (min/max per 32);
  int4 g64      what `convert --dtype int4` stores: asymmetric INT4, group 64, re-quantized from the GGUF weights
                (quant.quantize_int4_asym, with its range search and least-squares refinement).
Every figure is computed in this run.
"""
from __future__ import annotations

import argparse
import collections
import os
import tempfile

import torch


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--layers", default="0,13,27")
    a = p.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    from streamspec_ray import quant
    from streamspec_ray.quant import ggml
    from streamspec_ray.store import sources
    from streamspec_ray.store.gguf import GGUFSource

    rows = collections.defaultdict(lambda: {"n": 0, "pack": 0.0, "g64": 0.0, "params": 0})
    with tempfile.TemporaryDirectory() as d:
        src = GGUFSource(sources.assemble(a.model, os.path.join(d, "m.gguf")))
        layers = {int(x) for x in a.layers.split(",")}
        names = [n for n in src.names() if n.endswith(".weight") and len(src.shape(n)) == 2 and (
            n == "lm_head.weight" or (n.startswith("model.layers.") and int(n.split(".")[2]) in layers))]
        for n in names:
            ref = src.get(n)
            qt = src.qtype(n)
            if qt in ggml.DIRECT:
                u, s, z = (torch.from_numpy(x) for x in ggml.DIRECT[qt](src.raw_rows(n, 0, ref.shape[0]),
                                                                     tuple(ref.shape)))
            else:
                u, s, z = quant.quantize_asym(ref, 32, torch.bfloat16, shrink=(1.0,), refine=0)
            s, z = s.to(torch.bfloat16).float(), z.to(torch.bfloat16).float()  # what the kernel multiplies
            pack = ((u.float() - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1))
            q, s64, z64 = quant.quantize_int4_asym(ref, 64)
            g64 = quant.dequantize_int4(q, s64, 64, dtype=torch.float32, zeros=z64)
            r = rows[qt]
            r["n"] += 1
            r["params"] += ref.numel()
            r["pack"] += rel_rms(pack, ref) * ref.numel()
            r["g64"] += rel_rms(g64, ref) * ref.numel()
            print(f"{n:48s} {qt:5s} int4pack g32 {rel_rms(pack, ref):.4f}   int4 g64 {rel_rms(g64, ref):.4f}",
                  flush=True)
    print("\n| GGUF type | tensors | params | int4pack g32 rel. RMS | int4 g64 rel. RMS |")
    print("|---|---|---|---|---|")
    for qt, r in sorted(rows.items()):
        print(f"| {qt} | {r['n']} | {r['params'] / 1e6:.1f}M | {r['pack'] / r['params']:.4f} | "
              f"{r['g64'] / r['params']:.4f} |")
    print("\nbytes per parameter: int4pack g32 0.5 + 4/32 = 0.625 (codes, bf16 scale and zero); "
          "int4 g64 0.5 + 4/64 = 0.5625 (codes, fp16 scale and zero); the GGUF's Q4_K 0.5625, Q6_K 0.8203")


if __name__ == "__main__":
    main()
