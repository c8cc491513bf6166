"""A bounded load and fault probe of `streamspec serve`, on 127.0.0.1 only, that stops by itself.

It starts `streamspec serve` (the embedded pair unless --target/--draft say otherwise) as a child process on a
free loopback port, then measures, every figure in this run:
  load        8 and 32 concurrent clients, each sending --requests greedy chat requests one after another:
              successes, latency p50 / p99, and whether every text equals the same prompt's text asked alone
  tiny T      a request with temperature 1e-45 beside three greedy ones: every status, the three texts against
              their texts alone
  leave       20 clients that leave mid-stream and 20 non-streaming clients that leave while their rounds run,
              each done twice: the tokens generated for them (of the max_tokens asked), whether every slot was
              freed, and the server's resident memory before and after
  bad input   each hostile request with the status it got, and /health after each
  SIGTERM     the time from SIGTERM to the process's exit with streams in flight, its exit status, and how
              those streams ended

    python benchmarks/bench_faults.py [--requests 3] [--tokens 32] [--json results.json] [serve flags...]

Every network call has a timeout, every loop a bound, and the whole run a deadline (--deadline seconds).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

PROMPTS = ["Name a river in Africa.", "What does a compiler do?", "Give one word that rhymes with moon.",
           "Which is heavier, a kilogram of iron or of feathers?", "Write a two-line poem about tea.",
           "What is the square root of 81?", "Name a bird that cannot fly.", "Translate 'thank you' to Spanish."]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str], deadline: float):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "streamspec_ray", "serve", "--host", HOST, "--port",
                                      str(self.port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.log: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("serve exited at start:\n" + "".join(self.log[-20:]))
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit("serve did not start in time")

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line.decode(errors="replace"))

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 600) -> tuple[int, bytes]:
        c = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            h = {"Content-Type": "application/json"} if body is not None else {}
            c.request(method, path, body=body, headers={**h, **(headers or {})})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def get(self, path: str):
        return self.request("GET", path, timeout=10)

    def healthy(self) -> bool:
        try:
            return self.get("/health")[0] == 200
        except OSError:
            return False

    def metric(self, name: str, labels: str = "") -> float:
        text = self.get("/metrics")[1].decode()
        for line in text.splitlines():
            if line.startswith(name + labels + " "):
                return float(line.split()[-1])
        return 0.0

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def wait_idle(self, bound_s: float = 120) -> bool:
        end = time.monotonic() + bound_s
        while time.monotonic() < end:
            if self.metric("streamspec_active_requests") == 0 and self.metric("streamspec_queued_requests") == 0:
                return True
            time.sleep(0.2)
        return False


def chat(prompt: str, tokens: int, **kw) -> bytes:
    return json.dumps({"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                       "temperature": 0, **kw}).encode()


def answer(srv: Server, prompt: str, tokens: int, **kw) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    status, data = srv.request("POST", "/v1/chat/completions", chat(prompt, tokens, **kw))
    text = json.loads(data)["choices"][0]["message"]["content"] if status == 200 else data.decode()[:200]
    return status, text, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def load(srv: Server, clients: int, requests: int, tokens: int, alone: dict) -> dict:
    results, lock = [], threading.Lock()

    def worker(c: int):
        for r in range(requests):
            prompt = PROMPTS[(c + r) % len(PROMPTS)]
            try:
                got = answer(srv, prompt, tokens)
            except OSError as e:
                got = (0, str(e), float("nan"))
            with lock:
                results.append((prompt, *got))
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r[1] == 200]
    lat = [r[3] for r in ok]
    return {"clients": clients, "requests": len(results), "ok": len(ok), "p50_s": statistics.median(lat),
            "p99_s": pct(lat, 0.99), "identical": sum(r[2] == alone[r[0]] for r in ok)}


def tiny_temperature(srv: Server, tokens: int, alone: dict) -> dict:
    out = {}

    def one(name, prompt, **kw):
        out[name] = answer(srv, prompt, tokens, **kw)
    threads = [threading.Thread(target=one, args=("tiny", PROMPTS[0]), kwargs={"temperature": 1e-45})]
    threads += [threading.Thread(target=one, args=(f"greedy{i}", PROMPTS[i])) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"statuses": {k: v[0] for k, v in out.items()},
            "identical_beside": sum(out[f"greedy{i}"][1] == alone[PROMPTS[i]] for i in (1, 2, 3)),
            "tiny_equals_greedy": out["tiny"][1] == alone[PROMPTS[0]]}


def leave(srv: Server, n: int, tokens: int, stream: bool) -> dict:
    """n clients send a request for `tokens` tokens and close their socket: mid-stream after the first
    content chunk, or (not streaming) once the server reports them active."""
    before_tokens, rss0 = srv.metric("streamspec_generated_tokens_total"), srv.rss()
    socks = []
    for i in range(n):
        s = socket.create_connection((HOST, srv.port), timeout=60)
        body = chat(PROMPTS[i % len(PROMPTS)], tokens, stream=stream)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    if stream:
        for s in socks:  # read until a content chunk arrives, then leave
            buf, end = b"", time.monotonic() + 120
            while buf.count(b"data: ") < 2 and time.monotonic() < end:  # (the role chunk, then content)
                buf += s.recv(4096)
    else:  # leave once the server has generated some tokens for them (their rounds are running)
        end = time.monotonic() + 120
        while srv.metric("streamspec_generated_tokens_total") - before_tokens < n and time.monotonic() < end:
            time.sleep(0.05)
    for s in socks:
        s.close()
    idle = srv.wait_idle()
    generated = srv.metric("streamspec_generated_tokens_total") - before_tokens
    return {"clients": n, "stream": stream, "asked_tokens": n * tokens, "generated_tokens": generated,
            "slots_freed": idle, "rss_before_mb": rss0 / 1e6, "rss_after_mb": srv.rss() / 1e6,
            "cancelled": srv.metric("streamspec_requests_total", '{reason="cancelled"}')}


BAD = [  # (name, method, path, body, headers, expected status)
    ("malformed JSON", "POST", "/v1/chat/completions", b"{not json", {}, 400),
    ("body not an object", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400),
    ("nested JSON bomb (100k [)", "POST", "/v1/chat/completions", b"[" * 100_000, {}, 400),
    ("invalid UTF-8 body", "POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', {}, 400),
    ("messages wrong type", "POST", "/v1/chat/completions", json.dumps({"messages": 5}).encode(), {}, 400),
    ("temperature NaN", "POST", "/v1/chat/completions", chat("hi", 4).replace(b'"temperature": 0', b'"temperature": NaN'),
     {}, 400),
    ("temperature 1e-45 (greedy)", "POST", "/v1/chat/completions", chat("hi", 4, temperature=1e-45), {}, 200),
    ("temperature 3", "POST", "/v1/chat/completions", chat("hi", 4, temperature=3), {}, 400),
    ("top_p 0", "POST", "/v1/chat/completions", chat("hi", 4, top_p=0), {}, 400),
    ("max_tokens -1", "POST", "/v1/chat/completions", chat("hi", -1), {}, 400),
    ("max_tokens 10^9", "POST", "/v1/chat/completions", chat("hi", 10**9), {}, 400),
    ("n 2", "POST", "/v1/chat/completions", chat("hi", 4, n=2), {}, 400),
    ("5 stop strings", "POST", "/v1/chat/completions", chat("hi", 4, stop=list("abcde")), {}, 400),
    ("token id out of vocabulary", "POST", "/v1/completions",
     json.dumps({"prompt": [10**9], "max_tokens": 2}).encode(), {}, 400),
    ("prompt longer than the context", "POST", "/v1/completions",
     json.dumps({"prompt": [1] * 9000, "max_tokens": 2}).encode(), {}, 400),
    ("body over the size limit (8 MB)", "POST", "/v1/completions",
     json.dumps({"prompt": "x" * 8_000_000}).encode(), {}, 413),
    ("no JSON Content-Type", "POST", "/v1/completions", json.dumps({"prompt": "hi"}).encode(),
     {"Content-Type": "text/plain"}, 415),
    ("foreign Host (DNS rebinding)", "POST", "/v1/completions", json.dumps({"prompt": "hi"}).encode(),
     {"Host": "attacker.example"}, 403),
    ("foreign Origin", "POST", "/v1/completions", json.dumps({"prompt": "hi"}).encode(),
     {"Origin": "http://attacker.example"}, 403),
    ("unknown model", "POST", "/v1/completions", json.dumps({"prompt": "hi", "model": "gpt-9"}).encode(), {}, 400),
    ("unknown path", "GET", "/v2/nothing", None, {}, 404),
    ("wrong method", "GET", "/v1/completions", None, {}, 405),
]


def bad_inputs(srv: Server) -> list[dict]:
    rows = []
    for name, method, path, body, headers, want in BAD:
        try:
            status, data = srv.request(method, path, body, headers, timeout=120)
            shaped = False
            try:
                shaped = status == 200 or "error" in json.loads(data)
            except ValueError:
                pass
        except OSError as e:
            status, shaped = f"no answer ({e})", False
        rows.append({"input": name, "status": status, "expected": want, "error_object": shaped,
                     "healthy_after": srv.healthy()})
    return rows


def sigterm(srv: Server, n: int, tokens: int) -> dict:
    ended, lock = [], threading.Lock()

    def client(i):
        how = "no end"
        try:
            c = http.client.HTTPConnection(HOST, srv.port, timeout=120)
            c.request("POST", "/v1/chat/completions", body=chat(PROMPTS[i], tokens, stream=True),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    how = "[DONE]"
                elif b"finish_reason" in line and b'"finish_reason":null' not in line.replace(b" ", b""):
                    how = "finish_reason " + json.loads(line[6:])["choices"][0]["finish_reason"]
                elif line.startswith(b"event: error"):
                    how = "error event"
        except (OSError, http.client.HTTPException) as e:
            how = f"connection ended ({type(e).__name__})"
        with lock:
            ended.append(how)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while srv.metric("streamspec_active_requests") < n and time.monotonic() < end:
        time.sleep(0.05)
    t0 = time.perf_counter()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        rc = srv.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        rc = "killed after 120 s"
    exit_s = time.perf_counter() - t0
    for t in threads:
        t.join(timeout=30)
    return {"in_flight": n, "exit_s": exit_s, "exit_status": rc, "streams": sorted(ended)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3, help="requests per client in the load runs")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=1800, help="the whole run's bound, seconds")
    ap.add_argument("--json", help="also write the results here")
    a, serve_flags = ap.parse_known_args()
    deadline = time.monotonic() + a.deadline
    srv = Server(["--batch-size", "16", "--max-queue", "64", *serve_flags], deadline)
    res = {}
    try:
        alone = {p: answer(srv, p, a.tokens)[1] for p in PROMPTS}
        res["load"] = [load(srv, c, a.requests, a.tokens, alone) for c in (8, 32)]
        res["tiny_temperature"] = tiny_temperature(srv, a.tokens, alone)
        res["leave"] = [leave(srv, 20, 256, stream=s) for s in (True, False, True, False)]  # (twice: a leak grows)
        res["bad_input"] = bad_inputs(srv)
        res["sigterm"] = sigterm(srv, 4, 512)
    finally:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGKILL)
    for row in res["load"]:
        print(f"load {row['clients']:2d} clients x {a.requests}: {row['ok']}/{row['requests']} ok, p50 "
              f"{row['p50_s']:.1f} s, p99 {row['p99_s']:.1f} s, {row['identical']}/{row['ok']} texts as alone")
    t = res["tiny_temperature"]
    print(f"temperature 1e-45 beside 3 greedy: statuses {t['statuses']}, {t['identical_beside']}/3 as alone, "
          f"the tiny one greedy's text: {t['tiny_equals_greedy']}")
    for row in res["leave"]:
        print(f"{row['clients']} {'streaming' if row['stream'] else 'non-streaming'} clients left: "
              f"{row['generated_tokens']:.0f} of {row['asked_tokens']} tokens generated, slots freed "
              f"{row['slots_freed']}, RSS {row['rss_before_mb']:.0f} -> {row['rss_after_mb']:.0f} MB")
    for row in res["bad_input"]:
        mark = "" if row["status"] == row["expected"] else f"  (expected {row['expected']})"
        print(f"  {row['input']:34s} {row['status']}{mark}  error object {row['error_object']}, healthy after "
              f"{row['healthy_after']}")
    s = res["sigterm"]
    print(f"SIGTERM with {s['in_flight']} streams in flight: exit {s['exit_status']} after {s['exit_s']:.1f} s; "
          f"streams: {', '.join(s['streams'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
