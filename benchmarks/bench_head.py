"""Does a big vocabulary's tied head deserve its own treatment? The head's share of a sweep's bytes, and what a
4-bit head (int4pack, the kernel's layout, instead of the fp16 embedding streamed as the head) changes.

    python benchmarks/bench_head.py [--model gemma3-270m] [--tokens 64] [--repeats 5]

Builds two int4pack stores of the model in a temporary folder: the default (the tied head streams the fp16
embedding) and one whose head unit holds the embedding re-quantized to int4pack (what the self-int4 draft does).
Prints, measured in this run: bytes per sweep and the head's share; the warm sweep time (median of --repeats)
for 1 and 9 tokens; and fidelity: over greedy continuations of the prompts by the default store, the fraction
of positions where the 4-bit head's top-1 token is the same (teacher-forced: both see the same tokens), and
the max abs logit difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Water boils at 100 degrees Celsius because", "Once upon a time, in a small village by the sea,"]


def sweep_ms(eng, ids: list[int], T: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        cache = eng.executor.new_cache()
        eng.executor.sweep(ids, cache, logits_from=len(ids) - 1)
        t = time.perf_counter()
        eng.executor.sweep(list(range(100, 100 + T)), cache)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    from streamspec_ray import Engine
    from streamspec_ray.store import sources
    from streamspec_ray.store.convert import _convert
    from streamspec_ray.store.gguf import GGUFSource

    with tempfile.TemporaryDirectory() as d:
        gguf = sources.assemble(a.model, os.path.join(d, "m.gguf"))
        for name, head in (("fp16 head", False), ("int4pack head", True)):
            _convert(GGUFSource(gguf), a.model, os.path.join(d, name), "int4pack", 32, False, head_copy=head)
        engines = {n: Engine(target=os.path.join(d, n), draft=None) for n in ("fp16 head", "int4pack head")}
        base = engines["fp16 head"]
        conts = [base.generate(prompt=q, chat=False, max_new_tokens=a.tokens, mode="naive") for q in PROMPTS]
        seqs = [base.encode(q, chat=False) + c.token_ids for q, c in zip(PROMPTS, conts)]
        print(f"{a.model}, int4pack layers; {len(PROMPTS)} prompts x {a.tokens} greedy tokens of the fp16-head store;"
              f" warm sweeps, 1 thread, median of {a.repeats}")
        print("| head | MB per sweep | head's share | sweep 1 token ms | sweep 9 tokens ms | top-1 = fp16 head | max abs logit diff |")
        print("|---|---|---|---|---|---|---|")
        ref_logits = [base.logits(s) for s in seqs]
        for n, eng in engines.items():
            m = eng.store.manifest
            sweep = sum(m.unit(u).bytes for u in eng.executor.sweep_names)
            head = m.unit("head").bytes + (m.unit("embed").bytes if "embed" in eng.executor.sweep_names else 0)
            same = total = 0
            diff = 0.0
            for s, ref, q in zip(seqs, ref_logits, PROMPTS):
                got = eng.logits(s)
                n0 = len(base.encode(q, chat=False)) - 1  # (positions that predict the continuation)
                same += int((got[n0:].argmax(-1) == ref[n0:].argmax(-1)).sum())
                total += got.shape[0] - n0
                diff = max(diff, float((got - ref).abs().max()))
            print(f"| {n} | {sweep / 1e6:.1f} | {head / sweep:.1%} | {sweep_ms(eng, seqs[0][:16], 1, a.repeats):.1f} | "
                  f"{sweep_ms(eng, seqs[0][:16], 9, a.repeats):.1f} | {same / total:.4f} | {diff:.3f} |")


if __name__ == "__main__":
    main()
