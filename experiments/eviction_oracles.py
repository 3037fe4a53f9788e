"""What knowing the future is worth to eviction on Mooncake's conversation trace: oracles between LRU and Belady.

``python -m experiments.eviction_oracles --out docs/figures/eviction/oracles`` replays the trace through one
radix cache (page 512, ``simulate``'s defaults, as ``experiments.eviction``'s targets) at 1M, 2M, 4M and 8M
tokens under:

* LRU and the best online policies (``arc``, ``learned``);
* **oracles that know part of the future**: ``continues`` knows which requests a later turn of their
  conversation extends (not when); ``continues <= G s`` knows which are extended within G seconds of their
  arrival. Each ranks an entry by what it knows of the latest request that used it (0 first), then LRU;
* ``group rates (hindsight)``: ``learned``'s rank (``last_access + horizon x ln p``) with p each request's
  feature group's continuation rate over the whole trace (below): the best estimate a learner of those
  features could reach, given in advance; ``rich groups`` the same over every feature the trace offers
  (``rich_features``: also the request's output length and its new prompt tokens), of continuation within
  60 or 300 s (so many small groups that the rates fit the trace: a bound, not a learner), and the same
  ``cross-fitted`` (each half of the trace rated from the other: what a learner could carry over);
* Belady (knows every future request) and the trace's upper bound (unlimited memory).

It also tabulates how well what an online policy can see predicts that future: for requests grouped by
their turn, the previous turn's gap and their prompt length, how many were continued (and within 60 s), and
the token-weighted AUC of the best predictor built from those groups in hindsight. Writes ``<out>.jsonl``
(one row per run with its full config), ``<out>.png`` and ``<out>.md`` (the tables docs/eviction.md shows).

A request's **parent** is the latest earlier request that shares the longest run of its leading blocks
(``hash_ids``), when that run is at least ``--min-shared-blocks`` long (2: every request of this trace starts
with the same block 0, so one shared block says nothing of a conversation).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from experiments.common import (
    DEFAULT_TRACE,
    environment,
    fractions_from,
    log_capacity_axis,
    names_from,
    parser,
    run_cli,
    save_figure,
    table,
    with_ext,
    write_rows,
)
from radixkv.cache import make_cache
from radixkv.cache.base import CacheHints
from radixkv.cache.eviction.base import Entry
from radixkv.cache.eviction.requests import Priority
from radixkv.sim import simulate
from radixkv.workloads import Request
from radixkv.workloads.mooncake import read_trace, trace_requests, trace_upper_bound

ONLINE = ("lru", "arc", "learned")
GAPS = (60.0, 120.0, 300.0)  # the timed oracles' horizons, seconds
PREV_GAP_EDGES = (30.0, 60.0, 120.0, 300.0)
LENGTH_EDGES = (2_000, 5_000, 10_000, 20_000)
OUTPUT_EDGES = (50, 150, 300, 600)
NEW_TOKEN_EDGES = (100, 500, 2_000, 8_000)


class LatestHint(Priority):
    """Ranks an entry by the ``CacheHints.priority`` of the latest request that inserted or matched it (lower
    first), then least recently used: with a priority an oracle derived from the future ("this request's
    conversation continues"), the prefix of a conversation that has ended goes first. Unlike ``priority``,
    which keeps the highest priority an entry ever had, the latest request decides. O(log n) per push and
    pop, O(1) per entry of a touched path."""

    name = "latest_hint"

    def touched(self, entries: Sequence[Entry], hints: CacheHints, hit: bool) -> None:
        for entry in entries:
            entry.state = hints.priority


def conversation_links(requests: Sequence[Request], min_shared_blocks: int = 2) -> list[int]:
    """Each request's parent (an index into ``requests``, arrival order) or -1; see the module docstring.
    O(total blocks): a dict from each leading-block run to the latest request that had it."""
    latest: dict[tuple, int] = {}
    parents = []
    for i, r in enumerate(requests):
        ids, parent, run = r.meta["hash_ids"], -1, ()
        for depth, block in enumerate(ids, 1):
            run += (block,)
            owner = latest.get(run)
            if owner is None:
                break
            if depth >= min_shared_blocks:
                parent = owner
        parents.append(parent)
        run = ()
        for block in ids:
            run += (block,)
            latest[run] = i
    return parents


def next_turn_gaps(requests: Sequence[Request], parents: Sequence[int]) -> np.ndarray:
    """Seconds from each request's arrival to its first continuation's, ``inf`` where none comes."""
    gaps = np.full(len(requests), np.inf)
    for i, p in enumerate(parents):
        if p >= 0 and not np.isfinite(gaps[p]):
            gaps[p] = requests[i].arrival - requests[p].arrival
    return gaps


def with_oracle(requests: Sequence[Request], gaps: np.ndarray, horizon: float) -> list[Request]:
    """The requests, each with priority 1 when its conversation continues within ``horizon`` s (``inf``:
    at all), else 0."""
    return [dataclasses.replace(r, priority=int(math.isfinite(g) and g <= horizon))
            for r, g in zip(requests, gaps, strict=True)]


def group_rates(feats: Sequence[tuple], gaps: np.ndarray, within: float = math.inf) -> tuple[np.ndarray, int]:
    """Each request's feature group's (``features``) share continued (within ``within`` s) over the whole
    trace, in hindsight: the best estimate any learner of those features could make; and how many groups."""
    cont = np.isfinite(gaps) & (gaps <= within)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, f in enumerate(feats):
        groups[f].append(i)
    rate = np.zeros(len(feats))
    for ids in groups.values():
        rate[ids] = cont[ids].mean()
    return rate, len(groups)


def cross_fitted_rates(feats: Sequence[tuple], gaps: np.ndarray, within: float, prior: float = 20.0) -> np.ndarray:
    """``group_rates`` out of sample: each half of the trace (by arrival) gets its groups' rates from the
    other half, shrunk toward that half's pooled rate with ``prior`` pseudo-requests (``learned``'s rule), so
    a rate never counts the request it is given to, as an online learner's never does."""
    cont = (np.isfinite(gaps) & (gaps <= within)).astype(float)
    first = np.arange(len(feats)) < len(feats) // 2
    rate = np.zeros(len(feats))
    for fold in (first, ~first):
        fit = np.flatnonzero(~fold)
        pooled = cont[fit].mean() if len(fit) else 0.0
        hits: dict[tuple, float] = defaultdict(float)
        seen: dict[tuple, int] = defaultdict(int)
        for i in fit:
            hits[feats[i]] += cont[i]
            seen[feats[i]] += 1
        for i in np.flatnonzero(fold):
            rate[i] = (hits[feats[i]] + prior * pooled) / (seen[feats[i]] + prior) if seen[feats[i]] + prior else 0
    return rate


def with_group_rates(requests: Sequence[Request], rates: np.ndarray) -> list[Request]:
    """The requests, each with priority = its ``group_rates`` rate in thousandths."""
    return [dataclasses.replace(r, priority=round(1000 * x)) for r, x in zip(requests, rates, strict=True)]


class GroupRate(LatestHint):
    """``learned``'s rank with a rate given in hindsight: ``last_access + horizon x ln p``, p the latest
    request's hint in thousandths (``with_group_rates``), horizon in ticks. O(log n) per push and pop."""

    name = "group_rate"

    def __init__(self, horizon: float = 6000.0):
        self.horizon = horizon
        super().__init__()

    def priority(self, entry: Entry) -> float:
        return entry.last_access + self.horizon * math.log(max(entry.state or 0, 1) / 1000)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One way to evict: an online policy (or Belady) by name, or an oracle's hints and the policy reading
    them. ``hints``: ``"continues"`` (continued within ``horizon`` s) or ``"group_rates"`` (the group's share
    continued within ``horizon`` s, groups of ``features``: ``"base"`` or ``"rich"``, rates ``fit`` to the
    whole trace (``"hindsight"``) or ``"cross"``-fitted, ranked with ``rank_horizon`` ticks: of 300-20,000,
    the best at 1M and 4M in hindsight)."""

    policy: str
    hints: str | None = None
    horizon: float | None = None
    features: str = "base"
    rank_horizon: float = 6000.0
    fit: str = "hindsight"


ARMS: dict[str, Arm] = {
    **{p: Arm(p) for p in ONLINE}, "continues": Arm("latest_hint", "continues", math.inf),
    **{f"continues <= {g:g} s": Arm("latest_hint", "continues", g) for g in GAPS},
    "group rates (hindsight)": Arm("group_rate", "group_rates", math.inf),
    "rich groups <= 60 s (hindsight)": Arm("group_rate", "group_rates", 60.0, "rich"),
    "rich groups <= 300 s (hindsight)": Arm("group_rate", "group_rates", 300.0, "rich", 2000.0),
    "rich groups <= 60 s (cross-fitted)": Arm("group_rate", "group_rates", 60.0, "rich", fit="cross"),
    "rich groups <= 300 s (cross-fitted)": Arm("group_rate", "group_rates", 300.0, "rich", 2000.0, "cross"),
    "belady": Arm("belady")}


def run_arm(requests: Sequence[Request], gaps: np.ndarray, rates: dict[tuple, np.ndarray], arm: str, capacity: int,
            seed: int) -> dict:
    """One replay: the arm's hit rate, evicted tokens and wall seconds (``rates``: by features, horizon and
    fit, as ``arm_rates`` builds them)."""
    a = ARMS[arm]
    t0 = time.perf_counter()
    if a.hints is None:
        res = simulate(requests, cache="radix", page_size=512, eviction_policy=a.policy, capacity_tokens=capacity,
                       seed=seed)
    else:
        continues = a.hints == "continues"
        if continues:
            hinted, policy = with_oracle(requests, gaps, a.horizon), LatestHint()
        else:
            hinted, policy = with_group_rates(requests, rates[a.features, a.horizon, a.fit]), GroupRate(a.rank_horizon)
        res = simulate(hinted, cache=make_cache("radix", page_size=512, eviction_policy=policy),
                       capacity_tokens=capacity, seed=seed)
    s = res.summary()
    return {"arm": arm, "eviction_policy": a.policy, "hints": a.hints, "oracle_horizon_s": a.horizon,
            "features": a.features if a.hints == "group_rates" else None,
            "rank_horizon": a.rank_horizon if a.hints == "group_rates" else None,
            "fit": a.fit if a.hints == "group_rates" else None,
            "capacity_tokens": capacity, "hit_rate": s["hit_rate"], "evicted_tokens": s["evicted_tokens"],
            "seconds": time.perf_counter() - t0}


def arm_rates(arms: Sequence[str], feats: dict[str, list[tuple]], gaps: np.ndarray) -> dict[tuple, np.ndarray]:
    """The rates the chosen group-rate arms read, by (features, horizon, fit), each computed once."""
    keys = {(ARMS[a].features, ARMS[a].horizon, ARMS[a].fit) for a in arms if ARMS[a].hints == "group_rates"}
    return {(f, h, fit): group_rates(feats[f], gaps, h)[0] if fit == "hindsight" else
            cross_fitted_rates(feats[f], gaps, h) for f, h, fit in keys}


# ------------------------------------------------------------------------------------ what is predictable

def features(requests: Sequence[Request], parents: Sequence[int]) -> list[tuple[str, str, str]]:
    """What an online policy can know of each request when it arrives: its turn (1, 2, 3, 4+), the gap since
    its previous turn (seconds, bucketed; "none" on turn 1) and its prompt length (bucketed)."""
    turn = [1] * len(requests)
    out = []
    for i, (r, p) in enumerate(zip(requests, parents, strict=True)):
        turn[i] = turn[p] + 1 if p >= 0 else 1
        prev = "none" if p < 0 else _bucket(r.arrival - requests[p].arrival, PREV_GAP_EDGES, " s")
        out.append((str(min(turn[i], 4)) + ("+" if turn[i] >= 4 else ""), prev,
                    _bucket(len(r.prompt), LENGTH_EDGES, "")))
    return out


def rich_features(requests: Sequence[Request], parents: Sequence[int], feats: Sequence[tuple]) -> list[tuple]:
    """``features`` and what else the trace tells of a request: its output length (known once it finishes)
    and its new prompt tokens (beyond its parent's prompt and output; all of it on turn 1), bucketed."""
    out = []
    for r, p, f in zip(requests, parents, feats, strict=True):
        new = len(r.prompt) - (len(requests[p].prompt) + requests[p].output_len if p >= 0 else 0)
        out.append((*f, _bucket(r.output_len, OUTPUT_EDGES, " out"), _bucket(new, NEW_TOKEN_EDGES, " new")))
    return out


def _bucket(x: float, edges: Sequence[float], unit: str) -> str:
    i = int(np.searchsorted(edges, x, side="right"))
    lo = f"{edges[i - 1]:,g}" if i else "0"
    return f"{lo}+{unit}" if i == len(edges) else f"{lo}-{edges[i]:,g}{unit}"


def _lower_edge(value: str) -> float:
    """A bucket label's lower edge, for sorting ("none" first)."""
    return -1.0 if value == "none" else float(value.split("-")[0].rstrip("+ s").replace(",", ""))


def weighted_auc(score: np.ndarray, label: np.ndarray, weight: np.ndarray) -> float:
    """Area under the ROC curve of ``score`` for binary ``label``, each sample counted ``weight`` times, ties
    counted half (the probability a random positive outscores a random negative)."""
    order = np.argsort(score, kind="stable")
    score, pos, neg = score[order], (weight * label)[order], (weight * (1 - label))[order]
    starts = np.flatnonzero(np.r_[True, score[1:] != score[:-1]])
    p, n = np.add.reduceat(pos, starts), np.add.reduceat(neg, starts)
    below = np.cumsum(n) - n  # negatives strictly below each tie group
    return float((p * (below + n / 2)).sum() / (pos.sum() * neg.sum()))


def predictability(requests: Sequence[Request], feats: Sequence[tuple], gaps: np.ndarray,
                   rich: Sequence[tuple] | None = None) -> dict:
    """Per feature value: requests, share of prompt tokens, share continued (and within 60 s), median gap to
    the next turn; and the token-weighted AUC of the in-hindsight rate of each request's feature group (and
    of its ``rich_features`` group, given ``rich``)."""
    tokens = np.array([len(r.prompt) for r in requests], dtype=float)
    cont = np.isfinite(gaps).astype(float)
    rows = []
    for k, name in enumerate(("turn", "previous gap", "prompt tokens")):
        groups: dict[str, list[int]] = defaultdict(list)
        for i, f in enumerate(feats):
            groups[f[k]].append(i)
        for value, ids in sorted(groups.items(), key=lambda kv: _lower_edge(kv[0])):
            g = gaps[ids]
            rows.append({"feature": name, "value": value, "requests": len(ids),
                         "token_share": tokens[ids].sum() / tokens.sum(), "continued": cont[ids].mean(),
                         "continued_60s": float(np.mean(g <= 60.0)),
                         "median_next_gap_s": float(np.median(g[np.isfinite(g)])) if np.isfinite(g).any() else None})
    hindsight, cells = group_rates(feats, gaps)
    out = {"groups": rows, "cells": cells, "auc_tokens": weighted_auc(hindsight, cont, tokens),
           "auc_turn_tokens": weighted_auc(np.array([int(f[0].rstrip("+")) for f in feats], dtype=float), cont,
                                           tokens)}
    if rich is not None:
        rates, out["rich_cells"] = group_rates(rich, gaps)
        out["auc_rich_tokens"] = weighted_auc(rates, cont, tokens)
    return out


# ---------------------------------------------------------------------------------------------- output

def markdown(runs: list[dict], pred: dict, bound: float) -> str:
    caps = sorted({r["capacity_tokens"] for r in runs})
    by = {(r["arm"], r["capacity_tokens"]): r["hit_rate"] for r in runs}
    lines = ["| arm | " + " | ".join(f"{c:,}" for c in caps) + " |", "| --- |" + " ---: |" * len(caps)]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        cells = []
        for c in caps:
            x, lru, bel = by.get((arm, c)), by.get(("lru", c)), by.get(("belady", c))
            share = f" ({(x - lru) / (bel - lru):.0%})" if None not in (x, lru, bel) and bel > lru else ""
            cells.append("" if x is None else f"{x:.4f}{share}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", f"Upper bound {bound:.4f}; in parentheses, the share of the LRU -> Belady gap.", "",
              "| feature | value | requests | prompt tokens | continued | within 60 s | median gap to next (s) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for g in pred["groups"]:
        gap = "" if g["median_next_gap_s"] is None else f"{g['median_next_gap_s']:.0f}"
        lines.append(f"| {g['feature']} | {g['value']} | {g['requests']:,} | {g['token_share']:.1%} | "
                     f"{g['continued']:.2f} | {g['continued_60s']:.2f} | {gap} |")
    lines += ["", f"Token-weighted AUC of each request's group rate in hindsight ({pred['cells']} groups of turn x "
              f"previous gap x prompt tokens): {pred['auc_tokens']:.3f}; of the turn alone: "
              f"{pred['auc_turn_tokens']:.3f} (0.5: no better than chance)."]
    if "auc_rich_tokens" in pred:
        lines[-1] += (f" With output length and new prompt tokens too ({pred['rich_cells']} groups, fitted to the "
                      f"trace): {pred['auc_rich_tokens']:.3f}.")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], bound: float) -> Figure:
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for arm in dict.fromkeys(r["arm"] for r in runs):
        pts = sorted((r["capacity_tokens"] / 1e6, r["hit_rate"]) for r in runs if r["arm"] == arm)
        style = "k--" if arm == "belady" else ("-" if arm in ONLINE else ":")
        ax.plot(*zip(*pts, strict=True), style, marker="o", label=arm)
    ax.axhline(bound, color="grey", linestyle="-.", label=f"upper bound {bound:.3f}")
    log_capacity_axis(ax, (r["capacity_tokens"] / 1e6 for r in runs), "radix cache capacity (million tokens, page 512)")
    ax.set_ylabel("hit rate (prompt tokens)")
    ax.set_title("Mooncake conversation: online policies, oracles, Belady")
    ax.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/eviction_oracles")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--capacities", default="1e6,2e6,4e6,8e6", help="radix cache capacities, tokens")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {list(ARMS)}")
    p.add_argument("--min-shared-blocks", type=int, default=2, help="leading blocks a parent shares, at least")
    args = p.parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.min_shared_blocks < 1:
        p.error("--limit and --min-shared-blocks must be >= 1")
    chosen = names_from(args.arms, ARMS, "--arms")
    caps = [int(c) for c in fractions_from(args.capacities, "--capacities")]
    if not all(caps):
        raise ValueError("--capacities: every capacity must be >= 1 token (the oracles need evictions)")
    records = read_trace(args.trace, args.limit)
    requests, bound = trace_requests(records), trace_upper_bound(records)["hit_rate"]
    parents = conversation_links(requests, args.min_shared_blocks)
    gaps, feats = next_turn_gaps(requests, parents), features(requests, parents)
    rich = rich_features(requests, parents, feats)
    rates = arm_rates(chosen, {"base": feats, "rich": rich}, gaps)
    config = {"trace": args.trace, "limit": args.limit, "cache": "radix", "page_size": 512,
              "min_shared_blocks": args.min_shared_blocks, "seed": args.seed, "simulate": "defaults (CostModel())",
              "upper_bound": bound, "env": environment(), "args": vars(args)}
    runs = []
    for cap in caps:
        for arm in chosen:
            runs.append({**run_arm(requests, gaps, rates, arm, cap, args.seed), **config})
            print(f"{cap:>10,} {arm:<22} {runs[-1]['hit_rate']:.4f} ({runs[-1]['seconds']:.1f} s)", flush=True)
    pred = predictability(requests, feats, gaps, rich)
    rows = runs + [{"kind": "predictability", **pred, **config}]
    print(table(runs, ["capacity_tokens", "arm", "hit_rate", "seconds"], {"hit_rate": ".4f", "seconds": ".1f"}))
    text = markdown(runs, pred, bound)
    md = with_ext(args.out, ".md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    print(text)
    print("wrote", write_rows(args.out, rows), save_figure(plot(runs, bound), args.out), md)
    return rows


if __name__ == "__main__":
    run_cli(main)
