"""A bounded local load test of `streamspec serve`: 1, 4 and 16 concurrent clients, each sending a fixed number of
streamed chat requests, against a server on 127.0.0.1 over the embedded pair (fp32 SmolLM2-135M store, self-int4
draft, chain mode), cold by default (every sweep reads the store from disk).

Every level sends the same --total requests (the same prompts), split evenly across its clients, so the levels do
the same work. For each: total completion tokens / wall time (tokens/s), time to first token (p50, p95: from
sending the request to the first content chunk), sequences per sweep (from the server's /metrics), and the
speedup over one client; each level runs --repeats times and the run with the median tokens/s is reported.
Every figure is measured in the run.

    python benchmarks/bench_serve.py [--clients 1,4,16] [--total 16] [--tokens 32] [--repeats 3] [--no-cold]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

PROMPTS = ["Name three colors.", "What is the capital of Italy?", "Write a haiku about the sea.",
           "Explain what a CPU does in one sentence.", "Give me a synonym for happy.", "What is 12 times 11?",
           "Name a famous painter.", "Say hello in French.", "What is photosynthesis?", "Name two planets.",
           "Write a short greeting for a birthday card.", "What is the boiling point of water?",
           "Suggest a name for a cat.", "What is a prime number?", "Name a programming language.",
           "What color is the sky?"]


def metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def run_level(url: str, clients: int, requests: int, tokens: int) -> dict:
    """`clients` threads, each sending `requests` streamed chat requests one after another; client c's r-th
    request is prompt c * requests + r."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    ttft, counts, errors = [], [], []
    lock = threading.Lock()

    def worker(c: int):
        for r in range(requests):
            prompt = PROMPTS[(c * requests + r) % len(PROMPTS)]
            t0 = time.perf_counter()
            first, n = None, 0
            try:
                stream = client.chat.completions.create(model="default", stream=True, max_tokens=tokens,
                                                        temperature=0, messages=[{"role": "user",
                                                                                  "content": prompt}])
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content and first is None:
                        first = time.perf_counter() - t0
                    if chunk.usage is not None:
                        n = chunk.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 (reported, not hidden)
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                ttft.append(first if first is not None else time.perf_counter() - t0)
                counts.append(n)

    rows0, sweeps0 = metric(url, "streamspec_sweep_sequences_total"), metric(url, "streamspec_sweeps_total")
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rows = metric(url, "streamspec_sweep_sequences_total") - rows0
    sweeps = metric(url, "streamspec_sweeps_total") - sweeps0
    q = statistics.quantiles(ttft, n=20) if len(ttft) >= 2 else ttft * 19
    return {"clients": clients, "requests": len(counts), "errors": errors, "tokens": sum(counts), "wall_s": wall,
            "tokens_per_s": sum(counts) / wall, "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "ttft_p95_s": q[18] if ttft else None, "sweeps": sweeps,
            "sequences_per_sweep": rows / sweeps if sweeps else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--total", type=int, default=16, help="requests per level, split across its clients")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--no-cold", action="store_true")
    p.add_argument("--out", default="bench_out/serve.json")
    a = p.parse_args()

    from streamspec_ray import Engine, serve
    from streamspec_ray.runtime.threads import choose_threads

    threads = choose_threads()
    eng = Engine(target=None, draft="self-int4", cold=not a.no_cold)
    scheduler = serve.Scheduler(eng, mode="chain", k="adaptive", batch_size=a.batch_size, max_queue=256)
    srv = serve.ServerThread(serve.make_app(scheduler, "smollm2-135m"))
    rows = []
    try:
        run_level(srv.url, 1, 1, 4)  # warm-up: first-request costs (tokenizer template, allocations)
        for c in [int(x) for x in a.clients.split(",")]:
            runs = []
            for _ in range(a.repeats):
                runs.append(run_level(srv.url, c, max(1, a.total // c), a.tokens))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            runs.sort(key=lambda r: r["tokens_per_s"])
            rows.append({**runs[len(runs) // 2], "repeats_tokens_per_s": [r["tokens_per_s"] for r in runs]})
    finally:
        srv.stop()
        scheduler.close()
    base = rows[0]["tokens_per_s"] if rows else 0
    print("| clients | requests | tokens | wall s | tokens/s | vs 1 client | TTFT p50 s | TTFT p95 s | "
          "sequences/sweep |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.2f} | "
              f"{r['tokens_per_s'] / base:.2f}x | {r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | "
              f"{r['sequences_per_sweep']:.2f} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "threads": threads, "cold": not a.no_cold, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
