"""The CUDA path: pinned host buffers, host-to-device copies, the KV cache and drafts on the GPU.
Skipped cleanly without a CUDA device (CI has none; run on a GPU machine when one is lent)."""
import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", autouse=True)
def exact_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 against fp32, not TF32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def test_cuda_logits_and_greedy_match_cpu(tiny):
    from streamspec_ray import Engine

    cpu = Engine(target=tiny["store"], draft=None)
    gpu = Engine(target=tiny["store"], draft="self-int4", device="cuda")
    assert gpu.executor.pin
    ids = list(range(3, 40))
    assert (gpu.logits(ids) - cpu.logits(ids)).abs().max().item() < 1e-3
    want = cpu.generate(prompt_ids=[5, 6, 7], max_new_tokens=48, mode="naive").token_ids
    assert gpu.generate(prompt_ids=[5, 6, 7], max_new_tokens=48, mode="naive").token_ids == want
    for k in (4, "adaptive"):
        assert gpu.generate(prompt_ids=[5, 6, 7], max_new_tokens=48, mode="chain", k=k).token_ids == want


def test_cuda_budget_measured_with_pinned_buffers(tiny):
    from streamspec_ray import Engine
    from streamspec_ray.store.store import LayerStore

    store = LayerStore(tiny["store"])
    eng = Engine(target=tiny["store"], draft=None, device="cuda")
    one = max(eng.executor.stream([]).need(u.name) for u in store.stream_units)
    budget = 2 * one
    eng = Engine(target=tiny["store"], draft=None, device="cuda", memory_budget=budget)
    eng.generate(prompt_ids=[5, 6, 7], max_new_tokens=8, mode="naive")
    assert 0 < eng.executor.residency.peak <= budget
