"""Splitting the target's decoder layers into pipeline stages: contiguous ranges, one per stage (actors/stages.py).

A stage holds (or streams) its layers' bytes, so a split follows bytes, not layer counts: the first stage also
carries the embedding lookup and the last the head, and a DeepSeek store's first layers are dense while the rest
route to experts. Each stage's share of the bytes follows its node's weight (the memory it offers); `--split`
gives the ranges by hand.
"""
from __future__ import annotations

from ..errors import ConfigError


def by_weight(unit_bytes: list[int], weights: list[float]) -> list[range]:
    """Layers 0..len(unit_bytes) cut into len(weights) contiguous, non-empty ranges whose bytes are as close as
    whole layers allow to each weight's share of the total. unit_bytes[i]: what layer i costs (its own unit and,
    for a MoE layer, its experts; the head may be folded into the last layer's figure)."""
    n, stages = len(unit_bytes), len(weights)
    if stages < 1 or any(w <= 0 for w in weights):
        raise ConfigError(f"stage weights must be positive, got {weights}")
    if stages > n:
        raise ConfigError(f"{stages} stages for a model of {n} layers: at most one stage per layer")
    total, wsum = float(sum(unit_bytes)), float(sum(weights))
    cuts, acc, goal = [0], 0.0, 0.0
    for i in range(stages - 1):
        goal += total * weights[i] / wsum
        lo, hi = cuts[-1] + 1, n - (stages - 1 - i)  # each stage keeps a layer, and so does each one after it
        best, best_err, acc_at = lo, None, acc
        for cut in range(cuts[-1] + 1, hi + 1):
            acc_at += unit_bytes[cut - 1]
            err = abs(acc_at - goal)
            if cut >= lo and (best_err is None or err < best_err):
                best, best_err = cut, err
        acc += sum(unit_bytes[cuts[-1]:best])
        cuts.append(best)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def parse_split(text: str, n_layers: int | None = None) -> list[range]:
    """`--split "0:10,10:24"`: half-open layer ranges, in order, contiguous, covering 0..n_layers (None: where
    they end is checked later, once the store says how many layers there are)."""
    ranges = []
    for part in text.split(","):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise ConfigError(f"--split: {part.strip()!r} is not a layer range START:END (e.g. 0:12,12:24)") from None
        ranges.append(range(a, b))
    check(ranges, ranges[-1].stop if n_layers is None else n_layers)
    return ranges


def check(ranges: list[range], n_layers: int) -> None:
    """Ranges that cover 0..n_layers in order, each non-empty, with no gap or overlap."""
    end = 0
    for r in ranges:
        if r.start != end or r.stop <= r.start:
            raise ConfigError(f"stage layer ranges must be non-empty and follow each other from 0, got "
                              f"{', '.join(f'{x.start}:{x.stop}' for x in ranges)}")
        end = r.stop
    if end != n_layers:
        raise ConfigError(f"stage layer ranges end at layer {end}, but the model has {n_layers} layers")
