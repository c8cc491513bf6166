"""Tree speculation: greedy output identical to naive for every draft and budget, the sampled tree loop's
output distribution equal to the target's, cache compaction after a tree, and the budget controller."""
import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.speculative import loop
from streamspec_ray.speculative.draft_length import CostModelBudget, FixedBudget
from streamspec_ray.speculative.sampling import SamplingParams, logits_to_probs
from streamspec_ray.speculative.tree import TokenTree, grow_tree, verify_tree

from conftest import every_draft_vs_naive
from test_rejection import MIN_PVALUE, chi2_pvalue, dirichlet, tv

BUDGETS = [1, 2, 3, 8, 32, 128, "adaptive"]


@pytest.mark.parametrize("budget", BUDGETS)
def test_tiny_tree_greedy_equals_naive_every_draft(tiny_engines, budget):
    for s in every_draft_vs_naive(tiny_engines, 64, mode="tree", budget=budget):
        assert s["sweeps"] == s["rounds"]  # one sweep per round, the prompt included
        if isinstance(budget, int):
            assert max(s["stats"]["nodes_per_round"]) <= budget


def test_smollm2_tree_greedy_equals_naive(smol_store, smol_engine, smol_naive):
    prompt, n = "The capital of France is", 32
    want = smol_naive(prompt, n)
    for budget in (16, 64, "adaptive"):
        out = smol_engine.generate(prompt, max_new_tokens=n, mode="tree", budget=budget)
        assert out.token_ids == want, budget
        assert out.stats["tokens_per_sweep"] > 1.5
    for draft in ("ngram", "skip:14,15"):
        eng = Engine(target=smol_store, draft=draft)
        assert eng.generate(prompt, max_new_tokens=n, mode="tree", budget=32).token_ids == want, draft


def test_tree_keeps_the_accepted_path_in_both_caches(tiny):
    """After tree rounds the target's cache (compacted, no second sweep) holds the K/V a plain sweep over the
    same tokens gives, and the draft's cache holds the accepted path too (nothing re-fed but the last token)."""
    from streamspec_ray.engine import LocalTarget

    eng = Engine(target=tiny["store"], draft=tiny["store"])
    prompt = [5, 9, 13]
    want = eng.generate(prompt_ids=prompt, max_new_tokens=30, mode="naive").token_ids
    eng.draft.reset()
    t = LocalTarget(eng.executor)
    got, _, log = loop.generate_tree(t, eng.draft, prompt, 30, SamplingParams(), FixedBudget(16))
    seq = prompt + got
    fresh = eng.executor.new_cache()
    eng.executor.sweep(seq[:-1], fresh)
    assert got == want and t.length == len(seq) - 1
    assert max(log.accepted) > 0
    for a, b in zip(t.cache.k + t.cache.v, fresh.k + fresh.v):
        torch.testing.assert_close(a[:, : t.length], b[:, : t.length], atol=1e-5, rtol=1e-5)
    draft = eng.draft
    assert draft.tokens == seq[: len(draft.tokens)]
    draft._sync(seq)  # what the next round would do: compact, then feed the missing tail
    assert draft.tokens == seq and draft.cache.length == len(seq)
    dfresh = eng.executor.new_cache()
    eng.executor.sweep(seq, dfresh)
    for a, b in zip(draft.cache.k + draft.cache.v, dfresh.k + dfresh.v):  # the draft is the target's own weights
        torch.testing.assert_close(a[:, : len(seq)], b[:, : len(seq)], atol=1e-5, rtol=1e-5)


def test_tree_when_the_caches_grow(tiny_engines):
    """A long prompt and budget 128 push both caches past their first capacity mid-generation (they grow
    inside a sweep) and the compaction after the tree still works."""
    ref, drafts = tiny_engines
    prompt = [(7 * i) % 250 + 3 for i in range(240)]
    want = ref.generate(prompt_ids=prompt, max_new_tokens=24, mode="naive").token_ids
    assert drafts["self-int4"].generate(prompt_ids=prompt, max_new_tokens=24, mode="tree", budget=128).token_ids == want


def test_verify_tree_greedy_walks_the_argmax_path():
    # root -> 3 (node 0) -> 4 (node 2); root -> 5 (node 1)
    tree = TokenTree([3, 5, 4], [-1, -1, 0])
    logits = torch.full((4, 8), -5.0)
    logits[0, 3] = logits[1, 4] = logits[3, 7] = 5.0  # root says 3, node 0 says 4, node 2 says 7
    logits[2, 1] = 5.0
    path, emitted = verify_tree(tree, logits, SamplingParams())
    assert path == [0, 2] and emitted == [3, 4, 7]
    logits[0] = -5.0
    logits[0, 6] = 5.0  # no child of the root carries 6
    assert verify_tree(tree, logits, SamplingParams()) == ([], [6])
    with pytest.raises(ValueError):
        verify_tree(tree, logits[:3], SamplingParams())
    with pytest.raises(ValueError):
        TokenTree([1, 2], [1, -1])  # a parent after its child


def test_tree_mask_and_positions():
    tree = TokenTree([3, 5, 4, 6], [-1, -1, 0, 2])
    assert tree.depths == [1, 1, 2, 3]
    assert tree.positions(10, 2).tolist() == [10, 11, 12, 12, 13, 14]
    m = tree.chunk_mask(2)
    assert m[:2, :2].tolist() == [[True, False], [True, True]]
    assert m[2:, :2].all()
    assert m[2:, 2:].tolist() == [[True, False, False, False], [False, True, False, False],
                                  [True, False, True, False], [True, False, True, True]]


class MarkovTarget:
    """A target whose next-token logits depend on the last token only: table [V, V]. The loop's Target
    interface with a cache that only counts."""

    def __init__(self, table):
        self.table, self.length, self.sweeps = table, 0, 0

    def sweep(self, tokens, logits_from, positions=None, mask=None):
        self.length += len(tokens)
        self.sweeps += 1
        from streamspec_ray.runtime.executor import SweepStats
        return self.table[torch.tensor(tokens[logits_from:])], SweepStats(len(tokens), 0, 0, 0, 0, 0, 1e-3)

    def truncate(self, n):
        self.length = n

    def compact(self, at, slots):
        self.length = at + len(slots)


class MarkovDraft:
    """A different Markov chain, growing real trees with grow_tree (one 'batched call' per depth)."""

    def __init__(self, table):
        self.table = table

    def propose_tree(self, context, budget, params, max_depth):
        def expand(nodes):
            return self.table[torch.tensor([n.token for n in nodes])]

        tree, _ = grow_tree(self.table[context[-1]], expand, budget, max_depth, params)
        return tree


@pytest.mark.parametrize("params,budget", [(SamplingParams(temperature=1.0), 6),
                                           (SamplingParams(temperature=0.7, top_k=4), 3),
                                           (SamplingParams(temperature=1.0, top_p=0.8), 12)])
def test_sampled_tree_loop_matches_target_distribution(params, budget):
    """Three new tokens over many seeds: the joint distribution of (t1, t2, t3) from the tree loop equals the
    target's (product of its processed conditionals): chi-square p > 1e-3, and the total variation within 1.5x
    what sampling noise alone gives (0.5 * sum sqrt(2 p / (pi n)) for n draws)."""
    V, n, trials = 6, 3, 12_000
    p_tab = dirichlet((V, V), seed=1, conc=0.7).log()
    q_tab = dirichlet((V, V), seed=2, conc=0.7).log()
    probs = logits_to_probs(p_tab, params)  # [V, V] processed target conditionals
    exact = torch.zeros(V, V, V)
    start = 2
    exact += probs[start][:, None, None] * probs[:, :, None] * probs[None, :, :]
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V ** n)
    draft = MarkovDraft(q_tab)
    multi = 0
    for _ in range(trials):
        target = MarkovTarget(p_tab)
        out, _, log = loop.generate_tree(target, draft, [start], n, params, FixedBudget(budget), generator=g)
        a, b, c = out
        counts[a * V * V + b * V + c] += 1
        multi += target.sweeps < n
    flat = exact.reshape(-1)
    assert chi2_pvalue(counts, flat) > MIN_PVALUE
    noise = 0.5 * float((2 * flat.double() / (torch.pi * trials)).sqrt().sum())
    assert tv(counts, flat) < 1.5 * noise
    assert multi > trials * 0.2  # the trees did accept drafts (not a chain of single-token rounds)


def _settle(sweep_of, draft_s_per_node: float, score_step: float) -> int:
    """A CostModelBudget after 20 rounds of chain-shaped trees whose nodes score -score_step each, drafted at
    draft_s_per_node, accepting 6 tokens at most; sweep_of(n, draft_s) -> the round's SweepStats -> its budget."""
    c = CostModelBudget(budget_max=128, start=8)
    for _ in range(20):
        n = c.budget()
        tree = TokenTree(list(range(n)), list(range(-1, n - 1)), scores=[-score_step * (i + 1) for i in range(n)])
        tree.draft_s = draft_s_per_node * n
        c.update(tree, min(n, 6), sweep_of(n, tree.draft_s))
    return c.budget()


def test_budget_controller_follows_the_sweep_cost():
    from streamspec_ray.runtime.executor import SweepStats

    def run(cost_per_token):
        return _settle(lambda n, _: SweepStats(n + 1, 0, 0, 0, 0, 0, 0.5 + cost_per_token * (n + 1)), 0.001, 0.05)

    flat, steep = run(0.0005), run(0.4)
    assert flat > steep
    assert steep <= 8 and flat >= 32


def test_budget_controller_counts_drafting_hidden_under_reads_that_run_ahead():
    """Sweeps whose reads run ahead during drafting (SweepStats.read_ahead) wait only for what drafting did not
    cover: a round takes the longer of the reads and drafting plus compute, so while the reads are longer, a
    bigger tree's drafting costs nothing. Without read-ahead the same drafting adds to every round."""
    from streamspec_ray.runtime.executor import SweepStats

    def run(read_ahead):
        def sweep(n, draft_s, compute=0.05):  # 1 s of reads
            stall = max(0.0, 1.0 - draft_s - compute) if read_ahead else 1.0 - compute
            return SweepStats(n + 1, 0, 1.0, 0, compute, stall, compute + stall, read_ahead=read_ahead)
        return _settle(sweep, 0.006, 0.1)

    assert run(read_ahead=True) == 128  # drafting (0.77 s at 128 nodes) under 1 s of reads
    assert run(read_ahead=False) <= 32


def test_budget_forecast_beyond_the_last_tree_follows_its_own_curve():
    """Above the last tree's size, each doubling of the budget is forecast to gain what the last one did times
    the ratio of the forecast's last two doublings (a tree whose gains hold up is forecast to keep gaining)."""
    c = CostModelBudget()
    c.forecast = [1.0, 1.5, 2.0, 2.5, 3.0, 3.25, 3.5, 3.75, 4.0]  # gains 1.0 from 2 to 4 nodes and from 4 to 8
    assert [c.expected(n) for n in (8, 16, 32)] == [4.0, 5.0, 6.0]
    c.forecast = [1.0, 1.5, 2.0, 2.5, 3.0, 3.125, 3.25, 3.375, 3.5]  # 1.0, then 0.5: each doubling half the last
    assert [c.expected(n) for n in (16, 32)] == [3.75, 3.875]


def test_a_level_does_not_spill_one_node_into_a_row_block_of_its_own():
    """With the draft's forward paying by blocks of rows (row_block), a depth of 5 new nodes feeds its 4 likeliest
    (5 rows cost what 8 do); the fifth stays in the tree as a leaf. Blocks filled (4 nodes) feed whole."""
    V = 16
    root = torch.full((V,), -9.0)
    root[:5] = torch.tensor([2.0, 1.9, 1.8, 1.7, 1.6])  # five likely children, token 4 the least
    fed = []

    def expand(nodes):
        fed.append(sorted(n.token for n in nodes))
        return torch.zeros(len(nodes), V)

    params = SamplingParams(temperature=1.0)
    grow_tree(root, expand, 16, 2, params, min_level_mass=0.0, row_block=1)
    assert fed == [[0, 1, 2, 3, 4]]
    fed.clear()
    tree, _ = grow_tree(root, expand, 16, 2, params, min_level_mass=0.0, row_block=4)
    assert fed == [[0, 1, 2, 3]]
    assert 4 in tree.tokens[:5] and tree.parents[tree.tokens.index(4)] == -1  # a leaf at depth 1
    root[4] = -9.0  # four likely children: a whole block, all fed
    fed.clear()
    grow_tree(root, expand, 16, 2, params, min_level_mass=0.0, row_block=4)
    assert fed == [[0, 1, 2, 3]]


def test_drafts_on_the_int4_kernel_pay_by_blocks_of_rows(tiny_engines):
    from streamspec_ray.quant.packed import KERNEL_ROW_BLOCK, PackedInt4

    _, drafts = tiny_engines
    on_kernel = [t for _, w in drafts["self-int4"].draft.units for t in w.values()
                 if isinstance(t, PackedInt4) and t.kernel]
    assert drafts["self-int4"].draft.row_block == (KERNEL_ROW_BLOCK if on_kernel else 1)
    assert drafts["skip:1"].draft.row_block == 1  # (the target's own fp32 layers)


def test_growth_stops_at_a_depth_too_unlikely_to_pay_for_its_forward():
    """A depth whose new nodes hold under min_level_mass of path probability is not fed to the draft (a forward
    costs nearly as much for one row as for several); the nodes it would have fed stay in the tree as leaves."""
    V = 8
    root = torch.full((V,), -9.0)
    root[0] = 9.0  # after the context the draft is sure of token 0; after token 0 it gives each token ~1/8
    after = torch.zeros(V)
    after[3] = 0.01  # (token 3 a hair likelier: no ties)
    fed = []

    def expand(nodes):
        fed.append([n.token for n in nodes])
        return after.expand(len(nodes), V)

    params = SamplingParams(temperature=1.0)  # (scores are the draft's own probabilities)
    every, _ = grow_tree(root, expand, 2, 5, params, min_level_mass=0.0)
    assert fed == [[0], [3]]  # depth 2's one node (path probability ~1/8) fed too; its children are too unlikely
    fed.clear()
    tree, _ = grow_tree(root, expand, 2, 5, params)  # (MIN_LEVEL_MASS: 0.3 > 1/8)
    assert fed == [[0]]
    assert tree.tokens == every.tokens == [0, 3] and tree.parents == every.parents == [-1, 0]


def test_a_tree_cut_short_by_the_tokens_left_teaches_the_budget_nothing():
    """The last rounds' trees are as deep as the tokens left allow, not as the draft would grow them: the budget
    controller does not learn from them (the engine's next generation resumes from what it learned)."""
    V = 6
    table = torch.full((V, V), -9.0)
    for t in range(V):
        table[t, (t + 1) % V] = 9.0  # target and draft alike: t is surely followed by t + 1

    class Recording(FixedBudget):
        def update(self, tree, accepted, sweep, costs=True):
            seen.append((tree.depth, accepted))

    seen = []
    out, _, log = loop.generate_tree(MarkovTarget(table), MarkovDraft(table), [0], 20, SamplingParams(),
                                     Recording(8), max_depth=6)
    assert out == [(1 + i) % V for i in range(20)]
    assert log.k == [6, 6, 5]  # (7 + 7 + 6 tokens: the last tree was cut to depth 5)
    assert seen == [(6, 6), (6, 6)]
