"""Gemma 3 270M, naive greedy against transformers on the same GGUF, 3 prompts x 48 tokens (longer than CI's
check, which goes through chain): the fp32 store's prefill logits, naive's tokens against `generate`, and chain
and tree (self-int4 draft) against naive.

    python benchmarks/gemma_vs_transformers.py [--tokens 48]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Water boils at 100 degrees Celsius because"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=48)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    from streamspec_ray import Engine
    from streamspec_ray.store import sources
    from streamspec_ray.store.convert import convert

    with tempfile.TemporaryDirectory() as d:
        gguf = sources.assemble("gemma3-270m", os.path.join(d, "g.gguf"))
        convert(gguf, os.path.join(d, "fp32"), dtype="fp32")
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file="g.gguf", dtype=torch.float32).eval()
        eng = Engine(target=os.path.join(d, "fp32"), draft="self-int4")
        for prompt in PROMPTS:
            ids = eng.encode(prompt)
            with torch.no_grad():
                want = model.generate(torch.tensor([ids]), max_new_tokens=a.tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
                diff = (eng.logits(ids) - model(torch.tensor([ids])).logits[0]).abs().max().item()
            got = {m: eng.generate(prompt_ids=ids, max_new_tokens=a.tokens, mode=m).token_ids
                   for m in ("naive", "chain", "tree")}
            print(f"{prompt[:30]!r}: prefill max |diff| {diff:.2e}, naive == transformers {got['naive'] == want} "
                  f"({len(want)} tokens), chain == naive {got['chain'] == got['naive']}, "
                  f"tree == naive {got['tree'] == got['naive']}")


if __name__ == "__main__":
    main()
