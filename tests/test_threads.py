"""Compute threads: the sweep's count (cores minus the reader's), the drafting count (the reader's core too,
between sweeps), and that a round's drafting threads are put back before the target sweeps."""
import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.runtime import threads
from streamspec_ray.speculative import loop
from streamspec_ray.speculative.draft_length import FixedBudget, FixedK
from streamspec_ray.speculative.sampling import SamplingParams


def test_plan_threads_leaves_the_reader_a_core_only_while_sweeping():
    cores, busy, _ = threads.free_cores(sample_s=0.01)
    compute, drafting, why = threads.plan_threads()
    assert 1 <= compute <= drafting <= cores and "reader" in why
    assert busy < cores


def test_using_sets_and_restores():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with threads.using(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with threads.using(None):
        assert torch.get_num_threads() == before


class _Counting:
    """A draft that records torch's thread count whenever the round asks it for a proposal."""

    def __init__(self, draft):
        self.draft, self.seen = draft, []

    def __getattr__(self, name):
        return getattr(self.draft, name)

    def propose(self, *a, **kw):
        self.seen.append(torch.get_num_threads())
        return self.draft.propose(*a, **kw)

    def propose_tree(self, *a, **kw):
        self.seen.append(torch.get_num_threads())
        return self.draft.propose_tree(*a, **kw)


def test_drafting_threads_apply_to_drafting_only(tiny):
    """The round drafts with draft_threads, the target sweeps with the engine's count, and the output is the
    same whatever the draft computed with."""
    from streamspec_ray.engine import LocalTarget

    eng = Engine(target=tiny["store"], draft="skip:1", threads=1)
    sweeps = []
    sweep = eng.executor.sweep

    def counting_sweep(*a, **kw):
        sweeps.append(torch.get_num_threads())
        return sweep(*a, **kw)

    eng.executor.sweep = counting_sweep
    for gen, ctl in ((loop.generate, FixedK(3)), (loop.generate_tree, FixedBudget(6))):
        outs = []
        for n in (1, 2):
            eng.draft.reset()
            draft = _Counting(eng.draft)
            got, _, _ = gen(LocalTarget(eng.executor), draft, [5, 9, 13], 16, SamplingParams(), ctl,
                            overlap=False, draft_threads=n)
            outs.append(got)
            assert set(draft.seen) == {n}
        assert outs[0] == outs[1]
    assert set(sweeps) == {1} and torch.get_num_threads() == 1


def test_batch_rounds_draft_with_drafting_threads(tiny, monkeypatch):
    """generate_batch's drafting (one batched draft step for all sequences) takes the engine's drafting count
    too, and the outputs are the sequences' own."""
    from streamspec_ray.speculative.batch import BatchDraft

    eng = Engine(target=tiny["store"], draft="skip:1", threads=1)
    want = [eng.generate(prompt_ids=p, max_new_tokens=10, mode="chain", k=3).token_ids for p in ([5, 9], [7, 7, 3])]
    seen = []
    inner = BatchDraft._propose_model

    def counting(self, todo):
        seen.append(torch.get_num_threads())
        return inner(self, todo)

    monkeypatch.setattr(BatchDraft, "_propose_model", counting)
    eng.draft_threads = 2
    got = eng.generate_batch([[5, 9], [7, 7, 3]], max_new_tokens=10, mode="chain", k=3)
    assert [r.token_ids for r in got] == want
    assert seen and set(seen) == {2} and torch.get_num_threads() == 1


def _counting_threads(eng):
    """eng's executor with wide_threads 2, recording torch's thread count as each sweep starts -> (executor, the
    counts seen)."""
    ex = eng.executor
    ex.wide_threads = 2
    seen = []
    units = ex._units

    def counting(stream):
        seen.append(torch.get_num_threads())
        return units(stream)

    ex._units = counting
    return ex, seen


def test_long_chunks_compute_on_the_wide_count(tiny):
    """A sweep of at least ALL_CORES_ROWS rows (for the store's format) computes with executor.wide_threads, a shorter
    one with the engine's count, and the count is put back after."""
    from streamspec_ray.runtime.executor import ALL_CORES_ROWS

    eng = Engine(target=tiny["store"], draft=None, threads=1, prefetch_depth=2)  # (not a whole pass read ahead)
    ex, seen = _counting_threads(eng)
    long = ALL_CORES_ROWS[ex.store.manifest.dtype]
    ex.sweep(list(range(3, 10)), ex.new_cache())
    ex.sweep([(i % 200) + 3 for i in range(long)], ex.new_cache(), logits_from=long - 1)
    assert seen == [1, 2] and torch.get_num_threads() == 1
    ex.close()


@pytest.mark.parametrize("direct,cold,depth,wide", [(True, False, 64, True), (False, False, 64, True),
                                                    (False, True, 64, False), (True, False, 2, False),
                                                    (None, True, None, True), (None, False, None, True)])
def test_sweeps_read_ahead_whole_with_o_direct_compute_wide(tiny, direct, cold, depth, wide):
    """Reads of a pass read ahead whole that leave the reader little to do during the sweep (O_DIRECT: no kernel
    copies; warm reads: mapped, see shard.map_file) let every sweep compute with wide_threads. Cold reads through
    the page cache (copies), or a read-ahead shorter than the pass, keep the engine's count for short sweeps. By
    default (None) a store that fits in memory is read a whole pass ahead, cold with O_DIRECT, warm mapped."""
    eng = Engine(target=tiny["store"], draft=None, threads=1, direct=direct, cold=cold, prefetch_depth=depth)
    ex, seen = _counting_threads(eng)
    want = Engine(target=tiny["store"], draft=None, threads=1).generate(prompt_ids=[5, 9, 13], max_new_tokens=6,
                                                                        mode="naive").token_ids
    assert eng.generate(prompt_ids=[5, 9, 13], max_new_tokens=6, mode="naive").token_ids == want
    assert ex._stream.mapped == (not direct and not cold)
    assert ex.direct == (direct if direct is not None else cold)
    assert set(seen) == ({2} if wide else {1}) and torch.get_num_threads() == 1
    ex.close()
