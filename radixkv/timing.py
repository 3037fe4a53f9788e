"""Wall-clock medians on a noisy machine, for the benchmarks and for choosing between exact kernels.

This project's machines drift by tens of percent over seconds (a slow
phase, a neighbour). Two things timed one after the other can each take a
different phase; timed in turns, a phase falls on all of them alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping


def seconds(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: Mapping[Hashable, Callable[[], object]], rounds: int, per_round: int) -> dict:
    """Median seconds of each of ``fns`` over ``rounds`` x ``per_round`` runs, the functions taking turns by round.

    Each function runs once first, untimed (a warm-up: caches, lazy builds).
    Costs ``(1 + rounds * per_round)`` calls of each.
    """
    times: dict = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k] += [seconds(fn) for _ in range(per_round)]
    return {k: statistics.median(v) for k, v in times.items()}


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    return interleaved({0: fn}, rounds=1, per_round=repeats)[0]


__all__ = ["interleaved", "seconds", "timed"]
