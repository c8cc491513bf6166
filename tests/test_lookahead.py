"""Drafting during the sweep (speculative/loop.Lookahead): the output never changes, a prepared proposal is used only
when verification's outcome is the one it was made for, and a wrong guess leaves the draft exactly as the round
left it."""
import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.speculative import loop
from streamspec_ray.speculative.draft_length import FixedBudget, FixedK
from streamspec_ray.speculative.sampling import SamplingParams
from streamspec_ray.speculative.tree import TokenTree

from conftest import TINY_PROMPTS


@pytest.mark.parametrize("mode,kw", [("chain", dict(k=4)), ("chain", dict(k="adaptive")),
                                     ("tree", dict(budget=8)), ("tree", dict(budget="adaptive"))])
def test_overlap_keeps_greedy_output(tiny_engines, mode, kw):
    """With and without overlap, and for a draft that always agrees (the target's own store: every guess
    right) and ones that often do not (skip:1, self-int4): the same tokens as naive."""
    ref, drafts = tiny_engines
    for prompt in TINY_PROMPTS:
        want = ref.generate(prompt_ids=prompt, max_new_tokens=40, mode="naive").token_ids
        for name, eng in drafts.items():
            on = eng.generate(prompt_ids=prompt, max_new_tokens=40, mode=mode, overlap=True, **kw)
            off = eng.generate(prompt_ids=prompt, max_new_tokens=40, mode=mode, overlap=False, **kw)
            assert on.token_ids == off.token_ids == want, (name, mode, kw, prompt)
            assert off.stats["stats"]["lookahead_prepared"] == 0 and off.stats["stats"]["draft_hidden_s"] == 0
            if name != "ngram":  # (a draft without a model has nothing to run ahead)
                assert on.stats["stats"]["lookahead_prepared"] > 0, name


def test_a_draft_that_agrees_is_reused(tiny, tiny_engines):
    """The target's own weights as the draft: the guessed outcome (the whole chain, then the draft's argmax)
    is what verification gives, so the rounds use the prepared proposals."""
    _, drafts = tiny_engines
    out = drafts[tiny["store"]].generate(prompt_ids=TINY_PROMPTS[2], max_new_tokens=40, mode="chain", k=4)
    s = out.stats["stats"]
    assert s["lookahead_reuse_rate"] >= 0.5, s
    assert s["lookahead_reused"] > 0 and s["draft_hidden_s"] >= 0  # (how much was hidden is timing: benches)


def _state(draft):
    n = draft.cache.capacity
    return (list(draft.tokens), draft._tree, draft.cache.length,
            [t.narrow(1, 0, n).clone() for t in draft.cache.k + draft.cache.v])


def _same(a, b):
    assert a[:3] == b[:3]
    n = a[2]
    for x, y in zip(a[3], b[3]):
        assert torch.equal(x[:, :n], y[:, :n])
    if a[1] is not None:  # a tree round's fed nodes live past the committed length
        hi = max(a[1][1].values(), default=n - 1) + 1
        for x, y in zip(a[3], b[3]):
            assert torch.equal(x[:, :hi], y[:, :hi])


@pytest.mark.parametrize("tree", [False, True])
def test_a_wrong_guess_puts_the_draft_back(tiny, tree):
    """A lookahead whose guess verification does not confirm is cancelled (or finished and discarded) and the
    draft's tokens, tree map and cache slots are those the round left; the next round then drafts what it
    would have drafted without the lookahead."""
    eng = Engine(target=tiny["store"], draft="skip:1")
    draft, params = eng.draft, SamplingParams()
    context = [5, 9, 13, 5, 9]
    draft.reset()
    if tree:
        t = draft.propose_tree(context, 12, params, 6)
        path = t.spine()
    else:
        path = draft.propose(context, 5, params, None).tokens
    before = _state(draft)
    ahead = loop.Lookahead(draft, loop.RoundLog())
    if tree:
        def make(ctx):
            return draft.propose_tree(ctx, 12, params, 6)
    else:
        def make(ctx):
            return draft.propose(ctx, 5, params, None)
    ahead.start(context, path, make)
    other = context + [(path[0] + 1) % 256]  # rejected at the first token
    got, _ = ahead.take(other)
    assert got is None
    _same(_state(draft), before)
    # the draft then proposes for `other` exactly as a fresh draft would
    want = Engine(target=tiny["store"], draft="skip:1").draft
    if tree:
        want.propose_tree(context, 12, params, 6)
        a, b = draft.propose_tree(other, 12, params, 6), want.propose_tree(other, 12, params, 6)
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
    else:
        want.propose(context, 5, params, None)
        assert draft.propose(other, 5, params, None).tokens == want.propose(other, 5, params, None).tokens
    ahead.close()


def test_a_right_guess_is_the_fresh_proposal(tiny):
    """When the outcome is the guess, the prepared proposal equals what drafting after the sweep gives."""
    eng = Engine(target=tiny["store"], draft="skip:1")
    draft, params = eng.draft, SamplingParams()
    context = [200, 3, 77]
    draft.reset()
    path = draft.propose(context, 4, params, None).tokens
    ahead = loop.Lookahead(draft, loop.RoundLog())
    ahead.start(context, path, lambda ctx: draft.propose(ctx, 4, params, None))
    ahead.job[2].wait()
    guess = ahead.job[3]["guess"]
    assert guess[: len(context) + 4] == context + path
    got, _ = ahead.take(guess)
    fresh = Engine(target=tiny["store"], draft="skip:1").draft
    assert got.tokens == fresh.propose(guess, 4, params, None).tokens
    ahead.close()


def test_spine_follows_the_best_scored_child():
    t = TokenTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 3], [-0.5, -0.2, -1.5, -0.9, -1.0])
    assert t.spine() == [2]  # the root's best child (token 2) is a leaf
    t = TokenTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 3], [-0.1, -0.2, -1.5, -0.9, -1.0])
    assert t.spine() == [1, 4, 5]
    assert TokenTree([7, 8], [-1, 0]).spine() == [7, 8]  # no scores: the first child
    assert TokenTree([], []).spine() == []


def test_sampled_rounds_do_not_run_ahead(tiny_engines):
    """A sampled round drafts after the sweep (background draws would make a seeded run depend on timing):
    nothing prepared, and the same seeded output with overlap on or off."""
    _, drafts = tiny_engines
    eng = drafts["skip:1"]
    kw = dict(prompt_ids=TINY_PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=3)
    for mode, fixed in (("chain", dict(k=4)), ("tree", dict(budget=8))):  # (adaptive K follows timings)
        on = eng.generate(mode=mode, overlap=True, **fixed, **kw)
        off = eng.generate(mode=mode, overlap=False, **fixed, **kw)
        assert on.token_ids == off.token_ids
        assert on.stats["stats"]["lookahead_prepared"] == 0


def test_loop_functions_take_overlap(tiny):
    """The loop's own entry points: a fixed K and a fixed budget, overlap on, identical to overlap off."""
    from streamspec_ray.engine import LocalTarget

    eng = Engine(target=tiny["store"], draft="skip:1")
    outs = []
    for overlap in (True, False):
        for gen, ctl in ((loop.generate, FixedK(3)), (loop.generate_tree, FixedBudget(6))):
            eng.draft.reset()
            t = LocalTarget(eng.executor)
            got, _, _ = gen(t, eng.draft, [5, 9, 13], 20, SamplingParams(), ctl, overlap=overlap)
            outs.append(got)
    assert outs[:2] == outs[2:]


def test_default_overlaps_chains_not_trees(tiny_engines):
    """overlap=None (the default): chain rounds run ahead, tree rounds do not (see Engine.generate)."""
    _, drafts = tiny_engines
    eng = drafts["skip:1"]
    kw = dict(prompt_ids=TINY_PROMPTS[2], max_new_tokens=24)
    assert eng.generate(mode="chain", k=4, **kw).stats["stats"]["lookahead_prepared"] > 0
    assert eng.generate(mode="tree", budget=8, **kw).stats["stats"]["lookahead_prepared"] == 0


def test_a_draft_that_ran_ahead_still_pickles(tiny_engines):
    """A draft object is shipped to Ray actors by pickling: its lookahead thread and cancel flag stay behind."""
    import pickle

    _, drafts = tiny_engines
    eng = drafts["skip:1"]
    eng.generate(prompt_ids=TINY_PROMPTS[2], max_new_tokens=12, mode="chain", k=4)
    copy = pickle.loads(pickle.dumps(eng.draft))
    assert not copy.cancel.is_set() and not hasattr(copy, "_lookahead_pool")
    assert copy.propose(TINY_PROMPTS[2], 4, SamplingParams(), None).tokens == \
        eng.draft.propose(TINY_PROMPTS[2], 4, SamplingParams(), None).tokens
