"""DeepSeek V3's multi-token-prediction (MTP) layer as the draft (`--draft mtp`).

V3 checkpoints carry, after the decoder, one more layer trained to predict the token after next (the store keeps
it as the `mtp.000` unit and its routed experts). At position p it takes the target's final hidden state h_p
(normed, as the target's head sees it) and the embedding of token t_{p+1}:

    x = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])       (the embedding is zeroed at position 0)
    y = decoder block (MLA over this layer's own latent cache, MoE)     -> logits = shared_head(norm(y))

and its logits at p are a guess at t_{p+2}. A round's first draft token comes from the target's h at the last
committed position; each further one feeds the layer its own output y as the hidden state, with the token just
drafted (one layer reused for every depth, as vLLM and SGLang run it).

The draft needs the target's hidden states: Engine.generate points the executor's `on_hidden` at `observe`,
which keeps, by position, the rows of the sweeps since the last round; it proposes chains (a tree's rows share positions), and it runs with
the in-process Engine. Verification is the usual one, so output stays exactly the target's: greedy token for
token, sampled by rejection sampling against the draft probabilities of the tokens it proposed.
"""
from __future__ import annotations

import time

import torch

from ..errors import ConfigError
from ..models import deepseek, family_of
from ..models.layers import Chunk, _apply, prepare_batch, rms_norm
from ..runtime.kvcache import LatentCache
from ..runtime.weights import materialize
from ..store.convert import expert_name, mtp_name
from .drafts import Draft, Proposal
from .sampling import logits_to_probs, sample


class MTPDraft(Draft):
    name = "mtp"

    def __init__(self, store, executor, dtype=torch.float32, device="cpu"):
        args = self.args = store.args
        if not (family_of(args) is deepseek.FAMILY and args.num_nextn_predict_layers > 0):
            raise ConfigError("--draft mtp needs a DeepSeek V3 store with its multi-token-prediction layer "
                              "(num_nextn_predict_layers > 0; convert a checkpoint that keeps it)")
        self.layer = args.num_hidden_layers  # the checkpoint's number of the MTP layer (its experts' units)
        group = store.manifest.group_size or 64
        self.w = materialize(store.read(mtp_name(0)).tensors, dtype, device, group)
        experts = {}
        if args.is_moe_layer(self.layer):
            for e in range(args.n_routed_experts):
                experts[(self.layer, e)] = materialize(store.read(expert_name(self.layer, e)).tensors, dtype, device,
                                                       group)
        self.experts = deepseek.ResidentExperts(experts)
        self.embed = executor.embed  # the target's table (resident, or read by rows)
        self.rope = deepseek.RopeState(args, device)
        self.cache = LatentCache(1, args.kv_lora_rank, args.qk_rope_head_dim, dtype, torch.device(device))
        self.resident_bytes = sum(t.numel() * t.element_size() for w in [self.w, *experts.values()]
                                  for t in w.values() if isinstance(t, torch.Tensor))
        self.hidden: dict[int, torch.Tensor] = {}  # position -> the target's hidden row there, not yet fed
        self.done = 0  # positions [0, done) are in the cache, each fed the target's own hidden state

    def reset(self) -> None:
        self.cache.length = 0
        self.done = 0
        self.hidden = {}

    def observe(self, positions: torch.Tensor, h: torch.Tensor) -> None:
        """A target sweep's final hidden states h [T, hidden] (normed, as its head sees them) at `positions` [T]:
        they replace what earlier sweeps left from the first of them on (rows the target rejected)."""
        first = int(positions.min())
        self.hidden = {p: row for p, row in self.hidden.items() if p < first}
        for p, row in zip(positions.tolist(), h):
            if p >= self.done:
                self.hidden[p] = row

    def _step(self, tokens: list[int], prev: torch.Tensor, start: int) -> torch.Tensor:
        """Feed (token t_{p+1}, hidden h_p) for positions p = start .. start + T - 1 -> the layer's outputs y
        [T, hidden] (the cache then holds them)."""
        a, T = self.args, len(tokens)
        self.cache.truncate(start)
        pos = torch.arange(start, start + T)
        e = self.embed[torch.tensor(tokens)].to(prev.dtype)
        e = e.masked_fill((pos == 0)[:, None].to(e.device), 0.0)
        x = _apply(self.w["eh_proj.weight"], torch.cat([rms_norm(e, self.w["enorm.weight"], a.rms_norm_eps),
                                                        rms_norm(prev, self.w["hnorm.weight"], a.rms_norm_eps)], -1))
        spans, positions, _ = prepare_batch([Chunk(torch.tensor(tokens), self.cache)], x.device)
        cos, sin = self.rope.tables(positions[0].to(x.device), x.dtype)
        y = deepseek.batch_layer(a, self.w, self.layer, x, 0, spans, cos, sin, self.rope.scale, self.experts)
        self.cache.length = start + T
        return y

    def _logits(self, y: torch.Tensor) -> torch.Tensor:
        x = rms_norm(y, self.w["shared_head.norm.weight"], self.args.rms_norm_eps)
        return _apply(self.w["shared_head.head.weight"], x).float()

    @torch.inference_mode()
    def propose(self, context, k, params, generator):
        t0 = time.perf_counter()
        n, start = len(context), self.done
        if start > n - 1:  # a context that is not this generation's continuation
            self.reset()
            start = 0
        need = range(start, n - 1)  # committed positions whose pair (h_p, t_{p+1}) the cache lacks
        if k <= 0 or not need or any(p not in self.hidden for p in need):
            return Proposal([], None, time.perf_counter() - t0)  # (no hidden state to start from: a naive round)
        y = self._step([context[p + 1] for p in need], torch.stack([self.hidden[p] for p in need]), start)[-1:]
        self.done = n - 1
        self.hidden = {p: h for p, h in self.hidden.items() if p >= self.done}
        tokens, probs = [], []
        for i in range(k):
            logits = self._logits(y)
            if params.greedy:
                tok = int(logits[0].argmax())
            else:
                p = logits_to_probs(logits, params)
                tok = int(sample(p, generator)[0])
                probs.append(p[0])
            tokens.append(tok)
            if i + 1 < k:  # the next depth: the layer's own output stands for the hidden state at n - 1 + i
                y = self._step([tok], y, n - 1 + i)
        return Proposal(tokens, torch.stack(probs) if probs else None, time.perf_counter() - t0)

