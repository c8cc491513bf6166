"""A draft in a process of its own (spec/procdraft.py): the same outputs as the draft in process, greedy and
seeded sampling, lookahead in trees too, and one clear error when the process is gone."""
import pytest

from streamspec_ray import Engine
from streamspec_ray.spec.procdraft import DraftProcessLost, ProcessDraft

from conftest import TINY_PROMPTS


@pytest.fixture(scope="module")
def engines(tiny):
    here = Engine(target=tiny["store"], draft="skip:1")
    there = Engine(target=tiny["store"], draft="skip:1", draft_process=True)
    yield here, there
    there.draft.close()


@pytest.mark.parametrize("mode,kw", [("chain", dict(k=4)), ("tree", dict(budget=8)), ("tree", dict(budget="adaptive"))])
def test_same_greedy_output_and_trees_run_ahead(engines, mode, kw):
    here, there = engines
    assert isinstance(there.draft, ProcessDraft)
    for prompt in TINY_PROMPTS:
        want = here.generate(prompt_ids=prompt, max_new_tokens=40, mode=mode, overlap=False, **kw)
        got = there.generate(prompt_ids=prompt, max_new_tokens=40, mode=mode, **kw)  # (overlap: the default)
        assert got.token_ids == want.token_ids, (mode, kw, prompt)
        s = got.stats["stats"]
        assert s["lookahead_prepared"] > 0 and 0 <= s["lookahead_reused"] <= s["lookahead_prepared"]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_same_seeded_sample(engines, mode):
    """The generator crosses as its state: a seeded sampled run draws what the draft in process draws."""
    here, there = engines
    for seed in (1, 2):
        kw = dict(prompt_ids=TINY_PROMPTS[1], max_new_tokens=32, mode=mode, k=4, budget=8, temperature=0.9,
                  top_p=0.9, seed=seed)
        assert there.generate(**kw).token_ids == here.generate(**kw).token_ids


def test_a_failure_in_the_process_is_raised_here(engines):
    _, there = engines
    with pytest.raises(AttributeError, match="greedy"):  # (no sampling parameters)
        there.draft.propose_tree([1, 2, 3], "many", None, 4)
    # the process still serves
    assert there.generate(prompt_ids=TINY_PROMPTS[0], max_new_tokens=8, mode="chain", k=2).token_ids


def test_a_dead_process_is_one_clear_error(tiny):
    eng = Engine(target=tiny["store"], draft="skip:1", draft_process=True)
    want = eng.generate(prompt_ids=TINY_PROMPTS[0], max_new_tokens=8, mode="chain", k=2).token_ids
    eng.draft.proc.kill()
    eng.draft.proc.wait()
    with pytest.raises(DraftProcessLost, match="draft process ended"):
        eng.generate(prompt_ids=TINY_PROMPTS[0], max_new_tokens=8, mode="chain", k=2)
    eng.set_draft("skip:1")  # a new draft (and process) and the engine goes on
    assert eng.generate(prompt_ids=TINY_PROMPTS[0], max_new_tokens=8, mode="chain", k=2).token_ids == want
    eng.draft.close()


def test_close_ends_the_process(tiny):
    eng = Engine(target=tiny["store"], draft="skip:1", draft_process=True)
    proc = eng.draft.proc
    eng.set_draft(None)  # (replacing the draft closes its process)
    assert proc.poll() is not None


def test_only_model_drafts_move(tiny):
    """An n-gram draft has no model to move: it stays in process."""
    eng = Engine(target=tiny["store"], draft="ngram", draft_process=True)
    assert not isinstance(eng.draft, ProcessDraft)
