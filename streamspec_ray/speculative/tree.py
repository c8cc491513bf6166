"""Token trees: many candidate continuations verified by one streamed sweep.

When the target streams from disk, a sweep over 64 candidate tokens reads the same bytes as a sweep over 8,
so instead of one chain of K drafts a round verifies a tree (SpecExec, Sequoia): the draft keeps the
`budget` most likely continuations by cumulative draft log-probability, and the target scores every node in
one pass with a tree attention mask (a node sees the prefix, its ancestors and itself; its position is the
prefix length plus its depth).

Verification follows SpecExec's rule: at the root, draw the target's token t (argmax when greedy, a sample
from the processed target distribution otherwise); if a child of the current node carries t, step into it and
repeat, else emit t and stop. Every emitted token is a draw from the target's distribution given everything
before it, so the output is distributed exactly as the target's (greedy: token-for-token the target's argmax
chain) whatever the tree holds; the tree only decides how many draws one sweep gets to keep. For a tree
fixed before the target's draws, the chance of stepping into a child, the target's mass on the children's
tokens, is the most any exact rule can accept with those children.

    sweep input   [pending..., n_0, ..., n_{N-1}]   nodes in depth order: a parent precedes its children
    logits rows   [root, n_0, ..., n_{N-1}]          row 1 + j: the target's distribution after node j
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, logits_to_probs


@dataclass
class TokenTree:
    tokens: list[int]        # [N] node tokens, parents before children (depth order)
    parents: list[int]       # [N] parent node index, -1 for a child of the root (the last context token)
    scores: list[float] = field(default_factory=list)  # draft log-probability of the path to each node
    draft_s: float = 0.0

    def __post_init__(self) -> None:
        self.depths: list[int] = []
        self.children: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]  # [node + 1]: token -> child
        for j, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= p < j:
                raise ValueError(f"tree node {j}: parent {p} must come before it")
            self.depths.append(1 if p < 0 else self.depths[p] + 1)
            self.children[p + 1].setdefault(t, j)  # (a duplicate sibling token can never be stepped into)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenTree(nodes={len(self)}, depth={self.depth}, draft_s={self.draft_s:.4f})"

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def spine(self) -> list[int]:
        """The tokens of the draft's likeliest root-to-leaf path: the best-scored child at every level (the
        first child where the tree has no scores)."""
        out, node = [], -1
        while self.children[node + 1]:
            kids = self.children[node + 1].values()
            node = max(kids, key=lambda j: self.scores[j]) if self.scores else min(kids)
            out.append(self.tokens[node])
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or one of its ancestors."""
        n = len(self)
        m = torch.eye(n, dtype=torch.bool)
        for j, p in enumerate(self.parents):
            if p >= 0:
                m[j] |= m[p]
        return m

    def chunk_mask(self, pending: int) -> torch.Tensor:
        """[P + N, P + N] mask over a sweep chunk of P pending tokens then the nodes: the pending tokens are
        causal, every node sees all of them, its ancestors and itself."""
        n, total = len(self), pending + len(self)
        mask = torch.zeros(total, total, dtype=torch.bool)
        mask[:pending, :pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
        mask[pending:, :pending] = True
        mask[pending:, pending:] = self.ancestor_mask() if n else mask[pending:, pending:]
        return mask

    def positions(self, start: int, pending: int) -> torch.Tensor:
        """Positions of [pending..., nodes...] when the cache holds `start` tokens: a node at depth d sits at
        d after the last pending token, as it would in the sequence that accepts it."""
        return torch.tensor(list(range(start, start + pending)) + [start + pending - 1 + d for d in self.depths])

    def expected_tokens(self) -> list[float]:
        """E[tokens emitted] when verifying the first n nodes by score (n = 0..N), if the target agreed with the
        draft's probabilities: 1 + the sum of the kept nodes' path probabilities. The score order keeps every
        prefix a tree (a child never outscores its parent)."""
        probs = sorted((math.exp(s) for s in self.scores), reverse=True)
        out = [1.0]
        for p in probs:
            out.append(out[-1] + p)
        return out


def chain_tree(tokens: list[int]) -> TokenTree:
    """A chain of drafts as a degenerate tree (for drafts that only propose chains)."""
    return TokenTree(list(tokens), list(range(-1, len(tokens) - 1)))


def cut_short(tree: TokenTree, depth: int, max_depth: int) -> bool:
    """Whether the tokens left (depth, under the policy's max_depth) cut this tree, not its own growth. Such a
    tree's small forecast says nothing of the budget and must not teach the budget controller: it would drag
    the budget down at a prompt's end, and the engine's next generation would resume from there (measured:
    budget 2 after a prompt's last round, then three rounds climbing back to 16). Both loops (speculative/loop.py and
    speculative/batch.py, which Ray's controller also runs) skip the controller's update for it."""
    return depth < max_depth and tree.depth >= depth


def verify_tree(tree: TokenTree, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """logits [N + 1, V] (row 0: after the root, row 1 + j: after node j) -> (accepted node indices along one
    root path, emitted tokens = their tokens then one more target token). Greedy: argmax at each step;
    sampled: one draw from the processed target distribution per step (so a seeded generator reproduces)."""
    if logits.dim() != 2 or logits.shape[0] != len(tree) + 1:
        raise ValueError(f"logits must be [N+1, V] = [{len(tree) + 1}, V], got {tuple(logits.shape)}")
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        if params.greedy:
            t = int(row.argmax())
        else:
            t = int(torch.multinomial(logits_to_probs(row[None], params)[0], 1, generator=generator))
        child = tree.children[node + 1].get(t)
        if child is None:
            return path, [tree.tokens[j] for j in path] + [t]
        path.append(child)
        node = child


@dataclass
class _Node:
    token: int
    parent: "_Node | None"
    depth: int
    score: float
    slot: int = -1  # its slot in the draft's cache once fed (expanded), else -1


# A depth's draft forward costs about as much for 1 node as for 4 (SmolLM2-135M self-int4, 2 threads: 1 row
# 12.5 ms, 4 rows 18.8, 16 rows 48), and its nodes' children can add at most the nodes' path probability to
# the tokens a round accepts. Deep levels of one or two unlikely nodes cost more than they return, so growth
# stops at a depth whose new nodes hold less than this much probability (sharpened scores for greedy targets,
# see GREEDY_SCORE_TEMPERATURE). Measured on the bench's 5 chat prompts x 128 tokens, warm, 0 and 0.3 taking turns
# 3 times (median ms/token, tokens/sweep, draft ms/round): tree 16 69.7, 7.47, 322 -> 64.4, 7.31, 262; tree 64
# 85.8, 10.64, 613 -> 71.7, 10.64, 463. Single runs of other values: tree 16, 0.4 and 0.6 about as fast as 0.3
# (0.6 at 6.50 tokens/sweep); tree 64, 0.5 slower than 0.3 (9.00 tokens/sweep).
MIN_LEVEL_MASS = 0.3


def grow_tree(root_logits: torch.Tensor, expand, budget: int, max_depth: int, params: SamplingParams,
              max_children: int = 16, min_expand_prob: float = 0.02,
              min_level_mass: float | None = None, row_block: int = 1) -> tuple[TokenTree, list[_Node]]:
    """Best-first under a node budget, one batched draft call per depth.

    Keeps the global top-`budget` nodes by cumulative draft log-probability. Each depth, the nodes that
    entered the kept set at the previous depth are expanded together: `expand(nodes)` feeds them to the draft
    (with a tree mask) and returns their next-token logits [n, V]; their top children become candidates, and
    the kept set is re-ranked over kept nodes plus candidates (a child never outscores its parent, so the kept
    set stays a tree). Stops at max_depth or when no candidate beats the worst kept node.
    A node is only expanded if its path probability is at least `min_expand_prob`: every expanded node costs
    the draft a row of compute, and its children can add at most that probability to the expected tokens.
    Growth also stops at a depth whose new nodes' path probabilities add up to less than `min_level_mass`
    (None: MIN_LEVEL_MASS): a depth costs a whole draft forward, whatever few rows it feeds.
    row_block: the draft's forward costs by blocks of that many rows (int4.KERNEL_ROW_BLOCK for the CPU int4
    kernel): a depth whose new nodes would spill one node into a block of its own feeds all but its least likely
    node, which stays in the tree as a leaf. Warm, SmolLM2 fp32 target with its self-int4 draft, 5 prompts x 128
    tokens, alternating, ms/token (tokens per sweep, drafting ms per round): budget 16 29.2 -> 28.7 (7.31 both;
    111 -> 108), 32 32.9 -> 32.1 (9.00 both; 170 -> 160), 64 37.2 -> 36.9 (10.64 -> 10.03; 220 -> 194).
    Returns the tree and its nodes (with the draft cache slots of those that were fed)."""
    kept: list[_Node] = []
    frontier_logits, frontier = root_logits[None], [None]
    min_log = math.log(min_expand_prob) if min_expand_prob > 0 else -math.inf
    min_mass = MIN_LEVEL_MASS if min_level_mass is None else min_level_mass
    for depth in range(1, max_depth + 1):
        logp = _log_probs(frontier_logits, params)  # [n, V]
        c = min(max_children, budget, logp.shape[-1])
        top, idx = logp.topk(c, dim=-1)
        base = torch.tensor([0.0 if n is None else n.score for n in frontier])
        scores = base[:, None] + top  # [n, c]
        floor = kept[budget - 1].score if len(kept) >= budget else -float("inf")
        hit = (scores > floor) & torch.isfinite(scores)
        rows, cols = hit.nonzero(as_tuple=True)
        if rows.numel() == 0:
            break
        cand = [_Node(int(idx[r, k]), frontier[r], depth, float(scores[r, k])) for r, k in zip(rows.tolist(), cols.tolist())]
        # rank: higher score first; on a tie the shallower (a parent before its child), then the older node
        pool = sorted(kept + cand, key=lambda n: (-n.score, n.depth))[:budget]
        alive = {id(n) for n in pool}
        kept = [n for n in pool if n.parent is None or id(n.parent) in alive]
        new = [n for n in cand if id(n) in alive and (n.parent is None or id(n.parent) in alive)
               and n.score >= min_log]
        if not new or depth == max_depth or sum(math.exp(n.score) for n in new) < min_mass:
            break
        if row_block > 1 and len(new) > 1 and len(new) % row_block == 1:
            drop = min(new, key=lambda n: n.score)
            new = [n for n in new if n is not drop]
        frontier, frontier_logits = new, expand(new)
    kept.sort(key=lambda n: (n.depth, -n.score))
    index = {id(n): j for j, n in enumerate(kept)}
    tree = TokenTree([n.token for n in kept], [-1 if n.parent is None else index[id(n.parent)] for n in kept],
                     [n.score for n in kept])
    return tree, kept


# Greedy targets: nodes are scored with the draft's softmax sharpened at this temperature. A greedy target
# accepts a child iff it is the target's argmax, which an INT4 copy's top token is far more often than its
# softmax says. Measured on SmolLM2 + self-int4 (3 chat prompts x 64 tokens, tokens per sweep at budget
# 16 / 64): temperature 1: 4.03 / 4.78; 0.5: 4.64 / 6.12; 0.3: 4.64 / 5.46.
GREEDY_SCORE_TEMPERATURE = 0.5


def _log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The draft's scores: its processed sampling distribution when the target samples (SpecExec's rule
    accepts a child with the target's probability of it, which the draft's estimates), else its sharpened
    softmax (see GREEDY_SCORE_TEMPERATURE)."""
    if params.greedy:
        return torch.log_softmax(logits.float() / GREEDY_SCORE_TEMPERATURE, dim=-1)
    return logits_to_probs(logits, params).log()
