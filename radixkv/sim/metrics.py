"""What a replay comes to for agents, from its per-request rows, and intervals over arrival orders.

Mean TTFT is dominated by the many in-session follow-ups, which a session-aware policy favours; an agent's
user waits for the whole session. ``agent_metrics`` gives, beside TTFT mean and p99:

* per-session **completion** time: its last answer's end less its first request's send, mean and p50;
* each session's **slowdown**: its completion time over the same session's under an unlimited cache (a
  replay of the same requests in the same order, ``reference``), mean and max;
* **first-request TTFT**: the TTFT of each session's first request (a new user's wait), mean and p99;
* the **longest wait**: the largest TTFT of any request;
* **Jain's fairness** over the sessions' slowdowns, ``(sum s)^2 / (n sum s^2)``: 1 when every session is
  slowed alike, 1/n when one bears it all.

Rows are dicts with ``session``, ``ready`` (sent), ``finish``, ``ttft`` and ``rejected`` (the simulator's
``per_request``). ``interval`` is the mean and 95% interval of a metric over orders (Student's t).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
AGENT_METRICS = ("ttft_mean", "ttft_p99", "session_completion_mean", "session_completion_p50", "slowdown_mean",
                 "slowdown_max", "first_ttft_mean", "first_ttft_p99", "longest_wait", "jain_fairness")


def completions(rows: Iterable[dict]) -> dict:
    """Each session's completion time (last finish less first send), by session. O(rows)."""
    span: dict = {}
    for r in rows:
        if not r["rejected"]:
            lo, hi = span.get(r["session"], (math.inf, -math.inf))
            span[r["session"]] = (min(lo, r["ready"]), max(hi, r["finish"]))
    return {s: hi - lo for s, (lo, hi) in span.items()}


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index of ``values``: ``(sum x)^2 / (n sum x^2)``, in [1/n, 1] (1: all equal).

    >>> jain([2.0, 2.0]), jain([1.0, 0.0])
    (1.0, 0.5)
    """
    x = np.asarray(values, dtype=np.float64)
    return float(x.sum() ** 2 / (len(x) * (x ** 2).sum())) if len(x) and (x ** 2).sum() > 0 else 1.0


def agent_metrics(rows: Sequence[dict], reference: Sequence[dict] | None = None) -> dict:
    """The module doc's metrics of one replay's ``rows``; the slowdowns and their fairness need
    ``reference``, the rows of the same replay under an unlimited cache (else they are NaN). O(rows)."""
    served = [r for r in rows if not r["rejected"]]
    ttft = np.array([r["ttft"] for r in served]) if served else np.zeros(1)
    first: dict = {}
    for r in served:
        if r["session"] not in first or r["ready"] < first[r["session"]]["ready"]:
            first[r["session"]] = r
    firsts = np.array([r["ttft"] for r in first.values()]) if first else np.zeros(1)
    done = completions(served)
    times = np.array(list(done.values())) if done else np.zeros(1)
    out = {"ttft_mean": float(ttft.mean()), "ttft_p99": float(np.percentile(ttft, 99)),
           "session_completion_mean": float(times.mean()), "session_completion_p50": float(np.median(times)),
           "first_ttft_mean": float(firsts.mean()), "first_ttft_p99": float(np.percentile(firsts, 99)),
           "longest_wait": float(ttft.max())}
    slow = []
    if reference is not None:
        base = completions(reference)
        slow = [done[s] / base[s] for s in done if base.get(s, 0) > 0]
    out |= {"slowdown_mean": float(np.mean(slow)) if slow else math.nan,
            "slowdown_max": float(np.max(slow)) if slow else math.nan,
            "jain_fairness": jain(slow) if slow else math.nan}
    return out


def interval(values: Sequence[float]) -> dict:
    """Mean and the half-width of its 95% interval (Student's t; 1.96 past 10 degrees of freedom).

    >>> round(interval([1.0, 2.0, 3.0])["ci95"], 3)  # 4.303 x 1 / sqrt(3)
    2.484
    """
    v = np.asarray(values, dtype=np.float64)
    half = T975.get(len(v) - 1, 1.96) * v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
    return {"mean": float(v.mean()), "ci95": float(half), "values": v.tolist()}


def separated(a: dict, b: dict) -> bool:
    """Whether two ``interval``s do not overlap: only then does one configuration beat the other."""
    return a["mean"] + a["ci95"] < b["mean"] - b["ci95"] or b["mean"] + b["ci95"] < a["mean"] - a["ci95"]
