"""Turning logits into the probability distributions that speculative decoding compares.

Speculative decoding is only exact if the draft probabilities ``q`` and the target
probabilities ``p`` handed to the rejection sampler are the *same* distributions the
tokens are actually sampled from. So both models go through this one function,
:func:`logits_to_probs`, with the same :class:`SamplingParams`: temperature first,
then top-k, then top-p, in the order (and with the tie rules) of Hugging Face's
``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from streamspec_ray.errors import ConfigError, SamplingError

# Temperatures below this are greedy, as vLLM's _SAMPLING_EPS: logits / 1e-45 overflow to inf and softmax gives
# NaN, and any temperature this small puts all the mass on the argmax anyway (short of an exact tie).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. The defaults are greedy decoding."""

    temperature: float = 0.0  # below MIN_TEMPERATURE (0 included) greedy (argmax); else logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with probability mass >= top_p; 1.0 = off

    def __post_init__(self) -> None:
        # `not (x >= 0)` rather than `x < 0` so that NaN is rejected too.
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0) or not math.isfinite(t):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 turns it off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1] (1.0 turns it off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def logits_to_probs(
    logits: Tensor,  # [N, V] raw logits of any float dtype
    params: SamplingParams,
) -> Tensor:  # [N, V] float32, each row sums to 1
    """Apply temperature, top-k and top-p (HF semantics) and return probabilities.

    Greedy params give the one-hot of the argmax: the greedy "distribution". The argmax
    survives any top-k / top-p filter, so those are irrelevant there.

    Tie rules, as in Hugging Face:
      * top-k removes tokens whose logit is strictly below the k-th largest, so every
        token tied with the k-th value is kept (a row can keep more than k tokens).
      * top-p sorts ascending, removes tokens while the cumulative mass of the removed
        ones is <= 1 - top_p, and always keeps the single most likely token. Among
        exactly tied logits, which one falls on the boundary depends on the sort order.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)

    scores = logits / params.temperature  # [N, V]

    if params.top_k > 0:
        k = min(params.top_k, scores.size(-1))
        kth_value = torch.topk(scores, k, dim=-1).values[..., -1:]  # [N, 1]
        scores = scores.masked_fill(scores < kth_value, float("-inf"))

    if params.top_p < 1.0:
        # Sort ascending; the tokens we drop are a prefix of this order (the tail of the
        # distribution) whose total mass is at most 1 - top_p. What remains has mass
        # >= top_p. Tokens already removed by top-k have probability 0 here.
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)  # [N, V]
        cum_probs = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
        sorted_remove = cum_probs <= (1.0 - params.top_p)  # [N, V] bool
        sorted_remove[..., -1:] = False  # always keep the most likely token
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)  # back to vocab order
        scores = scores.masked_fill(remove, float("-inf"))

    probs = scores.softmax(dim=-1)
    if not bool(torch.isfinite(probs).all()):  # (NaN logits: multinomial would raise, or draw from garbage)
        raise SamplingError("the sampling distribution is not finite: the model's logits hold NaN or inf")
    return probs


def sample(
    probs: Tensor,  # [N, V] non-negative, rows need not be normalized
    generator: torch.Generator | None,
) -> Tensor:  # [N] int64
    """Draw one token per row. Pass an explicit generator to make runs reproducible."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def draw(
    logits: Tensor,  # [V] a draft's logits for the next token
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, Tensor | None]:  # (the token, its processed distribution q [V], None when greedy)
    """A draft's next token: the argmax when greedy, else a draw from q (which verification then needs)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = logits_to_probs(logits[None], params)
    return int(sample(q, generator)[0]), q[0]
