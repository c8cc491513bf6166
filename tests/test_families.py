"""One runner for every model family (mlx-lm's test_models): each family's store through every path, token for
token against the in-process reference.

    paths     naive, chain (K=3), tree (budget 8), generate_batch in each mode, and RayEngine's generate and
              generate_batch, all with the self-int4 draft
    families  tiny random Llama, Gemma 3 (sliding window, soft-capping) and DeepSeek V3 (MLA + routed experts)

What the engine guarantees, and so what is asserted:
  greedy    every path gives naive's tokens.
  sampled   a seed fixes the draws, but chain speculation draws differently from naive: per round K uniforms
            for the accept tests, then one token from the residual or bonus distribution (rejection.verify_chain),
            where naive draws one token per step. The same seed thus gives a different sample from the same
            distribution, and chain's draws also depend on K and the draft. A tree round draws exactly as naive
            does, one token per step from the target's distribution (tree.verify_tree), whatever the tree holds.
            So with the same seed: tree, naive and their batches and Ray runs give naive's tokens; chain, its
            batch and Ray's give in-process chain's at the same K (a fixed K: an adaptive one learns across
            generations). Chain against naive in distribution: test_rejection, test_spec.
  Ray       RayEngine.generate also runs in-process generate's sweeps and reads its bytes (DeepSeek: the same
            routed experts).
A sampled token equals only up to float rounding of logits computed in other chunks (speculative/batch.py): a
uniform draw within rounding of a boundary could tell them apart. Both engines compute on one thread, so the
in-process and the actors' sweeps give the same bits (test_ray's tiny_pair).

A new family is one entry in FAMILIES: a function of pytest's getfixturevalue that returns its store."""
from __future__ import annotations

import pytest
import torch

from test_ray import local_ray, ray_tmp  # noqa: F401  (the module's one Ray session)

from streamspec_ray import Engine

N = 10  # new tokens per prompt
K, BUDGET = 3, 8
SAMPLING = dict(temperature=0.9, top_p=0.95)
SEED = 7  # prompt i samples with SEED + i
IDS = [[5, 9, 13, 5, 9, 13, 5, 9], list(range(40, 61))]  # (ids < 128: every tiny vocabulary)
TEXTS = ["def fibonacci(n):"]  # (a family with a tokenizer: a real model, one prompt keeps it short)


@pytest.fixture(scope="module")
def deepseek_store(tmp_path_factory):
    """A tiny random DeepSeek V3 (test_deepseek's richest config: q LoRA, YaRN, a dense first layer, group-limited
    sigmoid routing) as an fp32 store."""
    from test_deepseek import CONFIGS, save_tiny_deepseek

    from streamspec_ray.store.convert import convert

    root = tmp_path_factory.mktemp("deepseek")
    model_type, kw = CONFIGS["v3-lora-yarn"]
    save_tiny_deepseek(root / "hf", model_type, **kw)
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return str(root / "store")


FAMILIES = {
    "llama": lambda get: get("tiny")["store"],
    "gemma3": lambda get: get("tiny_gemma")[1],
    "deepseek": lambda get: get("deepseek_store"),
}
# (the embedded SmolLM2-135M, a Llama-family model, runs these paths in test_spec, test_tree, test_batch and
# test_ray: not again here, where a real model's RayEngine and drafts cost a minute of the suite)

# path -> (engine, mode, through generate_batch)
PATHS = {
    "chain": ("local", "chain", False),
    "tree": ("local", "tree", False),
    "batch-naive": ("local", "naive", True),
    "batch-chain": ("local", "chain", True),
    "batch-tree": ("local", "tree", True),
    "ray-naive": ("ray", "naive", False),
    "ray-chain": ("ray", "chain", False),
    "ray-tree": ("ray", "tree", False),
    "ray-batch-chain": ("ray", "chain", True),
    "ray-batch-tree": ("ray", "tree", True),
}
POLICY = {"naive": {}, "chain": {"k": K}, "tree": {"budget": BUDGET}}


class Family:
    """One family's two engines (in process and on Ray, self-int4 draft, one thread) and its prompts; each
    path's outputs computed once."""

    def __init__(self, name: str, store: str):
        from streamspec_ray import RayEngine

        self.name = name
        self.engines = {"local": Engine(target=store, draft="self-int4", threads=1)}
        self.engines["ray"] = RayEngine(target=store, draft="self-int4", threads=1)
        local = self.engines["local"]
        self.prompts = [local.encode(t, None, False) for t in TEXTS] if local.tokenizer else IDS
        self._out = {}

    def results(self, engine: str, mode: str, batch: bool, sampled: bool) -> list:
        """Every prompt's GenerationResult on that path (sampled: prompt i with seed SEED + i)."""
        key = (engine, mode, batch, sampled)
        if key not in self._out:
            eng = self.engines[engine]
            reqs = [dict(prompt_ids=p, max_new_tokens=N, **(dict(SAMPLING, seed=SEED + i) if sampled else {}))
                    for i, p in enumerate(self.prompts)]
            if batch:
                self._out[key] = eng.generate_batch(reqs, batch_size=len(reqs), mode=mode, **POLICY[mode])
            else:
                self._out[key] = [eng.generate(mode=mode, **POLICY[mode], **r) for r in reqs]
        return self._out[key]

    def run(self, engine: str, mode: str, batch: bool, sampled: bool) -> list[list[int]]:
        return [r.token_ids for r in self.results(engine, mode, batch, sampled)]

    def reference(self, mode: str, sampled: bool) -> list[list[int]]:
        """What a path in `mode` must give: naive's tokens, except sampled chain's (in-process chain's)."""
        return self.run("local", "chain" if sampled and mode == "chain" else "naive", False, sampled)

    def close(self) -> None:
        self.engines["ray"].close()
        self.engines["local"].executor.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, local_ray):  # noqa: F811
    threads = torch.get_num_threads()  # (Engine(threads=1) sets torch's count for this process)
    fam = Family(request.param, FAMILIES[request.param](request.getfixturevalue))
    yield fam
    fam.close()
    torch.set_num_threads(threads)


def test_sampling_samples(family):
    """The sampled references are not the greedy ones (else the sampled cases below would prove nothing)."""
    for mode in ("naive", "chain"):
        assert family.reference(mode, True) != family.reference(mode, False), mode


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("path", PATHS)
def test_path_equals_reference(family, path, sampled):
    engine, mode, batch = PATHS[path]
    want = family.reference(mode, sampled)
    got = family.run(engine, mode, batch, sampled)
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, (f"{family.name} {path} {'seed %d' % (SEED + i) if sampled else 'greedy'} prompt {i}: "
                        f"first difference at new token {first} ({g[first] if first is not None else g} against "
                        f"{w[first] if first is not None else w})")
    if engine == "ray" and not batch:  # the same rounds as in process: the same sweeps, bytes (so experts) read
        here = family.results("local", mode, False, sampled)
        for a, b in zip(family.results(engine, mode, batch, sampled), here):
            assert (a.stats["sweeps"], a.stats["bytes_read"]) == (b.stats["sweeps"], b.stats["bytes_read"]), path
