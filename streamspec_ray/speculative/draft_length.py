"""Choosing K, the number of draft tokens per round, from what the run measures.

Both policies see, after every round, how many of the K drafts were accepted, the draft's time per token
and the sweep's time. Acceptance is modelled as i.i.d. per position with rate a, so a round with K drafts
emits E(K) = (1 - a^(K+1)) / (1 - a) tokens in expectation (the accepted prefix plus one).
"""
from __future__ import annotations

import copy
import math
import statistics


def round_time(draft_s: float, busy_s: float, reads_s: float, hidden_s: float) -> float:
    """A round's time from its parts: drafting, then the sweep's own work (`busy`: its wall time less its stalls),
    with the sweep's reads (their disk time) running where they can. `hidden_s` of them run before the sweep,
    while the round verifies and drafts (at most the drafting's time: HiddenReads.hidden), the rest during the
    sweep; so the round takes draft + max(busy, reads - hidden), i.e. the longer of drafting plus the sweep's work
    and the reads plus the time the disk idled in the gap."""
    return draft_s + max(busy_s, reads_s - hidden_s)


def _ahead(sweep) -> float:
    return 1.0 if sweep.read_ahead else sweep.ahead


class HiddenReads:
    """How much of the next sweep's reads a round's drafting hides. The reader runs on while the round verifies
    and drafts, until its read-ahead window is full; so a gap between sweeps hides min(its length, H) of reads, H
    the disk time that the window still has room for when the gap begins. Measured (SweepStats.gap_io_s): a gap in
    which the reader stopped (its disk busy less than 90% of the gap) shows H itself; one that it read through
    shows that H is at least that. Before any gap is measured, the window's share of a sweep's reads
    (SweepStats.ahead; 1 where a whole pass is read ahead).

    The window's share alone overestimated H. The real pair under 1.2 GB reads 7 of its 29 units ahead (21% of
    the bytes), but the reader had most of them read before the sweep ended, while the sweep computed its last
    layers and its 146 MB head: its gaps of 140-220 ms held 30-60 ms of reads, not the 107-127 ms the share
    said. Rounds of K = 5 took 600-745 ms against a forecast of 520-630, and the controller settled on K = 5 where
    K = 8 was 6-14% faster a token (a chat answer, 'three tips for sleeping better')."""

    MIN_GAP_S = 0.02

    def __init__(self, window: int = 8):
        self.share = 0.0
        self.window = window
        self.stopped: list[float] = []  # recent gaps in which the reader stopped: their disk time
        self.through = 0.0              # the most disk time of a gap that the reader read through

    def update(self, sweep) -> None:
        self.share = _ahead(sweep)
        gap, io = sweep.gap_s, sweep.gap_io_s
        if gap < self.MIN_GAP_S:  # (a round whose proposal a lookahead prepared: 5-10 ms, shorter than a read)
            return
        if io < 0.9 * gap:  # the reader stopped: its window was full
            self.stopped = (self.stopped + [io])[-self.window:]
        else:
            self.through = max(self.through, io)

    @property
    def cap(self) -> float | None:
        """H: the median of recent gaps in which the reader stopped (a gap after a long sweep, a prefill's, can
        hold ten times as much), else the most that a gap read through, else None (not measured yet)."""
        if self.stopped:
            return statistics.median(self.stopped)
        return self.through or None

    def hidden(self, draft_s: float, reads_s: float) -> float:
        cap = self.cap
        return min(self.share * reads_s if cap is None else cap, draft_s)

    @property
    def known(self) -> bool:
        """Whether the sweeps read ahead at all (else a round is priced by its sweep's wall time)."""
        return self.share > 0 or self.cap is not None


class FixedK:
    name = "fixed"

    def __init__(self, k: int):
        self.K = k

    def k(self) -> int:
        return self.K

    def update(self, k: int, accepted: int, draft_s: float, sweep_s: float, costs: bool = True,
               sweep=None) -> None:
        """costs False: the round's times say nothing of K's cost (a batch round that also prefilled a new
        sequence, in the sweep and the draft): learn from its acceptance only. sweep: the round's SweepStats,
        where its parts (reads, stalls) are its own (not a batch's share)."""

    def resume(self, before) -> None:
        """Start from what `before` (an earlier generation's controller of the same kind, same engine) learned:
        the machine's costs, and its choice as a starting point (see Engine.generate)."""


class EmaK(FixedK):
    """alpha <- 0.85 alpha + 0.15 accepted/K; grow K while alpha is high, shrink it when low."""
    name = "ema"

    def __init__(self, k: int = 4, k_min: int = 1, k_max: int = 16, hi: float = 0.75, lo: float = 0.45):
        super().__init__(k)
        self.k_min, self.k_max, self.hi, self.lo = k_min, k_max, hi, lo
        self.alpha = 0.7

    def resume(self, before) -> None:
        self.K, self.alpha = before.K, before.alpha

    def update(self, k, accepted, draft_s, sweep_s, costs=True, sweep=None):
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
    on recent (tokens in sweep, seconds) pairs; E(K) = 1 + S(1) + ... + S(K), where S(j) is the chance that the
    first j drafts are all accepted, from a hazard per position.

    Where the sweeps read ahead (SweepStats.ahead > 0), the round is priced by its parts instead (round_time):
    drafting hides the reads that run before the sweep (as many as the read-ahead window has room for, measured:
    HiddenReads), so a longer draft costs less than its own time. A sweep's wall time alone counts that drafting
    twice (the sweep's stall shrinks as drafting grows): the real pair under a 1.2 GB limit (a read-ahead window
    of 7 units), 4 unseen prompts, chose chains of 3.3 tokens per sweep on chat, stalled 196 ms a sweep against
    K = 8's 34, and ran 235 ms/token against K = 8's 217.

    Acceptance is bursty: a draft that gets the first token of a code line right tends to get the whole line
    right, and one that misses misses at once. So the hazard of a rejection at position j is counted from the
    recent rounds that reached j (accepted >= j - 1 and K >= j, weighted by `decay` per round of age), shrunk
    toward the pooled rate 1 - a (a = accepted / (accepted + rejections), the geometric model) by one pseudo-round,
    which alone decides positions no recent round reached. The geometric model alone, on the real pair: after
    four rounds rejected at their first draft it fell to K = 1 and climbed back one step a round while every
    round was accepted whole (190 ms/token against 159 with a fixed K = 8 on a Fibonacci prompt, 224 against
    182 over the bench's eight)."""
    name = "cost"

    # Only a forecast rate this much better than the current K's moves K: a round's forecast is good to several
    # percent (the real pair's under 1.2 GB ran 2-11% longer than forecast), and chasing smaller gains settled a
    # chat answer at K = 5, where K = 8's rounds made 17% more tokens for 4% more time.
    min_gain = 0.04

    # K = 0 (no drafting: the round is one naive sweep) is chosen where drafting does not pay: with the real pair
    # in memory the 0.5B drafts a token in ~40% of the target's time, and chains ran 226 ms/token where naive ran
    # 178. A round with no drafts says nothing of acceptance, so every `probe_every` such rounds one round drafts
    # the best positive K again, and the controller drafts on if acceptance has come back (a code block after
    # prose).
    probe_every = 8

    def __init__(self, k: int = 8, k_min: int = 0, k_max: int = 16, decay: float = 0.9, window: int = 32):
        super().__init__(k)
        self.k_min, self.k_max, self.decay, self.window = k_min, k_max, decay, window
        self.idle = 0  # rounds in a row without drafts
        self.succ, self.fail = 3.0, 1.0  # prior: a = 0.75
        self.t_draft: float | None = None
        self.sweeps: list[tuple[int, float]] = []
        self.busy: list[tuple[int, float]] = []   # sweep time less stalls (sweeps that read ahead)
        self.reads: list[tuple[int, float]] = []  # disk time of the sweep's reads
        self.hidden = HiddenReads()
        self.rounds: list[tuple[int, int]] = []  # recent (K, accepted), oldest first

    def update(self, k, accepted, draft_s, sweep_s, costs=True, sweep=None):
        if k > 0:
            self.succ = self.decay * self.succ + accepted
            self.fail = self.decay * self.fail + (1 if accepted < k else 0)
            self.rounds = (self.rounds + [(k, accepted)])[-self.window:]
        idle, self.idle = self.idle, (self.idle + 1 if k == 0 else 0)
        if not costs:
            return
        if k > 0:
            per = draft_s / k
            if self.t_draft is None or (idle and per < self.t_draft):
                # after idle rounds the draft first caught up on the tokens it skipped, so a probe's time per token
                # is an upper bound of a drafted token's cost: it may only lower the estimate (one inflated by a
                # busy spell of the machine would otherwise hold K at 0 for good)
                self.t_draft = per
            elif not idle:
                self.t_draft = 0.8 * self.t_draft + 0.2 * per
        self.sweeps = (self.sweeps + [(k + 1, sweep_s)])[-self.window:]
        if sweep is not None:
            self.hidden.update(sweep)
            self.busy = (self.busy + [(k + 1, sweep.wall_s - sweep.stall_s)])[-self.window:]
            self.reads = (self.reads + [(k + 1, sweep.io_s)])[-self.window:]
        if self._measured:
            self.K = self.best_k()
            if self.K == 0 and self.idle >= self.probe_every:
                self.K = self.best_k(k_min=1)  # (one round drafts again: has acceptance come back?)

    def resume(self, before) -> None:
        # the costs are the machine's and the models'; acceptance is the prompt's, so only its rate carries over,
        # weighted as the prior (4 rounds) that the next prompt's own rounds soon outweigh
        self.K, self.t_draft, self.sweeps = before.K, before.t_draft, list(before.sweeps)
        self.busy, self.reads, self.hidden = list(before.busy), list(before.reads), copy.copy(before.hidden)
        a = before.acceptance
        self.succ, self.fail = 4 * a, 4 * (1 - a)
        # and the first K is chosen for that prior, not the last prompt's own runs (a chat answer started at the
        # K = 16 that code prompts had left, and its first rounds drafted 16 tokens where 2-5 were accepted)
        if self._measured:
            self.K = self.best_k()

    @property
    def _measured(self) -> bool:
        """Whether the costs are measured enough to choose K by them."""
        return self.t_draft is not None and len(self.sweeps) >= 2

    @property
    def acceptance(self) -> float:
        return self.succ / (self.succ + self.fail)

    def survival(self, k: int) -> list[float]:
        """[S(1), ..., S(k)]: the chance that the first j drafts are all accepted (see the class docstring)."""
        pooled = 1.0 - self.acceptance
        reached, failed = [0.0] * (k + 1), [0.0] * (k + 1)
        w = 1.0
        for kk, acc in reversed(self.rounds):
            for j in range(1, min(kk, acc + 1, k) + 1):
                reached[j] += w
            if acc < kk and acc + 1 <= k:
                failed[acc + 1] += w
            w *= self.decay
        out, s = [], 1.0
        for j in range(1, k + 1):
            s *= 1.0 - (failed[j] + pooled) / (reached[j] + 1.0)
            out.append(s)
        return out

    def expected(self, k: int) -> float:
        """E[tokens a round emits] with k drafts: the accepted ones and the target's own next token."""
        return 1.0 + sum(self.survival(k))

    def sweep_cost(self, n: int) -> float:
        return _line(self.sweeps, n)

    def round_s(self, k: int) -> float:
        """A round's forecast time with k drafts (see the class docstring)."""
        draft = k * self.t_draft
        if self.hidden.known and self.busy:
            reads = _line(self.reads, k + 1)
            return round_time(draft, _line(self.busy, k + 1), reads, self.hidden.hidden(draft, reads))
        return draft + self.sweep_cost(k + 1)

    def best_k(self, k_min: int | None = None) -> int:
        """The K of the highest forecast rate, unless the current K's forecast is within min_gain of it."""
        surv = self.survival(self.k_max)
        lo = self.k_min if k_min is None else k_min
        rate = {k: (1.0 + sum(surv[:k])) / self.round_s(k) for k in range(lo, self.k_max + 1)}
        best = max(rate, key=rate.get)
        if self.K in rate and rate[best] < rate[self.K] * (1.0 + self.min_gain):
            return self.K
        return best


def make_controller(k: int | str, k_max: int = 16):
    """k: an int (fixed K), "adaptive" / "cost" (cost model) or "ema"."""
    if k in ("adaptive", "cost"):
        return CostModelK(k=8, k_max=k_max)
    if k == "ema":
        return EmaK(k=4, k_max=k_max)
    return FixedK(int(k))


class FixedBudget:
    """Tree mode with a fixed node budget."""
    name = "fixed-budget"

    def __init__(self, budget: int):
        self.N = budget

    def budget(self) -> int:
        return self.N

    def update(self, tree, accepted: int, sweep, costs: bool = True) -> None:
        pass

    def resume(self, before) -> None:
        """As FixedK.resume, for tree budgets."""


class CostModelBudget(FixedBudget):
    """Pick the tree budget N that maximizes E(N) / (t_draft(N) + t_sweep(P + N)), all measured.

    t_sweep(n) and t_draft(N) are least-squares lines over recent rounds (a streamed sweep's cost grows
    slowly with its tokens until compute dominates; the draft's grows with the nodes it expands). E(N), the
    tokens a round emits: every tree carries the draft's own forecast for each of its top-n prefixes (1 + the
    sum of their path probabilities, tree.expected_tokens), scaled by a calibration factor, an EMA of measured
    / forecast. Budgets above the last tree's size are forecast by assuming each further doubling gains what
    the last doubling gained times the ratio of the forecast's last two doublings (clamped to 0.25-1; 0.5 for
    trees under 4 nodes). Half, as before, was too pessimistic: measured trees gained 1.69, 1.64 and 1.06
    tokens per sweep from budget 16 to 32, 64 and 128, and cold the budget stayed at 16 where 64 and 128 were
    faster. The budget moves at most one doubling per
    round, so every choice above what was measured gets measured before the next.

    Where the sweeps read ahead (SweepStats.ahead), the next sweep's reads run during drafting, and drafting is
    hidden up to the reads the read-ahead window has room for (HiddenReads): a round takes round_time(t_draft(N),
    t_busy(P + N), t_read, hidden) (with a whole pass read ahead, max(t_read, t_draft(N) + t_busy(P + N))), with
    t_read the disk time of a sweep's reads and t_busy a sweep's time less its stalls, both lines as above. A
    sweep's wall time alone would count drafting twice (it shrinks as drafting grows: its stall is what the
    drafting did not hide), and cold on a disk slower than drafting plus compute the budget stayed below the best
    fixed one."""
    name = "cost-budget"

    def __init__(self, budget_max: int = 128, start: int = 16, window: int = 32):
        super().__init__(min(start, budget_max))
        self.budget_max, self.window = budget_max, window
        self.ladder = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= budget_max}
                             | {budget_max})
        self.calib = 1.0
        self.sweeps: list[tuple[int, float]] = []
        self.busy: list[tuple[int, float]] = []   # sweep time less stalls
        self.reads: list[tuple[int, float]] = []  # disk time of the sweep's reads
        self.hidden = HiddenReads()
        self.drafts: list[tuple[int, float]] = []
        self.forecast: list[float] = []

    def update(self, tree, accepted, sweep, costs=True):
        if costs and sweep.tokens == len(tree) + 1:  # (not the first round's, which carries the whole prompt)
            self.sweeps = (self.sweeps + [(sweep.tokens, sweep.wall_s)])[-self.window:]
            self.busy = (self.busy + [(sweep.tokens, sweep.wall_s - sweep.stall_s)])[-self.window:]
            self.reads = (self.reads + [(sweep.tokens, sweep.io_s)])[-self.window:]
            self.hidden.update(sweep)
        self.drafts = (self.drafts + [(len(tree), tree.draft_s)])[-self.window:]
        forecast = tree.expected_tokens()
        if len(forecast) > 1:
            self.calib = 0.8 * self.calib + 0.2 * (accepted + 1) / forecast[-1]
            self.forecast = forecast
        if len(self.sweeps) >= 2 and self.forecast:
            self.N = self.best_budget()

    def resume(self, before) -> None:
        # costs (sweep and drafting lines) and the calibration of the draft's forecasts carry over; the next
        # prompt's trees bring their own forecasts
        self.N, self.calib = before.N, before.calib
        self.sweeps, self.drafts = list(before.sweeps), list(before.drafts)
        self.busy, self.reads, self.hidden = list(before.busy), list(before.reads), copy.copy(before.hidden)

    def expected(self, n: int) -> float:
        f = self.forecast
        m = len(f) - 1  # the last tree's size
        if n <= m:
            return self.calib * f[n]
        gain, e, size = f[m] - f[m // 2], f[m], m
        before = f[m // 2] - f[m // 4] if m >= 4 else 0.0
        ratio = min(1.0, max(0.25, gain / before)) if before > 0 else 0.5  # the forecast's own concavity
        while size < n:
            gain, size = gain * ratio, size * 2
            e += gain
        return self.calib * e

    def best_budget(self) -> int:
        reach = max(b for b in self.ladder if b <= max(1, 2 * self.N))
        best, best_rate = self.ladder[0], -math.inf
        for n in self.ladder:
            if n > reach:
                break
            rate = self.expected(n) / self.round_s(n)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def round_s(self, n: int) -> float:
        """A round's forecast time at budget n (see the class docstring)."""
        if self.hidden.known:
            draft, reads = _line(self.drafts, n), _line(self.reads, n + 1)
            return round_time(draft, _line(self.busy, n + 1), reads, self.hidden.hidden(draft, reads))
        return _line(self.drafts, n) + _line(self.sweeps, n + 1)


def line_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares line through (x, seconds) points -> (intercept, slope); the slope is clamped at >= 0,
    and 0 when the points do not vary in x."""
    xs = [p for p, _ in points]
    ys = [q for _, q in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((v - mx) ** 2 for v in xs)
    slope = max(0.0, sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / var) if var > 0 else 0.0
    return my - slope * mx, slope


def _line(points: list[tuple[int, float]], x: float) -> float:
    """line_fit's line at x (seconds > 0); below the smallest x measured, its value there. A sweep's cost is not
    a line down to one row: fewer rows read the same weights. With the real pair held in memory (q4q8), sweeps of
    9 and 17 rows measured ~150 and ~280 ms, a line through them forecast ~20 ms for one row where it takes ~50,
    and the controller left drafting (K = 0) on code whose drafts it accepted 90% of the time. So a size smaller
    than any measured is priced as the smallest measured, until a round of that size measures it."""
    if not points:
        return 1e-6
    c0, c1 = line_fit(points)
    return max(c0 + c1 * max(x, min(p for p, _ in points)), 1e-6)


def make_budget_controller(budget: int | str, budget_max: int = 128):
    """budget: an int (fixed node budget) or "adaptive" (cost model, at most budget_max nodes)."""
    if budget in ("adaptive", "cost"):
        return CostModelBudget(budget_max)
    return FixedBudget(int(budget))
