"""Choosing K, the number of draft tokens per round, from what the run measures.

Both policies see, after every round, how many of the K drafts were accepted, the draft's time per token
and the sweep's time. Acceptance is modelled as i.i.d. per position with rate a, so a round with K drafts
emits E(K) = (1 - a^(K+1)) / (1 - a) tokens in expectation (the accepted prefix plus one).
"""
from __future__ import annotations

import math


class FixedK:
    name = "fixed"

    def __init__(self, k: int):
        self.K = k

    def k(self) -> int:
        return self.K

    def update(self, k: int, accepted: int, draft_s: float, sweep_s: float) -> None:
        pass


class EmaK(FixedK):
    """alpha <- 0.85 alpha + 0.15 accepted/K; grow K while alpha is high, shrink it when low."""
    name = "ema"

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 16, hi: float = 0.75, lo: float = 0.45):
        super().__init__(k)
        self.k_min, self.k_max, self.hi, self.lo = k_min, k_max, hi, lo
        self.alpha = 0.7

    def update(self, k, accepted, draft_s, sweep_s):
        if k == 0:
            return
        self.alpha = 0.85 * self.alpha + 0.15 * accepted / k
        if self.alpha > self.hi:
            self.K = min(self.K + 1, self.k_max)
        elif self.alpha < self.lo:
            self.K = max(self.K - 1, self.k_min)


def expected_tokens(a: float, k: int) -> float:
    """E[tokens emitted per round] with K drafts and per-position acceptance a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class CostModelK(FixedK):
    """Pick the K that maximizes E(K) / (K * t_draft + t_sweep(K + 1)), all measured:
    t_draft = EMA of the draft's seconds per proposed token; t_sweep(n) = c0 + c1 * n fitted by least squares
    on recent (tokens in sweep, seconds) pairs; a = EMA-weighted accepted / (accepted + rejections)."""
    name = "cost"

    def __init__(self, k: int = 8, k_min: int = 1, k_max: int = 16, decay: float = 0.9, window: int = 32):
        super().__init__(k)
        self.k_min, self.k_max, self.decay, self.window = k_min, k_max, decay, window
        self.succ, self.fail = 3.0, 1.0  # prior: a = 0.75
        self.t_draft: float | None = None
        self.sweeps: list[tuple[int, float]] = []

    def update(self, k, accepted, draft_s, sweep_s):
        if k > 0:
            self.succ = self.decay * self.succ + accepted
            self.fail = self.decay * self.fail + (1 if accepted < k else 0)
            per = draft_s / k
            self.t_draft = per if self.t_draft is None else 0.8 * self.t_draft + 0.2 * per
        self.sweeps = (self.sweeps + [(k + 1, sweep_s)])[-self.window:]
        if self.t_draft is not None and len(self.sweeps) >= 2:
            self.K = self.best_k()

    @property
    def acceptance(self) -> float:
        return self.succ / (self.succ + self.fail)

    def sweep_cost(self, n: int) -> float:
        xs = [x for x, _ in self.sweeps]
        ys = [y for _, y in self.sweeps]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var > 0 else 0.0
        return max(my + slope * (n - mx), 1e-6)

    def best_k(self) -> int:
        a = self.acceptance
        best, best_rate = self.k_min, -math.inf
        for k in range(self.k_min, self.k_max + 1):
            rate = expected_tokens(a, k) / (k * self.t_draft + self.sweep_cost(k + 1))
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def make_controller(k: int | str, k_max: int = 16):
    """k: an int (fixed K), "adaptive" / "cost" (cost model) or "ema"."""
    if k in ("adaptive", "cost"):
        return CostModelK(k=8, k_max=k_max)
    if k == "ema":
        return EmaK(k=4, k_max=k_max)
    return FixedK(int(k))
