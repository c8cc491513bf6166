"""Holding what fits (issue 49): the memory plan keeps target units of a sweep in memory, the largest first, while
they and a 4-unit read-ahead over the rest fit in the room it has, and streams only the others. Same logits bit for
bit as streaming every unit; the bytes a sweep reads fall a unit at a time as the room grows, to none after the
first sweep where the whole store fits. Under a memory limit a draft holds its weights in its store's mapped pages."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import TINY_PROMPTS, save_tiny
from streamspec_ray import Engine
from streamspec_ray.runtime import executor as executor_mod
from streamspec_ray.runtime import memplan
from streamspec_ray.runtime.embedding import EmbeddingRows, load_embedding
from streamspec_ray.runtime.executor import HOLD_ENV, StreamingExecutor
from streamspec_ray.runtime.weights import materialize
from streamspec_ray.store.convert import convert
from streamspec_ray.store.store import LayerStore

MiB = 1 << 20


@pytest.fixture(autouse=True)
def holding(monkeypatch):
    """The engine's default, which conftest turns off for the rest of the suite."""
    monkeypatch.setenv(HOLD_ENV, "1")
CHUNKS = ([5, 9, 13, 5, 9], [40], [41], [7, 8])  # a prompt, then the sweeps of a short generation


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny Llama of 8 layers (9 units a sweep): room for a part of it can hold a few layers."""
    root = tmp_path_factory.mktemp("deep")
    save_tiny(root / "hf", num_hidden_layers=8, seed=3)
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return str(root / "store")


def room_for(monkeypatch, k: int, limit: int = 0) -> None:
    """memplan.plan given the room to hold exactly the first k units beside a 4-unit read-ahead over the rest:
    as the machine's available memory (limit 0), or under a simulated limit, as what the process holds."""
    real = memplan.plan

    def plan(needs, reserve, **kw):
        room = sum(needs[:k]) + memplan.widest(needs[k:], memplan.HOLD_DEPTH)
        if limit:
            headroom = max(memplan.HEADROOM_MIN, int(memplan.HEADROOM_FRACTION * limit))
            return real(needs, reserve, limit=limit, held=limit - headroom - reserve - room, **kw)
        return real(needs, reserve, limit=0, available=room + reserve + memplan.HEADROOM_MIN, **kw)

    monkeypatch.setattr(memplan, "plan", plan)


def sweeps(ex: StreamingExecutor):
    """CHUNKS through one cache -> [(logits, SweepStats)]."""
    cache = ex.new_cache()
    out = [ex.sweep(c, cache) for c in CHUNKS]
    ex.close()
    return out


def unit_bytes(ex: StreamingExecutor, names) -> int:
    return sum(ex.store.manifest.unit(n).bytes for n in names)


# ---- the plan's arithmetic (memplan: pure) ------------------------------------------------------------------------

def test_nothing_held_where_the_room_fits_only_the_read_ahead_and_all_where_everything_fits():
    needs = [30 * MiB] * 28 + [120 * MiB]  # a pass: 28 layers, then the head
    window = memplan.widest(needs, memplan.HOLD_DEPTH)
    assert window == 240 * MiB  # (four layers and the head, the windows wrapping round)
    assert memplan.resident_count(needs, window) == 0
    assert memplan.resident_count(needs, window + 30 * MiB - 1) == 0
    assert memplan.resident_count(needs, window + 3 * 30 * MiB) == 3  # a layer at a time
    assert memplan.resident_count(needs, sum(needs)) == len(needs)
    assert memplan.resident_count(needs, sum(needs) - 1) < len(needs) - 2
    counts = [memplan.resident_count(needs, r * MiB) for r in range(0, 1100, 3)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == len(needs)  # never falls as room grows


def test_a_plan_holds_the_head_first_and_reads_ahead_with_the_rest():
    """The real pair's shape under 1.2 GB: the head held first (the largest unit: held, it no longer widens the
    read-ahead's windows), then a layer, a 4-unit read-ahead over the rest, within the room. The bytes a sweep
    reads fall by the head, then a layer at a time as the limit rises; the last units go all at once (6 streamed
    units need 5 of them alive to read 4 ahead, and holding all 6 takes 30 MiB more), then none is read."""
    needs = [30 * MiB] * 28 + [120 * MiB]
    assert memplan.hold_order(needs)[:3] == [28, 0, 1]
    p = memplan.plan(needs, reserve=150 * MiB, limit=1200 * MiB, held=630 * MiB, hold=True)
    room = 1200 * MiB - 630 * MiB - 150 * MiB - p.headroom
    assert (p.units, p.resident_units, p.resident_bytes, p.resident) == (29, 2, 150 * MiB, (0, 28))
    assert p.sweep_bytes == sum(needs[1:28]) and p.depth == 4 and p.fits
    assert p.resident_bytes + p.read_ahead <= room < p.resident_bytes + p.read_ahead + 30 * MiB
    assert "2 of 29 target units resident (157 MB)" in p.describe() and "a sweep after the first reads" in p.describe()
    d = p.as_dict()
    assert (d["resident_units"], d["resident_bytes"], d["sweep_read_bytes"]) == (2, 150 * MiB, sum(needs[1:28]))
    # without holding: every unit streamed
    q = memplan.plan(needs, reserve=150 * MiB, limit=1200 * MiB, held=630 * MiB)
    assert (q.resident_units, q.sweep_bytes, q.depth) == (0, sum(needs), 6)
    read = [memplan.plan(needs, reserve=150 * MiB, limit=mb * MiB, held=630 * MiB, hold=True).sweep_bytes
            for mb in range(1000, 2400, 10)]
    assert read[0] == sum(needs) and read[-1] == 0
    assert {a - b for a, b in zip(read, read[1:]) if b} == {0, 30 * MiB, 120 * MiB}
    assert [a - b for a, b in zip(read, read[1:]) if a != b][0] == 120 * MiB  # (the head first)
    assert min(r for r in read if r) == 6 * 30 * MiB
    every = memplan.plan(needs, reserve=0, limit=0, available=64 << 30, hold=True)
    assert (every.resident_units, every.sweep_bytes, every.depth, every.read_ahead) == (29, 0, 0, 0)


# ---- the executor --------------------------------------------------------------------------------------------------

def test_a_store_that_fits_is_held_after_the_first_sweep(tiny):
    """No limit, a store that fits in the memory available: the first sweep reads every unit once, later sweeps
    read nothing and start no reader; the logits are those of streaming every unit, bit for bit."""
    held, streamed = StreamingExecutor(tiny["store"]), StreamingExecutor(tiny["store"], hold_what_fits=False)
    total = unit_bytes(held, held.sweep_names)
    got, want = sweeps(held), sweeps(streamed)
    for i, ((a, sa), (b, sb)) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
        assert (sa.bytes_read, sb.bytes_read) == (total if i == 0 else 0, total), i
    assert set(held.held) == set(held.sweep_names) and held.stream_names == [] and held.depth == 0
    assert held.memory_plan.sweep_bytes == 0 and held.memory_plan.resident_units == len(held.sweep_names)
    assert held.bytes_read == total and streamed.bytes_read == len(CHUNKS) * total
    assert not streamed.held and streamed.memory_plan.resident_units == 0


def test_a_depth_or_budget_given_holds_nothing(tiny):
    for kw in (dict(prefetch_depth=2), dict(memory_budget=1 << 30)):
        ex = StreamingExecutor(tiny["store"], **kw)
        total = unit_bytes(ex, ex.sweep_names)
        assert [s.bytes_read for _, s in sweeps(ex)] == [total] * len(CHUNKS) and not ex.held, kw


@pytest.mark.parametrize("k,direct", [(0, False), (2, False), (3, True)])
def test_room_for_some_units_holds_that_many(deep, monkeypatch, k, direct):
    """Room for the first k units beside the read-ahead: k held, the others streamed; a later sweep reads the
    streamed units' bytes exactly, the first one every unit's (the held ones read once, checksummed, into
    buffers of their own: still the store's bytes after sweeps that reused the stream's buffers)."""
    want = sweeps(StreamingExecutor(deep, hold_what_fits=False, direct=direct))
    room_for(monkeypatch, k)
    ex = StreamingExecutor(deep, direct=direct)
    got = sweeps(ex)
    names = ex.sweep_names
    assert len(names) == 9 and ex.memory_plan.resident_units == k and list(ex.held) == names[:k]
    assert ex.stream_names == names[k:] and ex.memory_plan.sweep_bytes == unit_bytes(ex, names[k:])
    for i, ((a, sa), (b, _)) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
        assert sa.bytes_read == unit_bytes(ex, names if i == 0 else names[k:]), i
    store = LayerStore(deep)
    for name, w in ex.held.items():
        fresh = materialize(store.read(name).tensors, torch.float32)
        assert w.keys() == fresh.keys() and all(torch.equal(w[t], fresh[t]) for t in w), name


def test_under_a_limit_the_start_up_line_says_what_is_held(deep, monkeypatch, caplog):
    """Under a limit: the plan at info; the held units read through the page cache are mappings of its pages
    (no second copy for the limit to charge, nothing evicted)."""
    from streamspec_ray.store import shard

    room_for(monkeypatch, 3, limit=1 << 30)
    evicted = []
    monkeypatch.setattr(shard, "evict", evicted.append)
    eng = Engine(target=deep, draft=None, direct=False)
    with caplog.at_level(logging.INFO, logger="streamspec"):
        out = eng.generate(prompt_ids=[5, 9, 13], max_new_tokens=4, mode="naive")
    plan = out.stats["memory_plan"]
    assert plan["limit_bytes"] == 1 << 30 and plan["resident_units"] == 3 and plan["units"] == 9
    assert plan["sweep_read_bytes"] == unit_bytes(eng.executor, eng.executor.sweep_names[3:])
    assert "3 of 9 target units resident" in caplog.text
    assert evicted == []
    eng.executor.close()


def test_the_switch_turns_holding_off_with_the_same_tokens(tiny, monkeypatch):
    """HOLD_ENV=0 (what benchmarks compare with): every sweep streams every unit, as before holding; the same
    tokens; `generate`'s stats say what the plan held and what a sweep reads."""
    on = Engine(target=tiny["store"], draft=None)
    monkeypatch.setenv(HOLD_ENV, "0")
    off = Engine(target=tiny["store"], draft=None)
    total = unit_bytes(on.executor, on.executor.sweep_names)
    for i, prompt in enumerate(TINY_PROMPTS):
        a = on.generate(prompt_ids=prompt, max_new_tokens=6, mode="naive")
        b = off.generate(prompt_ids=prompt, max_new_tokens=6, mode="naive")
        assert a.token_ids == b.token_ids, prompt
        assert a.stats["bytes_read"] == (total if i == 0 else 0)
        assert b.stats["bytes_read"] == b.stats["sweeps"] * total > 0
    assert a.stats["memory_plan"]["resident_units"] == len(on.executor.sweep_names)
    assert a.stats["memory_plan"]["sweep_read_bytes"] == 0
    assert b.stats["memory_plan"]["resident_units"] == 0 and b.stats["memory_plan"]["sweep_read_bytes"] == total
    for eng in (on, off):
        eng.executor.close()


@pytest.mark.parametrize("held", ["all", "some"])
def test_greedy_chain_and_tree_equal_naive_with_holding(deep, monkeypatch, held):
    """Greedy chain and tree rounds (their sweeps verify several tokens, a tree's with a mask) over held units
    give naive's tokens, naive streaming every unit."""
    monkeypatch.setenv(HOLD_ENV, "0")
    ref = Engine(target=deep, draft=None)
    monkeypatch.setenv(HOLD_ENV, "1")
    if held == "some":
        room_for(monkeypatch, 3)
    eng = Engine(target=deep, draft="self-int4")
    for prompt in TINY_PROMPTS[:2]:
        want = ref.generate(prompt_ids=prompt, max_new_tokens=12, mode="naive").token_ids
        for kw in (dict(mode="chain", k=4), dict(mode="tree", budget=8)):
            assert eng.generate(prompt_ids=prompt, max_new_tokens=12, **kw).token_ids == want, (prompt, kw)
    assert len(eng.executor.held) == (9 if held == "all" else 3)
    for e in (ref, eng):
        e.executor.close()


def test_int4pack_with_its_table_streamed_as_the_head_held(tmp_path, monkeypatch):
    """An int4pack store whose tied table is read by rows and streamed as the head ("embed" after "head"): held,
    the layers are the stream's PackedInt4 weights and the table joins the held head each sweep; the same
    logits as streaming, bit for bit (the int4 kernel's: int8 held units are tests/test_int8.py's)."""
    from streamspec_ray.quant.packed import PackedInt4

    monkeypatch.setenv(executor_mod.INT8_ENV, "0")
    save_tiny(tmp_path / "hf", tie_word_embeddings=True, seed=6)
    convert(str(tmp_path / "hf"), str(tmp_path / "pack"), dtype="int4pack")
    monkeypatch.setattr(executor_mod, "load_embedding", lambda store, dtype, device: load_embedding(
        store, dtype, device, resident_max=0))
    held = StreamingExecutor(str(tmp_path / "pack"))
    streamed = StreamingExecutor(str(tmp_path / "pack"), hold_what_fits=False)
    assert isinstance(held.embed, EmbeddingRows) and held.sweep_names[-2:] == ["head", "embed"]
    for (a, _), (b, _) in zip(sweeps(held), sweeps(streamed)):
        assert torch.equal(a, b)
    assert set(held.held) == set(held.sweep_names)
    assert any(isinstance(w, PackedInt4) for w in held.held["layer.000"].values())


def test_under_a_memory_limit_a_draft_holds_its_stores_mapped_pages(tiny, monkeypatch):
    """Under a limit the draft's weights are views of its shard files' mappings (pages the kernel may drop and
    read again under pressure), not copies in the process's own memory; it proposes what the copied draft does."""
    import os

    from streamspec_ray.runtime import memlimit
    from streamspec_ray.speculative import drafts
    from streamspec_ray.speculative.sampling import SamplingParams

    def file_of(t: torch.Tensor) -> str | None:
        """The file whose mapping holds t's data, if any."""
        at = t.data_ptr()
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= at < end and len(fields) > 5 and fields[5].startswith("/"):
                    return fields[5]
        return None

    monkeypatch.setattr(memlimit, "limit_bytes", lambda: None)
    assert not drafts.mapped_draft("cpu")
    copied = drafts.from_store(tiny["store"])
    monkeypatch.setattr(memlimit, "limit_bytes", lambda: 1 << 30)
    assert drafts.mapped_draft("cpu") and not drafts.mapped_draft("meta")
    mapped = drafts.from_store(tiny["store"])
    store = LayerStore(tiny["store"])
    for name, w in mapped.units:
        assert {file_of(t) for t in w.values()} == {os.path.realpath(store.path(name))}, name
    assert all(file_of(t) is None for _, w in copied.units for t in w.values())
    want = copied.propose(TINY_PROMPTS[0], 6, SamplingParams(), None).tokens
    assert mapped.propose(TINY_PROMPTS[0], 6, SamplingParams(), None).tokens == want


def test_under_a_limit_a_head_far_larger_than_a_layer_is_mapped_not_streamed(tmp_path, monkeypatch):
    """Reads with O_DIRECT under a memory limit: a head 3.5x a layer's size is held in its file's mapped pages
    (which the kernel may drop and read back, where a read buffer of its size could only be killed), the layers
    stream; the logits are those of streaming everything, bit for bit, and later sweeps read the layers only."""
    import os

    save_tiny(tmp_path / "hf", vocab_size=2048, seed=5)
    convert(str(tmp_path / "hf"), str(tmp_path / "store"), dtype="fp32")
    store = str(tmp_path / "store")
    want = sweeps(StreamingExecutor(store, hold_what_fits=False, direct=True))
    monkeypatch.setattr(memplan, "limit_bytes", lambda: 1 << 30)
    ex = StreamingExecutor(store, direct=True)
    layers = [n for n in ex.sweep_names if n != "head"]
    assert unit_bytes(ex, ["head"]) > 3 * unit_bytes(ex, layers[:1])
    got = sweeps(ex)
    for (a, sa), (b, _) in zip(got, want):
        assert torch.equal(a, b)
    assert "head" in ex.held and ex.stream_names == [n for n in ex.sweep_names if n not in ex.held]
    assert [s.bytes_read for _, s in got[1:]] == [unit_bytes(ex, ex.stream_names)] * (len(CHUNKS) - 1)
    path = os.path.realpath(LayerStore(store).path("head"))
    with open("/proc/self/maps") as f:
        assert any(line.rstrip().endswith(path) for line in f)
