"""One request's failure stays its own: a sequence that fails while generating (a sampler fed NaN, a sweep that
raises on its chunk) ends with finish_reason "error" and its message, and every other sequence of its batch
gives what it gives alone. A temperature too small to compute is greedy. The batch job turns such a line, and a
line that is not UTF-8, into error records, completes the rest, and a rerun redoes only those lines.
(The server's side: tests/test_serve.py.)"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from streamspec_ray import Engine, cli
from streamspec_ray.errors import SamplingError
from streamspec_ray.runtime.executor import StreamingExecutor
from streamspec_ray.speculative import batch
from streamspec_ray.speculative.sampling import MIN_TEMPERATURE, SamplingParams, logits_to_probs

PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 8, 120, 200, 31], [250, 11], [64, 65, 66, 67, 68, 69, 70]]
POISON = [251, 252, 253, 254]  # a prompt whose sweeps raise (_poisoned_sweeps)


@pytest.fixture(scope="module")
def eng(tiny):
    return Engine(target=tiny["store"], draft="self-int4")


def _requests(eng, **opts) -> list[batch.Request]:
    defaults = dict(max_new_tokens=20, temperature=0.0, top_p=1.0, top_k=0, seed=0) | opts
    return [batch.to_request(eng, {"prompt_ids": p, "seed": 10 + i}, defaults) for i, p in enumerate(PROMPTS)]


def _nan_temperature(req: batch.Request) -> batch.Request:
    """The request with a temperature no validation lets in: every distribution it samples is NaN."""
    object.__setattr__(req.params, "temperature", float("nan"))
    return req


def test_a_temperature_too_small_to_compute_is_greedy(eng):
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    tiny = eng.generate(prompt_ids=PROMPTS[0], max_new_tokens=16, temperature=1e-45, seed=3)
    greedy = eng.generate(prompt_ids=PROMPTS[0], max_new_tokens=16)
    assert tiny.token_ids == greedy.token_ids


def test_the_sampler_refuses_a_distribution_that_is_not_finite():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    with pytest.raises(SamplingError, match="not finite"):
        logits_to_probs(logits, SamplingParams(temperature=0.7))
    assert torch.allclose(logits_to_probs(logits[[0, 2]], SamplingParams(temperature=0.7)).sum(-1), torch.ones(2))


CASES = {"chain-greedy": dict(k=4), "chain-sampled": dict(k=4, temperature=0.9, top_p=0.95),
         "tree-greedy": dict(mode="tree", budget=6), "tree-sampled": dict(mode="tree", budget=6, temperature=0.9),
         "naive-sampled": dict(mode="naive", temperature=0.9)}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_a_request_whose_sampler_fails_ends_alone(eng, kw):
    """NaN sampling beside three normal requests: a chain or tree drafts for all of them in one batched step
    (a shared step: the round is rerun alone per sequence), naive fails in the request's own verification."""
    kw = dict(kw)
    mode, policy = kw.pop("mode", "chain"), {key: kw.pop(key) for key in ("k", "budget") if key in kw}
    alone = [eng.generate(prompt_ids=r.prompt_ids, max_new_tokens=20, mode=mode, seed=r.seed,
                          temperature=r.params.temperature, top_p=r.params.top_p, **policy).token_ids
             for r in _requests(eng, **kw)]
    reqs = _requests(eng, **kw)
    _nan_temperature(reqs[1])
    out = eng.generate_batch(reqs, batch_size=4, mode=mode, **policy)
    assert out[1].finish_reason == "error" and "not finite" in out[1].error
    for i in (0, 2, 3):
        assert out[i].finish_reason in ("length", "stop") and out[i].error is None
        assert out[i].token_ids == alone[i], i


def _poisoned_sweeps(monkeypatch) -> list[int]:
    """Sweeps carrying a chunk that starts with POISON raise; -> a list counting them."""
    raised, sweep_batch = [], StreamingExecutor.sweep_batch

    def poisoned(self, chunks):
        if any(list(c.ids[: len(POISON)]) == POISON for c in chunks):
            raised.append(len(chunks))
            raise RuntimeError("injected: this chunk cannot be swept")
        return sweep_batch(self, chunks)
    monkeypatch.setattr(StreamingExecutor, "sweep_batch", poisoned)
    return raised


@pytest.mark.parametrize("kw", [dict(k=4), dict(k=4, temperature=0.8), dict(mode="tree", budget=6)],
                         ids=["chain-greedy", "chain-sampled", "tree-greedy"])
def test_a_sweep_that_fails_on_one_chunk_fails_only_its_request(eng, monkeypatch, kw):
    kw = dict(kw)
    mode, policy = kw.pop("mode", "chain"), {key: kw.pop(key) for key in ("k", "budget") if key in kw}
    alone = [eng.generate(prompt_ids=r.prompt_ids, max_new_tokens=20, mode=mode, seed=r.seed,
                          temperature=r.params.temperature, **policy).token_ids for r in _requests(eng, **kw)]
    raised = _poisoned_sweeps(monkeypatch)
    reqs = _requests(eng, **kw)
    reqs.insert(2, batch.to_request(eng, {"prompt_ids": POISON + [9, 9]}, dict(max_new_tokens=20, temperature=0.0,
                                                                                top_p=1.0, top_k=0, seed=0)))
    out = eng.generate_batch(reqs, batch_size=5, mode=mode, **policy)
    assert raised == [5, 1]  # the shared sweep, then the poisoned chunk alone
    assert out[2].finish_reason == "error" and "injected" in out[2].error and out[2].token_ids == []
    assert [r.token_ids for i, r in enumerate(out) if i != 2] == alone


def test_a_request_that_fails_to_start_ends_alone(eng):
    reqs = _requests(eng)
    reqs[0].seed = 2**70  # (no torch.Generator takes it)
    out = eng.generate_batch(reqs, batch_size=2, k=4)
    assert out[0].finish_reason == "error" and out[0].error
    assert [r.token_ids for r in out[1:]] == [eng.generate(prompt_ids=p, max_new_tokens=20, k=4).token_ids
                                              for p in PROMPTS[1:]]


def test_batch_job_keeps_a_poisoned_and_a_non_utf8_line_to_themselves(tiny, tmp_path, capsys, caplog,
                                                                       monkeypatch):
    rows = [json.dumps({"id": f"q{i}", "prompt_ids": p, "max_new_tokens": 12}).encode()
            for i, p in enumerate(PROMPTS)]
    rows.insert(1, json.dumps({"id": "poison", "prompt_ids": POISON, "max_new_tokens": 12}).encode())
    rows.insert(4, b'{"id": "latin1", "prompt": "caf\xe9"}')
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    out = tmp_path / "out.jsonl"

    def job():
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="streamspec"):
            rc = cli.main(["batch", str(tmp_path / "in.jsonl"), str(out), "--target", tiny["store"], "--k", "4",
                           "--batch-size", "8"])
        return rc, capsys.readouterr().err + caplog.text

    raised = _poisoned_sweeps(monkeypatch)
    rc, err = job()
    assert rc == 1 and "Traceback" not in err and "2 lines could not run" in err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    errors = {r["id"]: r["error"] for r in recs if "error" in r}
    assert errors.keys() == {"poison", None}
    assert errors["poison"].startswith("line 2: generation failed:") and "injected" in errors["poison"]
    assert errors[None] == "line 5: not valid UTF-8 (byte 0xe9 at column 32)"
    done = {r["id"]: r["token_ids"] for r in recs if "error" not in r}
    assert sorted(done) == ["q0", "q1", "q2", "q3"]
    eng = Engine(target=tiny["store"], draft="self-int4")
    assert [done[f"q{i}"] for i in range(4)] == [eng.generate(prompt_ids=p, max_new_tokens=12, k=4).token_ids
                                                 for p in PROMPTS]

    # a rerun redoes only the two failed lines: fixed, they fill in; the finished lines are not run again
    monkeypatch.undo()
    rows[4] = json.dumps({"id": "latin1", "prompt_ids": [3, 4], "max_new_tokens": 5}).encode()
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    raised.clear()
    rc, err = job()
    assert rc == 0 and "2 prompts done (4 already in" in err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == ["latin1", "poison", "q0", "q1", "q2", "q3"]
    assert all("error" not in r for r in recs) and {r["id"]: r["token_ids"] for r in recs if r["id"] in done} == done
