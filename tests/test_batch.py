"""Batch generation: every prompt's tokens identical to one-at-a-time Engine.generate (greedy; sampled with
the same seed), whatever else shares its sweeps; and `streamspec batch` jobs: SIGKILL and resume, malformed
lines, a half-written last line. (RayEngine batches: tests/test_ray.py, which holds the Ray session.)"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from streamspec_ray import Engine, cli
from streamspec_ray.errors import ConfigError

random.seed(8)
PROMPTS = [[random.randrange(3, 256) for _ in range(random.randrange(1, 40))] for _ in range(18)]
BUDGETS = [random.randrange(1, 60) for _ in PROMPTS]
REQUESTS = [{"prompt_ids": p, "max_new_tokens": n} for p, n in zip(PROMPTS, BUDGETS)]


@pytest.fixture(scope="module")
def engines(tiny):
    return {d: Engine(target=tiny["store"], draft=d) for d in ("self-int4", "ngram")}


@pytest.fixture(scope="module")
def one_at_a_time(engines):
    """Greedy reference: each prompt generated alone (naive; chain equals it, see test_spec)."""
    eng = engines["ngram"]
    return [eng.generate(prompt_ids=p, max_new_tokens=n, mode="naive") for p, n in zip(PROMPTS, BUDGETS)]


CASES = {"int4-k4-b16": ("self-int4", dict(k=4, batch_size=16)), "int4-adaptive-b5": ("self-int4", dict(batch_size=5)),
         "ngram-k3-b16": ("ngram", dict(k=3, batch_size=16)), "naive-b7": ("ngram", dict(mode="naive", batch_size=7)),
         "tree8-b16": ("self-int4", dict(mode="tree", budget=8, batch_size=16)),
         "tree-ngram-b6": ("ngram", dict(mode="tree", batch_size=6))}


@pytest.mark.parametrize("draft,kw", CASES.values(), ids=CASES.keys())
def test_greedy_batch_identical_to_one_at_a_time(engines, one_at_a_time, draft, kw):
    mode = kw.get("mode", "chain")
    out = engines[draft].generate_batch(REQUESTS, **kw)
    assert len(out) == len(REQUESTS)
    for i, (got, want) in enumerate(zip(out, one_at_a_time)):
        assert got.token_ids == want.token_ids, (i, draft, kw)
        assert got.finish_reason == want.finish_reason
        assert got.stats["new_tokens"] == len(got.token_ids) and got.stats["mode"] == mode
    s = out.stats
    assert s["new_tokens"] == sum(len(r.token_ids) for r in one_at_a_time)
    # sequences share sweeps: far fewer sweeps than one sequence at a time would take
    assert s["sweeps"] < sum(r.stats["sweeps"] for r in out) and s["sequences_per_sweep"] > 1
    per_sweep = sum(u.bytes for u in engines[draft].store.stream_units)  # every layer read once per sweep
    assert s["bytes_read"] == s["sweeps"] * per_sweep
    assert sum(r.stats["bytes_read"] for r in out) <= s["bytes_read"]  # each prompt's share


def test_sampled_follows_each_request_seed(engines):
    """Sampled, fixed K (or tree budget): each request's tokens are Engine.generate's with that request's seed,
    in a batch or alone: what shares the sweeps does not matter."""
    eng = engines["self-int4"]
    reqs = [{"prompt_ids": p, "max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
            for i, p in enumerate(PROMPTS[:16])]
    out = eng.generate_batch(reqs, batch_size=16, k=3)
    for i, (r, got) in enumerate(zip(reqs, out)):
        want = eng.generate(prompt_ids=r["prompt_ids"], max_new_tokens=24, k=3, temperature=0.9, top_p=0.95,
                            seed=100 + i)
        assert got.token_ids == want.token_ids, i
    assert len({tuple(r.token_ids) for r in out}) > 1
    trees = eng.generate_batch(reqs[:8], batch_size=8, mode="tree", budget=6)
    for i, (r, got) in enumerate(zip(reqs, trees)):
        assert got.token_ids == eng.generate(prompt_ids=r["prompt_ids"], max_new_tokens=24, mode="tree", budget=6,
                                             temperature=0.9, top_p=0.95, seed=100 + i).token_ids, i


def test_callbacks_and_continuous_batching(engines):
    eng = engines["ngram"]
    done, tokens = [], {}
    out = eng.generate_batch(REQUESTS, batch_size=3, k=2, on_result=lambda i, r: done.append(i),
                             on_tokens=lambda i, t: tokens.setdefault(i, []).extend(t))
    assert sorted(done) == list(range(len(REQUESTS))) and done != sorted(done)  # completion order, not input order
    assert all(tokens[i] == r.token_ids for i, r in enumerate(out))
    assert out.stats["sequences_per_sweep"] <= 3


def test_bad_requests_are_refused_before_any_work(engines):
    eng = engines["ngram"]
    for bad, match in [({"prompt_ids": [1], "prompt": "x"}, "exactly one"), ({"prompt": "hi"}, "no tokenizer"),
                       ({"messages": [{"role": "user", "content": "hi"}]}, "no tokenizer"),
                       ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
                       ({"prompt_ids": [1], "temperature": -1.0}, "temperature"),
                       ({"prompt_ids": [1, 999]}, "outside the vocabulary"),
                       ({"prompt_ids": [1], "max_new_tokens": 10_000}, "context"), (3.5, "a request is")]:
        with pytest.raises(ConfigError, match=match):
            eng.generate_batch([REQUESTS[0], bad])
    with pytest.raises(ConfigError, match="unknown mode"):
        eng.generate_batch(REQUESTS, mode="beam")
    with pytest.raises(ConfigError, match="replicas need Ray"):
        eng.generate_batch(REQUESTS, replicas=2)
    with pytest.raises(ConfigError, match="at least 1"):
        eng.generate_batch(REQUESTS, batch_size=0)
    assert eng.generate_batch([]) == []


@pytest.mark.slow
def test_smollm2_batch_identical(smol_engine, smol_naive):
    """The embedded pair: text prompts of different lengths and budgets, and a chat given as messages."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, in a small"]
    budgets = [3, 9, 5, 12]
    chat = "Name a color."
    reqs = [{"prompt": p, "max_new_tokens": n} for p, n in zip(prompts, budgets)]
    reqs.append({"messages": [{"role": "user", "content": chat}], "max_new_tokens": 6})
    out = smol_engine.generate_batch(reqs, batch_size=4, k=4)
    for p, n, got in zip(prompts, budgets, out):
        assert got.token_ids == smol_naive(p, n), p
        assert got.text == smol_engine.decode(got.token_ids)
    assert out[-1].token_ids == smol_engine.generate(chat, max_new_tokens=6, k=4, chat=True).token_ids


# ---- `streamspec batch` ---------------------------------------------------------------------------------

def _lines(n: int = 24, max_new: int = 40) -> list[dict]:
    rng = random.Random(5)
    return [{"id": f"q{i}", "prompt_ids": [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))],
             "max_new_tokens": rng.randrange(max_new // 2, max_new)} for i in range(n)]


def _write(path, rows) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _results(path) -> dict:
    """id -> token_ids of the result records; fails on an id that appears twice."""
    out = {}
    for r in _records(path):
        if "error" not in r:
            assert r["id"] not in out, f"id {r['id']} twice"
            out[r["id"]] = r["token_ids"]
    return out


@pytest.fixture
def job(tiny, tmp_path, capsys, caplog):
    """Run `streamspec batch IN OUT --target tiny ARGS` in-process -> (exit code, stderr and log lines)."""
    def run(args, inp="in.jsonl", out="out.jsonl"):
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="streamspec"):
            rc = cli.main(["batch", str(tmp_path / inp), str(tmp_path / out), "--target", tiny["store"], *args])
        return rc, capsys.readouterr().err + caplog.text
    return run


def test_job_killed_and_resumed(tiny, tmp_path, job):
    """SIGKILL a running `streamspec batch` once OUT has a few results, rerun it: every id exactly once, each
    output identical to an uninterrupted run's (which used another batch size: greedy, it cannot matter)."""
    rows = _lines()
    _write(tmp_path / "in.jsonl", rows)
    rc, _ = job(["--batch-size", "16", "--k", "4"], out="ref.jsonl")
    assert rc == 0
    want = _results(tmp_path / "ref.jsonl")
    assert len(want) == len(rows)

    args = ["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--target", tiny["store"],
            "--batch-size", "2", "--k", "4", "--mode", "naive"]
    proc = subprocess.Popen([sys.executable, "-m", "streamspec_ray", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    out = tmp_path / "out.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    rc = proc.wait(timeout=60)
    assert rc == -signal.SIGKILL, (rc, proc.stderr.read().decode()[-2000:])
    partial = out.read_bytes().count(b"\n")
    assert 3 <= partial < len(rows)

    rc, err = job(["--batch-size", "2", "--k", "4", "--mode", "naive"])
    assert rc == 0, err
    assert f"({partial} already in" in err
    assert _results(out) == want


def test_malformed_lines_become_error_records(tiny, tmp_path, job):
    good = _lines(6, 12)
    bad = ["{not json", "[1, 2]", json.dumps({"prompt_ids": [1, 2]}), json.dumps({"id": {"a": 1}, "prompt_ids": [1]}),
           json.dumps({"id": "np"}), json.dumps({"id": "both", "prompt": "x", "prompt_ids": [1]}),
           json.dumps({**good[0], "max_new_tokens": 3}),
           json.dumps({"id": "t", "prompt_ids": [1], "temperature": "hot"}),
           json.dumps({"id": "long", "prompt_ids": [1], "max_new_tokens": 100_000}),
           json.dumps({"id": "txt", "prompt": "no tokenizer on the tiny store"})]
    rows = good[:3] + bad[:5] + [""] + good[3:] + bad[5:]
    _write(tmp_path / "in.jsonl", rows)
    rc, err = job(["--k", "3"])
    assert rc == 1 and "10 lines could not run" in err and "Traceback" not in err
    recs = _records(tmp_path / "out.jsonl")
    errors = {r["line"]: r for r in recs if "error" in r}
    want = {4: "not valid JSON", 5: "not a JSON object", 6: "no id", 7: "id must be", 8: "exactly one",
            13: "exactly one", 14: "duplicate id (first on line 1)", 15: "temperature", 16: "context",
            17: "no tokenizer"}
    assert sorted(errors) == sorted(want)
    for n, text in want.items():
        assert text in errors[n]["error"], (n, errors[n])
    assert errors[14]["id"] == good[0]["id"] and errors[4]["id"] is None
    assert sorted(_results(tmp_path / "out.jsonl")) == sorted(r["id"] for r in good)

    # a rerun drops the error records and checks those lines again: fixed lines fill in, bad ones stay bad
    rows[3] = json.dumps({"id": "fixed", "prompt_ids": [4, 5, 6], "max_new_tokens": 5})
    _write(tmp_path / "in.jsonl", rows)
    rc, err = job(["--k", "3"])
    assert rc == 1 and "9 lines could not run" in err and "(6 already in" in err
    recs = _records(tmp_path / "out.jsonl")
    assert len([r for r in recs if "error" in r]) == 9 and 4 not in {r["line"] for r in recs if "error" in r}
    assert sorted(_results(tmp_path / "out.jsonl")) == sorted([r["id"] for r in good] + ["fixed"])


def test_half_written_last_line_is_repaired(tiny, tmp_path, job):
    rows = _lines(8, 16)
    _write(tmp_path / "in.jsonl", rows)
    assert job(["--k", "4", "--batch-size", "3"])[0] == 0
    full = (tmp_path / "out.jsonl").read_bytes()
    lines = full.splitlines(keepends=True)
    cut = b"".join(lines[:5]) + lines[5][: len(lines[5]) // 2]  # killed while writing the sixth record
    (tmp_path / "out.jsonl").write_bytes(cut)
    rc, err = job(["--k", "4", "--batch-size", "3"])
    assert rc == 0 and "half-written last line" in err and "(5 already in" in err
    assert _results(tmp_path / "out.jsonl") == _results_of(full)
    assert (tmp_path / "out.jsonl").read_bytes().startswith(b"".join(lines[:5]))


def _results_of(data: bytes) -> dict:
    return {r["id"]: r["token_ids"] for r in map(json.loads, data.splitlines())}


def test_job_refusals(tiny, tmp_path, job):
    _write(tmp_path / "in.jsonl", _lines(2, 4))
    (tmp_path / "out.jsonl").write_text('{"id": "a", "token_ids": []}\nnot a record\n')
    rc, err = job([])
    errors = [line for line in err.splitlines() if line.startswith("error:")]  # (status lines are captured too)
    assert rc == 2 and errors == [f"error: {tmp_path / 'out.jsonl'} line 2 is not a record of streamspec batch: "
                                  "fix or remove it"]
    (tmp_path / "out.jsonl").write_text("")
    with open(tmp_path / "out.jsonl", "a") as held:  # another job holds OUT
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        rc, err = job([])
    assert rc == 2 and "being written by another streamspec batch job" in err
    rc, err = job(["--replicas", "2"])
    assert rc == 2 and "needs --ray" in err and len(err.strip().splitlines()) == 1
    rc, err = job([], inp="missing.jsonl")
    assert rc == 2 and "cannot read" in err
    rc, err = job([], out="no/such/dir/out.jsonl")
    assert rc == 2 and "cannot write" in err and "Traceback" not in err


def test_batch_controllers_learn_costs_only_from_rounds_that_prefill_nothing(engines, monkeypatch):
    """A round that also prefills a prompt (a refill) costs what no K explains: the sequences' K controllers
    learn its acceptance but not its times, and otherwise get their share of the round (the drafting split
    evenly, the sweep's fixed part split evenly plus their own rows' cost)."""
    from streamspec_ray.speculative import batch as B
    from streamspec_ray.speculative.draft_length import CostModelK

    calls = []

    class Spy(CostModelK):
        def update(self, k, accepted, draft_s, sweep_s, costs=True, sweep=None):
            calls.append((costs, k, draft_s, sweep_s))
            super().update(k, accepted, draft_s, sweep_s, costs, sweep)

    monkeypatch.setattr(B, "make_controller", lambda k: Spy())
    out = engines["self-int4"].generate_batch(REQUESTS[:8], batch_size=3, k="adaptive")
    assert [r.token_ids for r in out] == [r.token_ids for r in engines["ngram"].generate_batch(REQUESTS[:8],
                                                                                                 mode="naive")]
    assert {c for c, *_ in calls} == {True, False}  # refills happen mid-run
    before = Spy()
    before.update(4, 2, 0.1, 0.5)
    before.update(4, 3, 0.1, 0.6)
    t, sweeps = before.t_draft, list(before.sweeps)
    before.update(4, 4, 9.0, 9.0, costs=False)  # acceptance moves, the costs do not
    assert before.t_draft == t and before.sweeps == sweeps and before.acceptance > Spy().acceptance


def test_batch_trees_cut_short_by_the_tokens_left_teach_the_budget_nothing(engines, monkeypatch):
    """As tests/test_tree.py's loop test, for batches (and so for serving and Ray's controller): a tree that the
    tokens left cut short (a request with 2 new tokens: its first tree may be 1 deep) never reaches the
    budget controller; every other tree does."""
    from streamspec_ray.speculative import batch as B
    from streamspec_ray.speculative.draft_length import FixedBudget
    from streamspec_ray.speculative.tree import cut_short

    cut, grown, updated, keep = set(), set(), [], []  # (keep: the trees stay alive, so their ids stay theirs)
    propose = B.BatchDraft.propose_tree

    def recording_propose(self, s, budget, depth):
        tree = propose(self, s, budget, depth)
        (cut if cut_short(tree, depth, B.Policy.max_depth) else grown).add(id(tree))
        keep.append(tree)
        return tree

    class Recording(FixedBudget):
        def update(self, tree, accepted, sweep, costs=True):
            updated.append(id(tree))

    monkeypatch.setattr(B.BatchDraft, "propose_tree", recording_propose)
    monkeypatch.setattr(B, "make_budget_controller", lambda budget: Recording(8))
    requests = [{"prompt_ids": p, "max_new_tokens": n} for p, n in zip(PROMPTS[:6], (2, 2, 30, 30, 2, 30))]
    out = engines["self-int4"].generate_batch(requests, mode="tree", budget=8, batch_size=4)
    want = engines["ngram"].generate_batch(requests, mode="naive")
    assert [r.token_ids for r in out] == [r.token_ids for r in want]
    assert cut and grown  # (both kinds happened)
    assert not cut & set(updated) and set(updated) <= grown
