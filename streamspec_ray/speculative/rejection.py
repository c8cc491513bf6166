"""Verifying a chain of draft tokens against the target model (speculative sampling).

One speculative round: the small draft model proposes K tokens x_0..x_{K-1}, drawing x_i
from its distribution q_i; the target model scores the whole chain in one pass and gives
p_0..p_K (p_i is the target's distribution for position i given the prefix that ends
with x_{i-1}; p_K is the distribution after all K drafts). We then emit

    * accepted tokens: the longest prefix of the drafts that survives the test below,
    * then exactly one more token: a *recovered* token at the first rejected position,
      or a *bonus* token drawn from p_K when every draft was accepted.

So a round always emits between 1 and K+1 tokens and costs one target pass.

Why it is exact (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Appendix A; Chen et al. 2023 prove the same). Fix a position
with target p and draft q; the draft proposes x ~ q.

    accept x with probability  min(1, p(x) / q(x))
    on rejection, emit y ~ norm(max(0, p - q))

Then P(emit y) = P(propose y and accept) + P(reject) * residual(y)
             = q(y) * min(1, p(y)/q(y)) + P(reject) * max(0, p(y) - q(y)) / Z
             = min(q(y), p(y))          + P(reject) * max(0, p(y) - q(y)) / Z.
P(reject) = 1 - sum_x min(p(x), q(x)) and Z = sum_x max(0, p(x) - q(x)); both equal the
total variation distance between p and q (sum min(p,q) + sum max(0,p-q) = sum p = 1), so
P(reject) / Z = 1 and P(emit y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y).

Intuition: where the draft over-proposes a token (q > p) we thin it down to p by
rejecting a fraction 1 - p/q of the time; where it under-proposes (p > q) acceptance
is certain but short of p by p - q, and the residual distribution puts back exactly
that missing mass. Given the accepted prefix, the next position is the same situation
with the next (p_i, q_i), so by induction every emitted token follows the target. The
expected number of accepted drafts is sum_{i<K} prod_{j<=i} alpha_j with
alpha_j = sum_x min(p_j(x), q_j(x)), the acceptance rate at position j.

draft_probs=None selects the greedy path: temperature 0 makes both p and q one-hot, and
the rule above reduces to "accept while the draft equals the target's argmax".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def verify_chain(
    draft_tokens: Tensor | Sequence[int],  # [K] int64
    draft_probs: Tensor | None,  # [K, V] q_i, or None for greedy
    target_probs: Tensor,  # [K+1, V] p_i; row K gives the bonus token
    generator: torch.Generator | None = None,
) -> list[int]:
    """Return the tokens emitted this round: the accepted drafts, then one recovered or
    bonus token (so 1..K+1 tokens). K=0 is allowed and just samples from target_probs[0].

    The generator must live on target_probs' device. Per call it draws K uniforms, then
    one multinomial sample, so a seeded generator makes a run reproducible.
    """
    device = target_probs.device
    draft_tokens = torch.as_tensor(draft_tokens, dtype=torch.long, device=device).reshape(-1)
    k = draft_tokens.numel()
    if target_probs.dim() != 2 or target_probs.size(0) != k + 1:
        raise ValueError(f"target_probs must be [K+1, V] = [{k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is None:
        return _verify_greedy(draft_tokens, target_probs)
    if tuple(draft_probs.shape) != (k, target_probs.size(1)):
        raise ValueError(f"draft_probs must be [K, V] = [{k}, {target_probs.size(1)}], got {tuple(draft_probs.shape)}")

    num_accepted, next_token = _rejection_sample(
        draft_tokens.unsqueeze(0), draft_probs.unsqueeze(0), target_probs.unsqueeze(0), generator
    )
    n = int(num_accepted[0])
    return draft_tokens[:n].tolist() + [int(next_token[0])]


def _verify_greedy(
    draft_tokens: Tensor,  # [K] int64
    target_probs: Tensor,  # [K+1, V] (probs or logits: only the argmax is used)
) -> list[int]:
    k = draft_tokens.numel()
    target_argmax = target_probs.argmax(dim=-1)  # [K+1]
    matches = draft_tokens == target_argmax[:k]  # [K] bool
    # Leading run of True: cumprod turns everything after the first mismatch into 0.
    n = int(matches.long().cumprod(dim=0).sum())
    # n < K: the target's argmax at the mismatch is the recovered token.
    # n == K: target_argmax[K] is the bonus token.
    return draft_tokens[:n].tolist() + [int(target_argmax[n])]


def verify_chains(
    draft_tokens: list[list[int]],  # B chains of K_b tokens
    draft_probs: list[Tensor],  # B x [K_b, V] q
    target_probs: list[Tensor],  # B x [K_b+1, V] p
    generators: list[torch.Generator | None],  # one per chain
) -> list[list[int]]:
    """verify_chain for B sampled chains at once (a batch's sequences, whose K may differ): one accept/reject
    test and one residual over [B, K_max], each chain drawing from its own generator in verify_chain's order
    (its K_b uniforms, then its one multinomial), so each emits what verify_chain would have alone."""
    b = len(draft_tokens)
    if not b:
        return []
    k_max, v = max(len(d) for d in draft_tokens), target_probs[0].size(-1)
    device, dtype = target_probs[0].device, torch.promote_types(target_probs[0].dtype, torch.float32)
    lengths = torch.tensor([len(d) for d in draft_tokens], device=device)  # [B] K_b
    tokens = torch.zeros(b, k_max, dtype=torch.long, device=device)  # [B, K_max], padded with 0
    q = torch.zeros(b, k_max, v, dtype=dtype, device=device)  # [B, K_max, V], padded with 0
    p = torch.zeros(b, k_max + 1, v, dtype=dtype, device=device)  # [B, K_max+1, V], padded with 0
    for i, (d, qi, pi) in enumerate(zip(draft_tokens, draft_probs, target_probs)):
        k = len(d)
        if tuple(pi.shape) != (k + 1, v) or tuple(qi.shape) != (k, v):
            raise ValueError(f"chain {i}: target_probs must be [{k + 1}, {v}] and draft_probs [{k}, {v}], got "
                             f"{tuple(pi.shape)} and {tuple(qi.shape)}")
        tokens[i, :k] = torch.as_tensor(d, dtype=torch.long, device=device)
        q[i, :k], p[i, : k + 1] = qi, pi
    num_accepted, next_token = _rejection_sample(tokens, q, p, generators, lengths)
    return [list(d[:n]) + [t] for d, n, t in zip(draft_tokens, num_accepted.tolist(), next_token.tolist())]


def _rejection_sample(
    draft_tokens: Tensor,  # [B, K] int64
    draft_probs: Tensor,  # [B, K, V] q
    target_probs: Tensor,  # [B, K+1, V] p
    generator: torch.Generator | None | list,  # one for every row, or one per row (verify_chains)
    lengths: Tensor | None = None,  # [B] each row's own K (positions past it are padding); None: all K
) -> tuple[Tensor, Tensor]:  # ([B] num accepted in 0..K, [B] recovered/bonus token)
    """Batched speculative sampling over B independent chains (verify_chain uses B=1).

    Random draws: one [B, K] block of uniforms, then one multinomial over [B, V]; with a generator per row,
    each row's own K_b uniforms and then its own multinomial, from its generator.
    """
    b, k = draft_tokens.shape
    device = target_probs.device
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    p = target_probs.to(dtype)
    q = draft_probs.to(dtype)
    rows = torch.arange(b, device=device)  # [B]
    per_row = isinstance(generator, (list, tuple))

    # --- accept / reject all K positions at once --------------------------------------
    x = draft_tokens.unsqueeze(-1)  # [B, K, 1]
    p_x = p[:, :k].gather(-1, x).squeeze(-1)  # [B, K] p_i(x_i)
    q_x = q.gather(-1, x).squeeze(-1)  # [B, K] q_i(x_i)
    if per_row:  # (padding positions: u = 1, and `lengths` cuts them below anyway)
        u = torch.ones((b, k), device=device, dtype=dtype)
        for i, g in enumerate(generator):
            n = k if lengths is None else int(lengths[i])
            u[i, :n] = torch.rand(n, generator=g, device=device, dtype=dtype)
    else:
        u = torch.rand((b, k), generator=generator, device=device, dtype=dtype)  # [B, K] ~ U[0, 1)
    # Accept iff u < p/q, which happens with probability min(1, p/q). Written as
    # u * q < p so it never divides, and so the degenerate cases are well defined:
    #   q(x) = 0, p(x) > 0 -> 0 < p: accept (the limit min(1, p/0+) = 1). A sampled draft
    #     never has q(x) = 0; this only arises from a caller bug or underflow, and the
    #     token is plausible under the target, so keeping it is the least surprising.
    #   p(x) = 0           -> never accept (ratio 0, including 0/0): the target cannot
    #     emit a token it gives zero probability.
    # Tokens with q = 0 < p are still emitted with the right frequency: they are exactly
    # where max(0, p - q) = p, i.e. the residual hands them out on rejections.
    accepted = u * q_x < p_x  # [B, K] bool
    if lengths is not None:  # a row's padding positions are never drafts
        accepted &= torch.arange(k, device=device) < lengths.unsqueeze(-1)
    # Positions after the first rejection are irrelevant: the chain is cut there.
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]

    # --- one more token from position n = num_accepted -------------------------------
    p_n = p[rows, num_accepted]  # [B, V]
    if k > 0:
        # When n == K there is no draft at position K; treat its q as all zeros, so the
        # residual max(0, p_K - 0) is p_K itself: the bonus token is a target sample.
        has_draft = (num_accepted < (k if lengths is None else lengths)).unsqueeze(-1)  # [B, 1]
        q_n = q[rows, num_accepted.clamp(max=k - 1)] * has_draft  # [B, V]
    else:
        q_n = torch.zeros_like(p_n)
    residual = (p_n - q_n).clamp_min(0.0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # mass == 0 means p <= q everywhere, i.e. p == q (both sum to 1), where rejection has
    # probability 0; it can still happen through rounding, and then p is the right law.
    recovered_probs = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(dtype).tiny), p_n)
    if per_row:
        next_token = torch.cat([torch.multinomial(recovered_probs[i : i + 1], 1, generator=g).squeeze(-1)
                                for i, g in enumerate(generator)])  # [B]
    else:
        next_token = torch.multinomial(recovered_probs, 1, generator=generator).squeeze(-1)  # [B]
    return num_accepted, next_token
