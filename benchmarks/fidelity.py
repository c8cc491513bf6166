"""How far each store dtype of one GGUF model is from the file's own model: perplexity, top-1 agreement and KL.

    python benchmarks/fidelity.py --model qwen2.5-coder-1.5b --dtypes fp32,gguf,int4pack --tokens 2048

The reference is the first dtype (fp32: every weight of the GGUF dequantized exactly, the model llama.cpp and
transformers run from the file). Each store scores the same text in windows of --window tokens, one streamed
sweep a window (Engine.logits): the text is code (Python's own `textwrap.py`) and prose (the Python reference
manual's topics, `pydoc_data.topics`), both shipped with every Python, so the figures can be reproduced anywhere.
For each dtype: bytes streamed per sweep, seconds per window, perplexity on code / prose / all, the share of
positions whose top-1 token equals the reference's, the mean KL(reference || dtype) in nats, and whether the
logits are bit-identical to the reference's. Prints a markdown table and writes bench_out/fidelity.json; every
figure is measured in this run.

llama.cpp's `llama-perplexity` scores each window's second half only (the first half is context), so every row
also gives its perplexity over the second halves ("2nd halves"); --llama-perplexity BIN runs that binary on the
same windows of the same GGUF file (the text of each kind's windows written out, `-c --window --chunks n`) and
adds its figure as a row, for the file as llama.cpp computes it (--llama-args adds flags to it: `--no-repack`
on this project's VM, where the build that llama-cpp-python 0.3.36 vendors crashed repacking the weights).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time


def texts() -> dict[str, str]:
    import textwrap

    from pydoc_data import topics

    with open(textwrap.__file__) as f:
        code = f.read()
    prose = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return {"code": code, "prose": prose}


def windows(tokenizer, tokens: int, window: int) -> list[tuple[str, list[int]]]:
    """Half the tokens from each text, cut into windows (each scored from a fresh cache)."""
    out = []
    for kind, text in texts().items():
        ids = tokenizer(text[: 40 * tokens])["input_ids"][: tokens // 2]
        out += [(kind, ids[i : i + window]) for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]
    return out


def score(model: str, dtype: str, tokens: int, window: int, threads: int):
    """-> (record, [log-softmax per window]) for one dtype's store."""
    import torch

    from streamspec_ray import Engine
    from streamspec_ray.store.default import resolve_store

    store = resolve_store(model, dtype)
    eng = Engine(target=store, draft=None, threads=threads)
    logps, kinds, secs = [], [], []
    for kind, ids in windows(eng.tokenizer, tokens, window):
        t0 = time.perf_counter()
        logits = eng.logits(ids)  # [len(ids), vocab], one streamed sweep
        secs.append(time.perf_counter() - t0)
        logps.append((torch.log_softmax(logits[:-1].double(), -1).float(), torch.tensor(ids[1:]), logits[:-1]))
        kinds.append(kind)
    streamed = eng.store.total_bytes() - eng.store.manifest.unit("embed").bytes
    return {"dtype": dtype, "store": store, "bytes_per_sweep": streamed, "s_per_window": secs, "kinds": kinds}, logps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a named model or a .gguf file")
    p.add_argument("--dtypes", default="fp32,gguf,int4pack", help="comma-separated; the first is the reference")
    p.add_argument("--tokens", type=int, default=2048, help="tokens scored in all, half code, half prose")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--llama-perplexity", metavar="BIN", help="llama.cpp's llama-perplexity, run on the same windows")
    p.add_argument("--llama-args", default="", help="more flags for --llama-perplexity, e.g. '--no-repack'")
    a = p.parse_args()
    if a.llama_perplexity and not (os.path.isfile(a.llama_perplexity) and os.access(a.llama_perplexity, os.X_OK)):
        p.error(f"--llama-perplexity: {a.llama_perplexity} is not an executable file")
    import torch

    dtypes = [d for d in a.dtypes.split(",") if d]
    ref = None
    rows = []
    for dtype in dtypes:
        rec, logps = score(a.model, dtype, a.tokens, a.window, a.threads)
        nll = {"code": [], "prose": []}
        late = []  # each window's second half: what llama-perplexity scores
        agree = kl = n = 0
        same = ref is not None
        for i, (lp, nxt, logits) in enumerate(logps):
            window_nll = (-lp.gather(1, nxt[:, None]).squeeze(1)).tolist()
            nll[rec["kinds"][i]] += window_nll
            if len(nxt) + 1 == a.window:
                late += window_nll[a.window // 2:]
            if ref is not None:
                rlp, _, rlogits = ref[i]
                agree += int((lp.argmax(-1) == rlp.argmax(-1)).sum())
                kl += float((rlp.exp() * (rlp - lp)).sum())
                n += len(nxt)
                same = same and torch.equal(logits, rlogits)
        every = nll["code"] + nll["prose"]
        rec.update(tokens_scored=len(every),
                   ppl={k: math.exp(sum(v) / len(v)) for k, v in {**nll, "all": every}.items() if v},
                   ppl_second_halves=math.exp(sum(late) / len(late)) if late else None,
                   top1_agreement=agree / n if n else None, kl_nats=kl / n if n else None,
                   identical_logits=same if ref is not None else None)
        if ref is None:
            ref = logps
        rows.append(rec)
        print(f"{dtype}: ppl {rec['ppl']['all']:.3f}, {rec['bytes_per_sweep'] / 1e6:.0f} MB per sweep", file=sys.stderr)
    failed = None
    if a.llama_perplexity:  # (a failure there keeps the rows above: they are written and printed all the same)
        try:
            rows.append(llama_perplexity(a.llama_perplexity, a.model, a.tokens, a.window, a.threads, a.llama_args))
        except RuntimeError as e:
            failed = str(e)
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fidelity.json"), "w") as f:
        json.dump({"model": a.model, "commit": commit, "tokens": a.tokens, "window": a.window, "rows": rows}, f,
                  indent=1)
    print(f"| store dtype | MB per sweep | s per {a.window}-token window | perplexity code / prose / all | "
          f"perplexity, 2nd halves | top-1 = {dtypes[0]} | KL from {dtypes[0]} (nats/token) | "
          f"logits identical to {dtypes[0]} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = lambda v, fmt: "-" if v is None else fmt.format(v)  # noqa: E731
        if "llama" in r:
            print(f"| {r['dtype']} | - | - | - | {r['ppl_second_halves']:.3f} | - | - | - |")
            continue
        secs = sorted(r["s_per_window"])
        print(f"| {r['dtype']} | {r['bytes_per_sweep'] / 1e6:.0f} | {secs[len(secs) // 2]:.1f} | "
              f"{r['ppl']['code']:.3f} / {r['ppl']['prose']:.3f} / {r['ppl']['all']:.3f} | "
              f"{f(r['ppl_second_halves'], '{:.3f}')} | {f(r['top1_agreement'], '{:.4f}')} | "
              f"{f(r['kl_nats'], '{:.5f}')} | {f(r['identical_logits'], '{}')} |")
    if failed:
        raise SystemExit(failed)


def llama_perplexity(binary: str, model: str, tokens: int, window: int, threads: int, extra: str = "") -> dict:
    """llama.cpp's perplexity of the GGUF file on the same windows: each kind's windows decoded to text and given
    to `binary` with a context of `window` (it scores every chunk's second half) -> a row."""
    import re
    import shlex
    import tempfile

    from transformers import AutoTokenizer

    from streamspec_ray.store import sources
    from streamspec_ray.store.default import resolve_store

    tok = AutoTokenizer.from_pretrained(os.path.join(resolve_store(model), "tokenizer"))
    nll, n = 0.0, 0
    with tempfile.TemporaryDirectory() as d:
        gguf = model if model.endswith(".gguf") else sources.assemble(model, os.path.join(d, "model.gguf"))
        for kind in ("code", "prose"):
            ids = [w for k, w in windows(tok, tokens, window) if k == kind and len(w) == window]
            text = os.path.join(d, f"{kind}.txt")
            with open(text, "w") as f:
                f.write(tok.decode([t for w in ids for t in w]))
            run = subprocess.run([binary, "-m", gguf, "-f", text, "-c", str(window), "-b", str(window),
                                  "--chunks", str(len(ids)), "-t", str(threads), *shlex.split(extra)],
                                 capture_output=True, text=True)
            m = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
            if run.returncode or not m:
                raise RuntimeError(f"{binary} failed on the {kind} windows (exit {run.returncode}); its output "
                                   f"ends:\n{(run.stdout + run.stderr)[-2000:]}")
            scored = len(ids) * (window - 1 - window // 2)
            nll, n = nll + math.log(float(m[1])) * scored, n + scored
    return {"dtype": f"llama.cpp llama-perplexity ({os.path.basename(binary)}, the GGUF file)", "llama": True,
            "ppl_second_halves": math.exp(nll / n), "tokens_scored": n}


if __name__ == "__main__":
    main()
