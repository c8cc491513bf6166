"""`streamspec serve`: the official `openai` client against a server on 127.0.0.1 over the embedded pair (greedy
output identical to `generate`, streaming and not), requests sharing sweeps, a client leaving mid-stream, and
every error answered in OpenAI's shape."""
from __future__ import annotations

import json
import queue
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from streamspec_ray import serve  # noqa: E402

MODEL = "smol"


_Server = serve.ServerThread


@pytest.fixture(scope="module")
def server(smol_engine):
    scheduler = serve.Scheduler(smol_engine, mode="chain", k=4, batch_size=8, max_queue=16)
    srv = _Server(serve.make_app(scheduler, MODEL))
    srv.scheduler = scheduler
    yield srv
    srv.stop()
    scheduler.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _get(server, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(server.url + path, timeout=60) as r:
        return r.read().decode()


def _metric(server, name: str, labels: str = "") -> float:
    text = _get(server, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or line.startswith(name + "{" + labels.strip("{}") + "} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --------------------------------------------------------------------------------------------- exactness


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(_get(server, "/health"))["status"] == "ok"


def test_chat_greedy_identical_to_generate(client, smol_engine):
    want = smol_engine.generate("Name three colors.", max_new_tokens=16, mode="chain", k=4)
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}],
                                         max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")


def test_completion_greedy_identical_to_generate_raw(client, smol_engine):
    want = smol_engine.generate("The capital of France is", max_new_tokens=12, mode="naive", chat=False)
    got = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(smol_engine.encode("The capital of France is", chat=False))


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_streaming_equals_whole(client, kind, smol_engine):
    if kind == "chat":
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=20, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
        whole = client.completions.create(**kw).choices[0].text
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole and len(chunks) > 2  # tokens arrive as rounds emit them, not all at the end
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_string_and_seeded_sampling(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    assert " 6" in full
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"])
    assert cut.choices[0].text == full[: full.index(" 6")] and cut.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.9,
                                      seed=7).choices[0].text for _ in range(2))
    assert a == b


PROMPTS = ["Name a fruit.", "What is 2+2?", "Say hi.", "Name a planet."]


def _ask_together(client, temperatures) -> list:
    """PROMPTS asked at once, one thread each, at these temperatures -> each answer's text, or the error it got."""
    out = [None] * len(PROMPTS)

    def ask(i):
        try:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}],
                                               max_tokens=24, temperature=temperatures[i])
            out[i] = r.choices[0].message.content
        except openai.APIError as e:
            out[i] = e
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _alone(smol_engine, i: int) -> str:
    return smol_engine.generate(PROMPTS[i], max_new_tokens=24, mode="chain", k=4).text


def test_concurrent_requests_share_sweeps(client, server, smol_engine):
    rows0, sweeps0 = _metric(server, "streamspec_sweep_sequences_total"), _metric(server, "streamspec_sweeps_total")
    out = _ask_together(client, [0, 0, 0, 0])
    rows = _metric(server, "streamspec_sweep_sequences_total") - rows0
    sweeps = _metric(server, "streamspec_sweeps_total") - sweeps0
    assert rows / sweeps > 1.0, (rows, sweeps)  # sweeps carried several requests at once
    assert out == [_alone(smol_engine, i) for i in range(len(PROMPTS))]


def test_a_tiny_temperature_beside_three_requests_fails_none(client, server, smol_engine):
    """temperature 1e-45 (logits / 1e-45 overflow: it once failed every request of its batch) is greedy, and
    the three greedy requests sharing its sweeps get their answers alone."""
    out = _ask_together(client, [1e-45, 0, 0, 0])
    assert out == [_alone(smol_engine, i) for i in range(len(PROMPTS))]
    assert json.loads(_get(server, "/health"))["status"] == "ok"


def test_a_request_that_fails_alone_beside_three_gets_its_own_error(client, server, smol_engine, monkeypatch):
    """A sequence whose sampler fails (NaN temperature, which validation never lets in: forced here) gets a 500
    error object; the three greedy requests beside it get their answers alone."""
    from streamspec_ray.speculative.sampling import SamplingParams

    real = SamplingParams.__post_init__

    def poisoned(self):
        real(self)
        if self.temperature == 0.5:
            object.__setattr__(self, "temperature", float("nan"))
    monkeypatch.setattr(SamplingParams, "__post_init__", poisoned)
    out = _ask_together(client, [0, 0.5, 0, 0])
    assert isinstance(out[1], openai.InternalServerError) and "not finite" in str(out[1])
    assert [out[i] for i in (0, 2, 3)] == [_alone(smol_engine, i) for i in (0, 2, 3)]


def test_client_gone_mid_stream_frees_its_slot(client, server):
    import http.client

    before = _metric(server, "streamspec_requests_total", '{reason="cancelled"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    got = 0
    while got < 4:
        line = r.readline()
        assert line, "the stream ended before the client left"
        got += line.startswith(b"data:")
    conn.sock.shutdown(2)  # the client leaves mid-stream
    conn.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _metric(server, "streamspec_requests_total", '{reason="cancelled"}') > before and \
                _metric(server, "streamspec_active_requests") == 0:
            break
        time.sleep(0.2)
    assert _metric(server, "streamspec_requests_total", '{reason="cancelled"}') == before + 1
    assert _metric(server, "streamspec_active_requests") == 0
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0).choices[0].text


# ------------------------------------------------------------------------------------------------- errors


def _post(server, path, data, headers=None):
    import urllib.error
    import urllib.request

    data = data if isinstance(data, str) else json.dumps(data)
    req = urllib.request.Request(server.url + path, data=data.encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", "{not json", None),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
])
def test_bad_requests_get_400(server, path, body, param):
    status, err, _ = _post(server, path, body)
    assert status == 400, err
    assert set(err["error"]) >= {"message", "type", "param", "code"} and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param


def test_api_key(smol_engine, server):
    app = serve.make_app(server.scheduler, MODEL, api_key="sekrit")
    srv = _Server(app)
    try:
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"authorization": "Bearer wrong"}):
            status, err, _ = _post(srv, "/v1/completions", body, headers)
            assert status == 401 and err["error"]["type"] == "authentication_error"
        status, ok, _ = _post(srv, "/v1/completions", body, {"authorization": "Bearer sekrit"})
        assert status == 200 and ok["choices"][0]["text"]
    finally:
        srv.stop()


def test_full_queue_gets_429(server, monkeypatch):
    def full(job):
        raise queue.Full
    monkeypatch.setattr(server.scheduler, "submit", full)
    status, err, headers = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 429 and err["error"]["type"] == "rate_limit_error" and headers["retry-after"] == "1"


def test_source_queue_is_bounded():
    from streamspec_ray.speculative.batch import Request, Source
    from streamspec_ray.speculative.sampling import SamplingParams

    src = Source(limit=2)
    reqs = [Request([1], 1, SamplingParams(), 0) for _ in range(3)]
    src.put(reqs[0])
    src.put(reqs[1])
    with pytest.raises(queue.Full):
        src.put(reqs[2])
    assert src(False) is reqs[0] and src(True) is reqs[1] and src(False) is None
    src.close()
    assert src(True) is None


def test_text_stream_holds_back_stop_prefixes(smol_engine):
    tok = smol_engine.tokenizer
    ts = serve.TextStream(tok, ["END"])
    ids = tok("abc EN")["input_ids"]
    assert "EN" not in ts.feed(ids)  # might be the start of END: held back
    assert ts.feed(tok("D more")["input_ids"]) == "" and ts.stopped and ts.text == "abc "


def test_failure_mid_generation_ends_that_stream_with_an_error_event(server, client, monkeypatch):
    """A sweep fails while a streamed request runs: its stream ends with an `error` event, and the server goes on
    answering (the loop starts again)."""
    import http.client

    from streamspec_ray import scheduler

    real, calls = scheduler._Counted._count, []

    def failing(self, *args):  # (every sweep is counted: one sequence's and a batch's)
        calls.append(1)
        if len(calls) == 2:  # the second sweep: tokens were already streamed
            raise RuntimeError("the disk went away")
        return real(self, *args)
    monkeypatch.setattr(scheduler._Counted, "_count", failing)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 200, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    text = conn.getresponse().read().decode()
    assert "event: error" in text and "the disk went away" in text and "[DONE]" not in text
    monkeypatch.setattr(scheduler._Counted, "_count", real)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0).choices[0].text
