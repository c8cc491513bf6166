"""`streamspec serve` against hostile or careless clients and a failing engine: the body limit, tokenization off the
event loop, clients that leave (running or queued), a loop that cannot run, SIGTERM with requests in flight,
cross-site / DNS-rebinding requests, the API key's sources, and malformed JSON. Orderings are checked with events
and counters, never with timings; the time limits below only guard against a hang."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")

from streamspec_ray import httpguard, serve  # noqa: E402
from streamspec_ray.errors import ConfigError  # noqa: E402

MODEL = "smol"
SMALL = 4096  # the body limit of the `small` server


@pytest.fixture(scope="module")
def scheduler(smol_engine):
    # naive: a token every sweep, so events reach a request faster than the 0.5 s poll for a departed client
    # that this server had (and that such a stream of events kept from ever running)
    sched = serve.Scheduler(smol_engine, mode="naive", batch_size=8, max_queue=16)
    yield sched
    sched.close()


@pytest.fixture(scope="module")
def server(scheduler):
    srv = serve.ServerThread(serve.make_app(scheduler, MODEL))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small(scheduler):
    srv = serve.ServerThread(serve.make_app(scheduler, MODEL, max_body_bytes=SMALL))
    yield srv
    srv.stop()


def _until(cond, what: str, limit: float = 120.0):
    """Wait for cond() (a hang guard, not a timing check)."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


def _call(srv, method: str, path: str, body=None, headers=None, host=None):
    """(status, parsed JSON or text, headers) of one request, with full control of the headers (Host too)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    data = body if isinstance(body, (bytes, type(None))) else \
        (body if isinstance(body, str) else json.dumps(body)).encode()
    hdrs = {"Host": host or f"127.0.0.1:{srv.port}"}
    if data is not None:
        hdrs.update({"Content-Type": "application/json", "Content-Length": str(len(data))})
    hdrs.update(headers or {})
    for k, v in hdrs.items():
        if v is not None:
            conn.putheader(k, v)
    conn.endheaders(data)
    r = conn.getresponse()
    raw = r.read()
    conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode()
    return r.status, parsed, {k.lower(): v for k, v in r.getheaders()}


def _is_error(obj, status_type: str) -> bool:
    return isinstance(obj, dict) and set(obj.get("error", {})) >= {"message", "type", "param", "code"} and \
        obj["error"]["type"] == status_type


def _open(srv, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    """Send a request on a raw socket and leave the answer unread (a client that may walk away)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _counter(sched, name: str, *labels) -> float:
    metric = getattr(sched.metrics, name)
    return (metric.labels(*labels) if labels else metric)._value.get()


# --------------------------------------------------------------------------------------------- body size


def test_content_length_over_the_limit_gets_413_before_the_body_is_read(small):
    conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=120)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(SMALL + 1))
    conn.endheaders()  # (no body is sent: the answer cannot have waited for one)
    r = conn.getresponse()
    err = json.loads(r.read())
    conn.close()
    assert r.status == 413 and _is_error(err, "invalid_request_error") and err["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_gets_413_while_it_is_read(small):
    def chunked(parts, end: bool):
        conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=120)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for p in parts:
            conn.send(b"%x\r\n%s\r\n" % (len(p), p))
        if end:
            conn.send(b"0\r\n\r\n")
        r = conn.getresponse()
        out = r.status, json.loads(r.read())
        conn.close()
        return out

    # over the limit: two chunks and no end (the server refuses without waiting for the rest)
    status, err = chunked([b"[" + b" " * (SMALL // 2), b" " * (SMALL // 2)], end=False)
    assert status == 413 and err["error"]["code"] == "request_too_large"
    body = json.dumps({"prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
    status, ok = chunked([body[:5], body[5:]], end=True)  # under it: a chunked body is read whole
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


# -------------------------------------------------------------------------------------------- malformed


def test_deeply_nested_json_gets_400(server):
    status, err, _ = _call(server, "POST", "/v1/chat/completions", "[" * 100_000)
    assert status == 400 and _is_error(err, "invalid_request_error") and "nested too deeply" in err["error"]["message"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_sampling_values_name_their_parameter(server, value):
    """Python's json reads NaN and Infinity: they are 400s that name the parameter, never a sampler's NaN."""
    for key in ("temperature", "top_p"):
        body = '{"prompt": "Hi", "max_tokens": 2, "%s": %s}' % (key, value)
        status, err, _ = _call(server, "POST", "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == key, (key, value, err)


def test_unexpected_exception_gets_a_json_500(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(serve.request_args, "sampling", broken)
    status, err, headers = _call(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 500 and headers["content-type"] == "application/json" and _is_error(err, "server_error")
    assert "RuntimeError" in err["error"]["message"]


# ----------------------------------------------------------------------------------- tokenization off loop


def test_health_answers_while_a_prompt_is_being_tokenized(server, smol_engine, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real = smol_engine.encode

    def held(*args, **kwargs):  # the tokenization of a huge prompt, held until /health has answered
        started.set()
        assert release.wait(120)
        return real(*args, **kwargs)
    monkeypatch.setattr(smol_engine, "encode", held)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_call(server, "POST", "/v1/completions",
                                                          {"prompt": "Hi", "max_tokens": 2, "temperature": 0})))
    t.start()
    try:
        assert started.wait(120)
        status, health, _ = _call(server, "GET", "/health")  # answered while the tokenization is still held
        assert status == 200 and health["status"] == "ok" and t.is_alive()
    finally:
        release.set()
        t.join(120)
    assert out["r"][0] == 200 and out["r"][1]["usage"]["completion_tokens"] == 2


def test_concurrent_large_prompts_are_each_tokenized_exactly(server, smol_engine):
    """Large prompts at once (the tokenizer used from one thread only: no "Already borrowed"): the ones over the
    context get 400 naming their exact token count, the one that fits is answered."""
    big = [f"{i}: " + " ".join(f"word{i}x{j}" for j in range(12_000)) for i in range(3)]
    fits = "Count: " + ", ".join(str(j) for j in range(60))
    counts = [len(smol_engine.encode(p, chat=False)) for p in big + [fits]]
    assert all(c > smol_engine.args.max_position_embeddings for c in counts[:3])
    out = [None] * 4

    def ask(i, prompt):
        out[i] = _call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(big + [fits])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for (status, err, _), n in zip(out[:3], counts):
        assert status == 400 and f"the prompt ({n} tokens)" in err["error"]["message"], err
    assert out[3][0] == 200 and out[3][1]["usage"]["prompt_tokens"] == counts[3]


# ------------------------------------------------------------------------------------------ clients leave


def test_non_streaming_client_that_leaves_frees_its_slot(server, scheduler):
    tokens0, gone0 = _counter(scheduler, "tokens"), _counter(scheduler, "requests", "cancelled")
    sock = _open(server, {"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                          "max_tokens": 400, "temperature": 0})
    _until(lambda: _counter(scheduler, "tokens") > tokens0, "the first tokens")
    sock.close()  # the client leaves before its answer
    _until(lambda: _counter(scheduler, "requests", "cancelled") > gone0 and _counter(scheduler, "active") == 0,
           "the request to be cancelled")
    assert _counter(scheduler, "tokens") - tokens0 < 100  # ended after a round or two, not at max_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_queued_request_whose_client_left_never_starts(smol_engine, stream):
    sched = serve.Scheduler(smol_engine, mode="chain", k=4, batch_size=1, max_queue=4)
    admitted, real = [], sched._admitted
    sched._admitted = lambda req: (admitted.append(list(req.prompt_ids)), real(req))
    srv = serve.ServerThread(serve.make_app(sched, MODEL))
    queued_ids = [1, 2, 3, 4, 5, 6, 7]
    try:
        first = _open(srv, {"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                            "max_tokens": 400, "temperature": 0, "stream": True})
        _until(lambda: _counter(sched, "active") == 1, "the first request to hold the only slot")
        second = _open(srv, {"prompt": queued_ids, "max_tokens": 50, "temperature": 0, "stream": stream},
                       "/v1/completions")
        _until(lambda: sched.source.waiting() == 1, "the second request to be queued")
        job = next(j for j in list(sched.jobs.values()) if j.req.prompt_ids == queued_ids)
        second.close()  # its client leaves while it waits
        _until(job.req.cancel.is_set, "the queued request to be cancelled")
        first.close()  # frees the slot: the loop reaches the queued request
        _until(lambda: not sched.jobs and _counter(sched, "active") == 0, "both requests to end")
        assert queued_ids not in admitted and len(admitted) == 1
        assert _counter(sched, "requests", "cancelled") == 2
    finally:
        srv.stop()
        sched.close()


# ------------------------------------------------------------------------------------ a loop that fails


class _Flaky:
    """The engine, with a pipeline that cannot be built until `fixed` is set; the first try waits for `go`."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0
        self.go, self.fixed = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _batch_pipelines(self, mode, replicas):
        self.calls += 1
        if self.calls == 1:
            assert self.go.wait(120)
        if not self.fixed.is_set():
            raise RuntimeError("the store is gone")
        return self.engine._batch_pipelines(mode, replicas)


def test_a_loop_that_cannot_run_is_retried_and_reported(smol_engine):
    flaky = _Flaky(smol_engine)
    sched = serve.Scheduler(flaky, mode="chain", k=4, batch_size=2, max_queue=4, backoff=0.01, max_backoff=0.05)
    srv = serve.ServerThread(serve.make_app(sched, MODEL))
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    try:
        _until(lambda: flaky.calls == 1, "the loop's first try")
        out = {}
        t = threading.Thread(target=lambda: out.update(r=_call(srv, "POST", "/v1/completions", body)))
        t.start()
        _until(lambda: sched.source.waiting() == 1, "the request to be queued")
        flaky.go.set()  # the first try fails: the queued request gets the error, not an endless wait
        t.join(120)
        status, err, _ = out["r"]
        assert status == 503 and _is_error(err, "server_error") and "the store is gone" in err["error"]["message"]
        status, health, _ = _call(srv, "GET", "/health")
        assert status == 503 and health["status"] == "error" and "the store is gone" in health["error"]
        status, err, _ = _call(srv, "POST", "/v1/completions", body)  # refused at once while it fails
        assert status == 503 and err["error"]["code"] == "unavailable"
        _until(lambda: flaky.calls >= 3, "the loop to be retried")
        flaky.fixed.set()
        _until(lambda: _call(srv, "GET", "/health")[0] == 200, "the loop to run again")
        status, ok, _ = _call(srv, "POST", "/v1/completions", body)
        assert status == 200 and ok["usage"]["completion_tokens"] == 2
    finally:
        flaky.go.set()
        flaky.fixed.set()
        srv.stop()
        sched.close()


# -------------------------------------------------------------------------------- cross-site, the key


def test_dns_rebinding_and_cross_site_requests_are_refused_without_a_key(server, scheduler):
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        status, err, _ = _call(server, "GET", "/v1/models", host=host)
        assert status == 403 and _is_error(err, "permission_error") and err["error"]["code"] == "host_not_allowed"
    for host in ("localhost", "localhost:1234", "127.0.0.1", "[::1]:8000"):
        assert _call(server, "GET", "/v1/models", host=host)[0] == 200, host
    status, err, _ = _call(server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 403 and err["error"]["code"] == "origin_not_allowed"
    assert _call(server, "GET", "/v1/models", headers={"Origin": "null"})[0] == 403
    assert _call(server, "GET", "/v1/models", headers={"Origin": "http://localhost:5173"})[0] == 200
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        status, err, _ = _call(server, "POST", "/v1/completions", body, headers={"Content-Type": kind})
        assert status == 415 and _is_error(err, "invalid_request_error"), kind
    # bound to every interface: the Host is anything, a foreign Origin is still refused without a key
    wide = serve.ServerThread(serve.make_app(scheduler, MODEL, host="0.0.0.0"))
    try:
        assert _call(wide, "GET", "/v1/models", host="my-server.lan:8000")[0] == 200
        assert _call(wide, "GET", "/v1/models", headers={"Origin": "http://evil.example"})[0] == 403
    finally:
        wide.stop()


def test_with_a_key_host_and_origin_are_not_checked_and_metrics_need_it(scheduler):
    srv = serve.ServerThread(serve.make_app(scheduler, MODEL, api_key="sekrit"))
    key = {"Authorization": "Bearer sekrit"}
    try:
        assert _call(srv, "GET", "/v1/models", host="rebound.example",
                     headers={**key, "Origin": "https://app.example"})[0] == 200
        assert _call(srv, "GET", "/v1/models", host="rebound.example")[0] == 401
        status, err, _ = _call(srv, "GET", "/metrics")
        assert status == 401 and _is_error(err, "authentication_error")
        status, text, _ = _call(srv, "GET", "/metrics", headers=key)
        assert status == 200 and "streamspec_generated_tokens_total" in text
        assert _call(srv, "GET", "/health")[0] == 200  # public
    finally:
        srv.stop()


def test_api_key_from_a_file_or_the_environment(tmp_path, capsys):
    from streamspec_ray import cli

    path = tmp_path / "key"
    path.write_text("  from-file \nsecond line\n")
    assert httpguard.resolve_api_key(None, str(path), {}) == "from-file"
    assert httpguard.resolve_api_key(None, None, {"STREAMSPEC_API_KEY": " from-env\n"}) == "from-env"
    assert httpguard.resolve_api_key("flag", None, {"STREAMSPEC_API_KEY": "env"}) == "flag"
    assert httpguard.resolve_api_key(None, str(path), {"STREAMSPEC_API_KEY": "env"}) == "from-file"
    assert httpguard.resolve_api_key(None, None, {}) is None
    (tmp_path / "empty").write_text("\n")
    for args, env, match in ((None, {"STREAMSPEC_API_KEY": " "}, "set but empty"),
                             (str(tmp_path / "empty"), {}, "first line is empty"),
                             (str(tmp_path / "missing"), {}, "cannot read --api-key-file")):
        with pytest.raises(ConfigError, match=match):
            httpguard.resolve_api_key(None, args, env)
    # the command line: one error line, before any model is loaded
    assert cli.main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read --api-key-file") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------ SIGTERM


def test_sigterm_ends_streams_in_flight_and_exits_zero(smol_store, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "streamspec_ray", "serve", "--target", smol_store, "--mode",
                             "naive", "--port", str(port), "--shutdown-timeout", "4"],
                            stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))

    def up() -> bool:
        assert proc.poll() is None, open(tmp_path / "stderr").read()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    try:
        _until(up, "the server to start", 300)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                                 "max_tokens": 2000, "temperature": 0, "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        lines = []
        while sum(line.startswith(b"data:") for line in lines) < 3:  # generating
            lines.append(r.readline())
            assert lines[-1], "the stream ended before SIGTERM"
        proc.send_signal(signal.SIGTERM)
        lines.extend(r.readlines())  # the rest of the stream, to its end (a cut stream raises here)
        conn.close()
        assert proc.wait(timeout=120) == 0, open(tmp_path / "stderr").read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data = [line.strip() for line in lines if line.startswith(b"data:")]
    assert data[-1] == b"data: [DONE]"  # the stream was ended, not cut
    assert json.loads(data[-2][5:])["choices"][0]["finish_reason"] in ("cancelled", "length", "stop")
