"""Shared fixtures: tiny random Llama-family models saved by transformers, their stores, and the real
SmolLM2-135M store (converted once per test session into a temporary STREAMSPEC_HOME)."""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Stream every unit, as a store bigger than memory does: the suite's byte counts (bytes read = sweeps x a sweep's
# bytes) are about streaming, and with no limit a tiny store would be held after its first sweep. test_hold.py
# turns holding what fits (the engine's default) back on and checks it (and subprocesses inherit this).
os.environ.setdefault("STREAMSPEC_HOLD", "0")


def tiny_config(model_type: str = "llama", **kw):
    from transformers import AutoConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return AutoConfig.for_model(model_type, **base)


def save_tiny(path, model_type="llama", seed=0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **kw), dtype=torch.float32).eval()
    # random init is tiny (std 0.02): scale weights up so logits are peaked and argmax is stable
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Llama saved as a HF folder, its HF model, and an fp32 store of it."""
    from streamspec_ray.store.convert import convert

    root = tmp_path_factory.mktemp("tiny")
    model = save_tiny(root / "hf")
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return {"hf_dir": str(root / "hf"), "model": model, "store": str(root / "store")}


GEMMA = dict(head_dim=16, num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=24,
             final_logit_softcapping=30.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
             layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory):
    """A tiny random Gemma 3 (sliding window 4, both layer kinds, soft-capping): its HF model and fp32 store."""
    from streamspec_ray.store.convert import convert

    root = tmp_path_factory.mktemp("gemma")
    model = save_tiny(root / "hf0", "gemma3_text", seed=4, **GEMMA)
    with torch.no_grad():  # (norm weights start at zero, i.e. a scale of 1: make the (1 + w) matter)
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "hf")
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return model, str(root / "store")


TINY_PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [200, 3, 77], list(range(40, 71))]


@pytest.fixture(scope="module")
def tiny_engines(tiny):
    """The tiny store without a draft (the naive reference) and with every kind of draft."""
    from streamspec_ray import Engine

    ref = Engine(target=tiny["store"], draft=None)
    drafts = {d: Engine(target=tiny["store"], draft=d) for d in ["self-int4", "skip:1", "ngram", tiny["store"]]}
    return ref, drafts


def dropped_inside(lock, box: list) -> bool:
    """In a daemon thread, take `lock`, drop the objects in `box` and collect garbage: their finalizers then run
    inside that lock, as they may whenever the collector runs under it. -> whether the thread finished (within
    10 s: a finalizer that waits for the lock never does)."""
    def body():
        with lock:
            box.clear()
            gc.collect()

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(10)
    return not th.is_alive()


def second_token_tv(ref, eng, prompt: list[int], n: int, tries: int, max_new_tokens: int = 2, **kw):
    """Sampled generation's second token (the first a draft proposes) over seeds, among the runs whose first token
    is the target's greedy one, against the target's own distribution given that token (temperature 1, top-k 6)
    -> (runs that matched, total variation distance)."""
    from streamspec_ray.speculative.sampling import SamplingParams, logits_to_probs

    first = ref.generate(prompt_ids=prompt, max_new_tokens=1, mode="naive").token_ids[0]
    p = logits_to_probs(ref.logits(prompt + [first])[-1:], SamplingParams(temperature=1.0, top_k=6))[0]
    counts, hits = torch.zeros_like(p), 0
    for seed in range(tries):
        out = eng.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens, temperature=1.0, top_k=6, seed=seed,
                           **kw)
        if out.token_ids[0] == first:
            counts[out.token_ids[1]] += 1
            hits += 1
            if hits == n:
                break
    return hits, 0.5 * (counts / hits - p).abs().sum().item()


def every_draft_vs_naive(tiny_engines, max_new_tokens: int, **kw):
    """Generate every TINY_PROMPT with every draft (`kw`: mode and its settings) and assert the tokens equal
    naive greedy's; yields each result's stats for the caller's mode-specific checks."""
    ref, drafts = tiny_engines
    for prompt in TINY_PROMPTS:
        want = ref.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens, mode="naive").token_ids
        for name, eng in drafts.items():
            out = eng.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens, **kw)
            assert out.token_ids == want, (name, kw, prompt)
            yield out.stats


@pytest.fixture(scope="session", autouse=True)
def smol_home(tmp_path_factory):
    """The session's STREAMSPEC_HOME (every test's: stores and self-int4 drafts never land in the user's cache)."""
    home = tmp_path_factory.mktemp("streamspec_home")
    old = os.environ.get("STREAMSPEC_HOME")
    os.environ["STREAMSPEC_HOME"] = str(home)
    yield str(home)
    if old is None:
        os.environ.pop("STREAMSPEC_HOME", None)
    else:
        os.environ["STREAMSPEC_HOME"] = old


@pytest.fixture(scope="session")
def smol_store(smol_home):
    """The embedded SmolLM2-135M-Instruct as an fp32 store (converted on first use, as users get it)."""
    pytest.importorskip("gguf")
    from streamspec_ray.store.default import default_store

    return default_store("fp32")


@pytest.fixture(scope="session")
def smol_hf():
    """transformers' own model on the same GGUF weights (fp32): the reference."""
    from transformers import AutoModelForCausalLM

    from streamspec_ray.store.sources import default_gguf

    folder, name = os.path.split(default_gguf())
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_engine(smol_store):
    from streamspec_ray import Engine

    return Engine(target=smol_store, draft="self-int4")


@pytest.fixture(scope="session")
def smol_naive(smol_engine):
    """Greedy naive outputs on the real model, computed once: the reference every other mode must match."""
    cache = {}

    def get(prompt: str, n: int) -> list[int]:
        key = (prompt, n)
        if key not in cache:
            cache[key] = smol_engine.generate(prompt, max_new_tokens=n, mode="naive").token_ids
        return cache[key]

    return get
