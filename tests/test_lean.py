"""The lean draft forward (models/lean.py): llama.forward's logits and cache entries bit for bit, in fewer ops, for
every kind of chunk a draft feeds (a prompt, a chain step, tree levels under sibling-hiding masks); used by a
resident draft whose projections are all on the int4 kernel, for calls narrower than the dense threshold."""
from __future__ import annotations

import pytest
import torch

from conftest import save_tiny
from streamspec_ray.models import lean, llama
from streamspec_ray.quant.kernel import HAS_KERNEL
from streamspec_ray.runtime.kvcache import KVCache
from streamspec_ray.speculative import drafts
from streamspec_ray.speculative.sampling import SamplingParams
from streamspec_ray.store.convert import convert
from streamspec_ray.store.store import LayerStore

pytestmark = pytest.mark.skipif(not HAS_KERNEL, reason="the lean path calls torch's CPU int4 kernel")


@pytest.fixture(params=["llama", "qwen2"])
def draft(request, tiny, tmp_path):
    """self-int4 drafts of a tiny llama (k and v too small to fuse: q, k, v apart) and a tiny qwen2 (q/k/v fused,
    with biases)."""
    store = LayerStore(tiny["store"])
    if request.param == "qwen2":
        save_tiny(tmp_path / "hf", model_type="qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
        convert(str(tmp_path / "hf"), str(tmp_path / "store"), dtype="fp32")
        store = LayerStore(str(tmp_path / "store"))
    return drafts.self_int4(store)


def test_same_bits_as_llama_forward(draft):
    d, a = draft, draft.args
    ref, new = (KVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim) for _ in range(2))

    def both(ids, positions=None, mask=None):
        ids = torch.tensor(ids)
        want = llama.forward(a, d.embed, d.rope, d.units, ids, ref, positions, mask, 0)
        got = d.lean(d.embed, d.rope, ids, new, positions, mask, 0)
        assert torch.equal(got, want)
        assert ref.length == new.length
        for i in range(a.num_hidden_layers):
            assert torch.equal(ref.k[i][:, : ref.length], new.k[i][:, : new.length])
            assert torch.equal(ref.v[i][:, : ref.length], new.v[i][:, : new.length])

    with torch.inference_mode():
        both([5, 9, 13, 2, 7])  # a prompt: causal
        both([11])  # a chain step: one row that sees every slot (no mask at all)
        base = ref.length
        # a tree level of two siblings and a child of the first, as drafts.ModelDraft grows trees
        mask = torch.zeros(3, base + 3, dtype=torch.bool)
        mask[:, :base] = True
        mask[0, base], mask[1, base + 1], mask[2, [base, base + 2]] = True, True, True
        both([20, 21, 22], torch.tensor([base, base, base + 1]), mask)
        # the next level: one row under the second sibling, hiding the first and its child (an additive mask)
        mask = torch.zeros(1, base + 4, dtype=torch.bool)
        mask[0, :base] = True
        mask[0, [base + 1, base + 3]] = True
        both([23], torch.tensor([base + 1]), mask)


def test_the_draft_feeds_narrow_calls_through_it(draft, monkeypatch):
    """Narrow calls (chain steps, tree levels, a short prompt) take the lean path; calls of max_rows rows or more
    (long prompts, which the weights multiply densely) take llama.forward. The proposals are the same either way."""
    want = draft.twin()
    want.lean = None
    calls = []

    class Counting:
        max_rows = lean.LeanForward.max_rows

        def __init__(self, inner):
            self.inner = inner

        def __call__(self, embed, inv_freq, ids, *rest):
            calls.append(ids.numel())
            return self.inner(embed, inv_freq, ids, *rest)

    monkeypatch.setattr(draft, "lean", Counting(draft.lean))
    context = [3, 4, 5, 6]
    assert draft.propose(context, 4, SamplingParams(), None).tokens == want.propose(context, 4, SamplingParams(),
                                                                                    None).tokens
    assert calls == [4, 1, 1, 1]
    long = list(range(10, 10 + lean.LeanForward.max_rows))
    calls.clear()
    draft.reset()
    assert draft.propose(long, 2, SamplingParams(), None).tokens == want.propose(long, 2, SamplingParams(),
                                                                                 None).tokens
    assert calls == [1]


def test_not_built_where_a_projection_is_off_the_kernel(tiny, monkeypatch):
    dense = drafts.from_store(tiny["store"])  # fp32 weights: plain matmuls
    assert dense.lean is None
    d = drafts.self_int4(LayerStore(tiny["store"]))
    assert lean.LeanForward.build(d.args, d.units) is not None
    monkeypatch.setattr(lean, "_mm", None)  # a torch without the CPU int4 kernel
    assert lean.LeanForward.build(d.args, d.units) is None
