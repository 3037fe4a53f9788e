"""The paper's figures 2-6, each drawn from result rows alone.

Every function takes the rows of one experiment's ``.jsonl`` (a list of dicts,
as ``experiments.common.read_rows`` returns them) and returns a matplotlib
``Figure``. Nothing here imports the engine: only numpy and matplotlib, so a
figure can be redrawn anywhere the JSONL file is (``python -m
experiments.figures``, ``notebooks/results.ipynb``). Rows the functions do not
understand (summary rows, other runs' keys) are skipped, and missing optional
keys fall back to sensible defaults.

===========  ==========================  =====================================
figure       function                    rows from
===========  ==========================  =====================================
2            ``fig2_policy_bounds``      ``python -m experiments.ablation``
3            ``fig3_mooncake_capacity``  ``python -m experiments.mooncake``
4            ``fig4_multiturn_ttft``     ``python -m experiments.multiturn``
5            ``fig5_block_size``         ``python -m experiments.block_size``
6            ``fig6_ablation``           ``python -m experiments.ablation``
===========  ==========================  =====================================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

SGLANG_PCT_OF_OPTIMAL = 96.0  # SGLang: cache-aware scheduling reaches 96% of the optimal hit rate on average
MOONCAKE_PAPER_REUSE = 0.40  # Mooncake: about 40% prefix reuse with an unlimited cache on its conversation trace
CACHE_COLORS = {"none": "tab:gray", "hash": "tab:orange", "hash-v0": "tab:red", "radix": "tab:blue"}


# ---------------------------------------------------------------------------------------------------- helpers


def _num(x: Any) -> float | None:
    """``x`` as a float, or None for missing / non-numeric / NaN values."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v


def _ordered(values: Iterable[Any]) -> list[Any]:
    """Distinct values in first-seen order."""
    return list(dict.fromkeys(values))


def _schedule(r: dict) -> str:
    """A row's scheduling label: ablation's ``schedule`` (e.g. ``lpm+in-batch``), else ``schedule_policy``."""
    s = r.get("schedule") or r.get("schedule_policy") or "?"
    if "schedule" not in r and r.get("in_batch_sharing"):
        s += "+in-batch"
    return str(s)


def _capacity_key(r: dict) -> Any:
    """A row's capacity: the fraction of the workload's tokens when given, else the token count (None = unlimited)."""
    return r["capacity_frac"] if "capacity_frac" in r else r.get("capacity_tokens")


def _capacity_title(cap: Any) -> str:
    if cap is None or cap == 0:
        return "unlimited capacity"
    if isinstance(cap, float) and cap <= 1:
        return f"capacity {cap:.0%} of the workload's tokens"
    return f"capacity {int(cap):,} tokens"


def _empty(title: str, message: str = "no rows to draw") -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    ax.set_title(title)
    return fig


# ---------------------------------------------------------------------------------------------------- figure 2


def policy_bounds(rows: Sequence[dict], eviction: str = "lru") -> list[dict]:
    """Per capacity, workload and schedule: hit rate, upper bound and Belady hit rate (the data of figure 2).

    The Belady reference is the row's own ``belady_hit_rate`` when present,
    else the hit rate of the ``belady`` row with the same workload, capacity
    and schedule; if Belady was run under fewer schedules, the others get
    None (``belady_schedule`` says which schedule the reference came from).
    """
    belady: dict[tuple, float] = {}
    for r in rows:
        if r.get("eviction_policy") == "belady" and _num(r.get("hit_rate")) is not None:
            belady[(r.get("workload"), _capacity_key(r), _schedule(r))] = float(r["hit_rate"])
    out = []
    for r in rows:
        if r.get("eviction_policy", "lru") != eviction:
            continue
        hit, ub = _num(r.get("hit_rate")), _num(r.get("upper_bound"))
        if hit is None or not ub:
            continue
        key = (r.get("workload"), _capacity_key(r), _schedule(r))
        ref = _num(r.get("belady_hit_rate"))
        if ref is None:
            ref = belady.get(key)
        out.append({"workload": key[0] or "?", "capacity": key[1], "schedule": key[2], "hit_rate": hit,
                    "upper_bound": ub, "belady_hit_rate": ref, "pct_of_upper_bound": 100 * hit / ub,
                    "belady_pct_of_upper_bound": None if ref is None else 100 * ref / ub})
    return out


def policy_bounds_summary(rows: Sequence[dict], eviction: str = "lru") -> list[dict]:
    """Mean over workloads of % of upper bound (and Belady's), per capacity and schedule: figure 2's 'mean' bars."""
    data = policy_bounds(rows, eviction)
    out = []
    for cap in _ordered(d["capacity"] for d in data):
        for sched in _ordered(d["schedule"] for d in data):
            sel = [d for d in data if d["capacity"] == cap and d["schedule"] == sched]
            if not sel:
                continue
            bel = [d["belady_pct_of_upper_bound"] for d in sel if d["belady_pct_of_upper_bound"] is not None]
            out.append({"capacity": cap, "schedule": sched, "workloads": len(sel),
                        "mean_pct_of_upper_bound": float(np.mean([d["pct_of_upper_bound"] for d in sel])),
                        "min_pct_of_upper_bound": float(np.min([d["pct_of_upper_bound"] for d in sel])),
                        "mean_belady_pct_of_upper_bound": float(np.mean(bel)) if bel else None})
    return out


def fig2_policy_bounds(rows: Sequence[dict], eviction: str = "lru",
                       paper_pct: float = SGLANG_PCT_OF_OPTIMAL) -> Figure:
    """Figure 2: hit rate as a percentage of the upper bound, per workload and scheduling policy.

    One panel per KV capacity; bars are the schedules (``eviction`` eviction,
    LRU by default), a black tick on each bar is the Belady (clairvoyant
    eviction) hit rate under the same schedule, and the ``mean`` group
    averages over workloads. What to look for: which schedules reach the
    dashed 96% line (SGLang reports cache-aware scheduling at 96% of optimal on
    average) and where Belady's tick sits below the bar (Belady knows the
    arrival order, not the order a reordering schedule serves requests in, so
    it is a bound only for first-come-first-served, one-at-a-time service).
    """
    data = policy_bounds(rows, eviction)
    if not data:
        return _empty("Figure 2: hit rate vs upper bound and Belady", f"no rows with eviction '{eviction}'")
    caps = sorted(_ordered(d["capacity"] for d in data), key=lambda c: (c is None, c or 0))
    workloads = _ordered(d["workload"] for d in data)
    schedules = _ordered(d["schedule"] for d in data)
    groups = [*workloads, "mean"]
    width = 0.8 / len(schedules)
    fig, axes = plt.subplots(len(caps), 1, figsize=(max(8.0, 1.6 * len(groups) + 2), 4.3 * len(caps)),
                             squeeze=False, sharey=True)
    for ax, cap in zip(axes[:, 0], caps, strict=True):
        at = [d for d in data if d["capacity"] == cap]
        for j, sched in enumerate(schedules):
            vals, bel = [], []
            for w in workloads:
                d = next((d for d in at if d["workload"] == w and d["schedule"] == sched), None)
                vals.append(np.nan if d is None else d["pct_of_upper_bound"])
                b = None if d is None else d["belady_pct_of_upper_bound"]
                bel.append(np.nan if b is None else b)
            vals.append(np.nanmean(vals) if not np.all(np.isnan(vals)) else np.nan)
            bel.append(np.nanmean(bel) if not np.all(np.isnan(bel)) else np.nan)
            x = np.arange(len(groups)) + (j - (len(schedules) - 1) / 2) * width
            ax.bar(x, vals, width * 0.92, color=f"C{j}",
                   label=f"{sched} (mean {vals[-1]:.1f}%)" if not np.isnan(vals[-1]) else sched)
            ax.plot(x, bel, linestyle="none", marker="D", markersize=4.5, markerfacecolor="w", markeredgewidth=1.3,
                    color="k", label="Belady eviction, same schedule" if j == 0 else None)
            for xi, v in zip(x[:-1], vals[:-1], strict=True):
                if v == 0:  # an empty bar would be invisible
                    ax.text(xi, 5, "0", ha="center", va="bottom", fontsize=7.5, color=f"C{j}")
            if not np.isnan(vals[-1]):
                ax.text(x[-1], vals[-1] / 2, f"{vals[-1]:.1f}", rotation=90, ha="center", va="center", fontsize=7.5,
                        color="w")
        ax.axhline(100, color="0.3", linewidth=1, label="upper bound (100%)")
        ax.axhline(paper_pct, color="tab:red", linestyle="--", linewidth=1.2,
                   label=f"SGLang: {paper_pct:.0f}% of optimal (mean)")
        ax.axvline(len(workloads) - 0.5, color="0.8", linewidth=0.8)
        ubs = {d["workload"]: d["upper_bound"] for d in at}
        ax.set_xticks(range(len(groups)), [f"{w}\nbound {ubs[w]:.2f}" if w in ubs else w for w in groups],
                      fontsize=8)
        ax.set_ylim(0, 115)
        ax.set_ylabel("% of upper bound")
        ax.set_title(f"{_capacity_title(cap)}, {eviction} eviction (legend: mean over workloads)", fontsize=10)
        ax.legend(fontsize=7.5, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.suptitle("Figure 2: hit rate against the upper bound and Belady, per workload and scheduling policy",
                 fontsize=11)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- figure 3


def _arm(r: dict) -> str:
    if r.get("arm"):
        return str(r["arm"])
    cache = r.get("cache", "?")
    if cache == "radix":
        return f"radix page {r.get('page_size', 1)}"
    if cache == "hash":
        return f"hash block {r.get('block_size', 16)}"
    return str(cache)


def fig3_mooncake_capacity(rows: Sequence[dict], paper_reuse: float = MOONCAKE_PAPER_REUSE) -> Figure:
    """Figure 3: hit rate against KV capacity on Mooncake's conversation trace.

    One line per cache arm; the unlimited run sits at the right edge (∞),
    the dashed black line is Belady (clairvoyant eviction, radix page 1), the
    grey dotted line the trace's upper bound and the red dash-dot line the
    Mooncake paper's ~40% prefix reuse with an unlimited cache. What to look
    for: how much KV the hit rate needs to approach the bound (steep between 2
    and 16 M tokens, flat after 32 M), the gap between LRU and Belady (memory
    a smarter eviction saves), and whether the arms differ at all (the trace
    records sharing only at 512-token granularity).
    """
    data = [r for r in rows if _num(r.get("hit_rate")) is not None and "summary" not in r]
    if not data:
        return _empty("Figure 3: Mooncake hit rate vs capacity")
    finite = sorted({float(r["capacity_tokens"]) for r in data if _num(r.get("capacity_tokens"))})
    x_inf = finite[-1] * 2.5 if finite else 1.0

    def xpos(r: dict) -> float:
        c = _num(r.get("capacity_tokens"))
        return x_inf if not c else c

    fig, ax = plt.subplots(figsize=(7, 4.3))
    markers = "osD^vP"
    for i, arm in enumerate(_ordered(_arm(r) for r in data)):
        pts = sorted((xpos(r), float(r["hit_rate"])) for r in data if _arm(r) == arm)
        ax.plot(*zip(*pts, strict=True), marker=markers[i % len(markers)], markersize=5, linewidth=1.3,
                alpha=0.85, label=arm)
    first = [r for r in data if _arm(r) == _arm(data[0])]
    ref = sorted((xpos(r), float(r["belady_hit_rate"])) for r in first if _num(r.get("belady_hit_rate")))
    if ref:
        ax.plot(*zip(*ref, strict=True), "k--", linewidth=1.3, label="Belady (radix page 1)")
    bound = _num(data[0].get("upper_bound"))
    if bound is not None:
        ax.axhline(bound, color="0.4", linestyle=":", linewidth=1.5, label=f"upper bound {bound:.1%}")
    if paper_reuse is not None:
        ax.axhline(paper_reuse, color="tab:red", linestyle="-.", linewidth=1.2,
                   label=f"Mooncake paper: ~{paper_reuse:.0%} reuse, unlimited cache")
    ax.set_xscale("log")
    ticks = [*finite, x_inf] if any(not _num(r.get("capacity_tokens")) for r in data) else finite
    ax.set_xticks(ticks, [f"{t / 1e6:g}" if t != x_inf or not finite else "∞" for t in ticks])
    ax.minorticks_off()
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, max(0.5, (bound or 0) * 1.15, paper_reuse or 0))
    ax.set_xlabel("KV cache capacity (million tokens; ∞ = unlimited)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    n = data[0].get("requests")
    subtitle = [f"{n:,} requests" if n else "", f"{data[0].get('eviction_policy', 'lru')} eviction"]
    by_cap: dict[float, list[float]] = {}
    for r in data:
        by_cap.setdefault(xpos(r), []).append(float(r["hit_rate"]))
    spread = max(max(v) - min(v) for v in by_cap.values())
    if len(_ordered(_arm(r) for r in data)) > 1 and spread < 0.02:
        subtitle.append(f"the arms overlap (within {100 * spread:.1f} points)")
    ax.set_title("Figure 3: Mooncake conversation trace, hit rate vs capacity\n"
                 + ", ".join(x for x in subtitle if x), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- figure 4


def multiturn_by_turn(rows: Sequence[dict]) -> list[dict]:
    """Mean TTFT and cached tokens per request, per (source, cache, turn); rows without a source are measured."""
    data = [r for r in rows if "summary" not in r and _num(r.get("ttft")) is not None and "turn" in r]
    out = []
    for source in _ordered(r.get("source", "measured") for r in data):
        for cache in _ordered(r.get("cache", "?") for r in data):
            sel = [r for r in data if r.get("source", "measured") == source and r.get("cache", "?") == cache]
            for t in sorted({int(r["turn"]) for r in sel}):
                at = [r for r in sel if int(r["turn"]) == t]
                ttft = np.array([float(r["ttft"]) for r in at])
                cached = [_num(r.get("cached_tokens")) for r in at]
                out.append({"source": source, "cache": cache, "turn": t + 1, "requests": len(at),
                            "ttft_mean": float(ttft.mean()), "ttft_min": float(ttft.min()),
                            "ttft_max": float(ttft.max()),
                            "cached_mean": float(np.mean([c for c in cached if c is not None]))
                            if any(c is not None for c in cached) else None})
    return out


def fig4_multiturn_ttft(rows: Sequence[dict], caches: Sequence[str] | None = None) -> Figure:
    """Figure 4: time to first token by turn index for none / hash / radix (left) and cached tokens per request (right).

    Solid lines are measured on the model, dashed ones simulated (rows without
    ``source`` count as measured); bars span the fastest to the slowest request
    of the turn. What to look for: without a cache TTFT grows with the
    history; with one it drops after turn 1, since each turn reuses the whole
    previous turn (answer included); radix caches a few tokens more per request
    than hash (no partial blocks) and the legend gives each cache's mean TTFT
    over turns 2+ relative to ``none``.
    """
    stats = multiturn_by_turn(rows)
    if not stats:
        return _empty("Figure 4: TTFT by turn")
    present = _ordered(s["cache"] for s in stats)
    caches = [c for c in (caches or sorted(present, key=lambda c: (list(CACHE_COLORS).index(c)
                                                                    if c in CACHE_COLORS else 99, c)))
              if c in present]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for source, style in (("measured", "-"), ("simulated", "--")):
        later = {c: [s["ttft_mean"] for s in stats if s["source"] == source and s["cache"] == c and s["turn"] > 1]
                 for c in caches}
        base = np.mean(later["none"]) if later.get("none") else None
        for i, cache in enumerate(caches):
            sel = [s for s in stats if s["source"] == source and s["cache"] == cache]
            if not sel:
                continue
            color = CACHE_COLORS.get(cache, f"C{i + 3}")
            label = f"{cache} ({source})"
            if base and later[cache] and cache != "none":
                label += f", turns 2+: {np.mean(later[cache]) / base:.2f}x none"
            t = np.array([s["turn"] for s in sel])
            y = np.array([s["ttft_mean"] for s in sel])
            err = np.array([[s["ttft_mean"] - s["ttft_min"] for s in sel],
                            [s["ttft_max"] - s["ttft_mean"] for s in sel]])
            offset = (i - (len(caches) - 1) / 2) * 0.04
            ax.errorbar(t + offset, y, yerr=err, fmt=style, marker="o", color=color, capsize=3, label=label,
                        alpha=1.0 if source == "measured" else 0.7)
            cached = [(s["turn"], s["cached_mean"]) for s in sel if s["cached_mean"] is not None]
            if cached:
                ax2.plot(*zip(*cached, strict=True), style, marker="o", color=color, label=f"{cache} ({source})",
                         alpha=1.0 if source == "measured" else 0.7)
    turns = sorted({s["turn"] for s in stats})
    for a in (ax, ax2):
        a.set_xticks(turns)
        a.set_xlabel("turn")
        a.grid(alpha=0.3)
    ax.set_ylabel("TTFT (s): mean, min-max bars")
    ax.set_ylim(bottom=0)
    ax.set_title("time to first token by turn", fontsize=10)
    ax.legend(fontsize=7.5)
    ax2.set_ylabel("cached prompt tokens per request (mean)")
    ax2.set_title("prefix reused per request", fontsize=10)
    ax2.legend(fontsize=7.5)
    a = next((r.get("args") for r in rows if isinstance(r.get("args"), dict)), None) or {}
    shape = (f": {a.get('model')}, {a.get('sessions')} sessions x {a.get('turns')} turns, "
             f"{a.get('system_tokens')}-token system prompt" if a.get("model") else "")
    fig.suptitle(f"Figure 4: multi-turn chat, none / hash / radix prefix caching{shape}", fontsize=11)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- figure 5


def _granularity(r: dict) -> int | None:
    g = _num(r.get("granularity"))
    if g is None:
        g = _num(r.get("page_size") if r.get("cache") == "radix" else r.get("block_size"))
    return None if g is None else int(g)


def _fig5_panel(ax: Any, sel: list[dict], workload: str, cap: Any) -> None:
    """One panel of figure 5: the rows ``sel`` of one workload at one capacity, each arm by block size."""
    styles = {"radix": dict(color=CACHE_COLORS["radix"], marker="o", linestyle="-", markersize=7),
              "hash": dict(color=CACHE_COLORS["hash"], marker="s", linestyle="--", markersize=9,
                           markerfacecolor="none", markeredgewidth=1.5),
              "hash-v0": dict(color=CACHE_COLORS["hash-v0"], marker="x", linestyle=":", markersize=8)}
    blocks: set[int] = set()
    for arm, style in styles.items():
        pts = sorted((_granularity(r), float(r["hit_rate"])) for r in sel
                     if r["arm"] == arm and _granularity(r))
        if pts:
            blocks |= {b for b, _ in pts}
            label = f"{arm}, page size B" if arm == "radix" else f"{arm}, block size B"
            ax.plot(*zip(*pts, strict=True), label=label, **style)
    ref = next((float(r["hit_rate"]) for r in sel if r["arm"] == "radix page 1"), None)
    if ref is None:
        ref = next((float(r["hit_rate"]) for r in sel if r["arm"] == "radix" and _granularity(r) == 1), None)
    ub = next((_num(r.get("upper_bound")) for r in sel if _num(r.get("upper_bound")) is not None), None)
    at_bound = ub is not None and ref is not None and abs(ub - ref) < 5e-4
    if ref is not None:
        ax.axhline(ref, color="k", linestyle=":", linewidth=1.2,
                   label=f"radix page 1{' = upper bound' if at_bound else ''}: {ref:.3f}")
    if ub is not None and not at_bound:
        ax.axhline(ub, color="0.6", linewidth=1, label=f"upper bound (page 1): {ub:.3f}")
    ax.set_xscale("log", base=2)
    if blocks:
        ax.set_xticks(sorted(blocks), [str(b) for b in sorted(blocks)])
    ax.minorticks_off()
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("hit rate (prompt tokens)")
    evicted = [r.get("evicted_tokens") for r in sel if r.get("evicted_tokens") is not None]
    note = "" if not evicted else (", nothing evicted" if max(evicted) == 0 else ", evicting")
    tokens = next((_num(r.get("capacity_tokens")) for r in sel if _num(r.get("capacity_tokens"))), None)
    size = f" = {int(tokens):,} tokens" if tokens and "token" in str(cap) else ""
    ax.set_title(f"{workload}: {cap}{size}{note}", fontsize=9.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower left")


def fig5_block_size(rows: Sequence[dict]) -> Figure:
    """Figure 5: radix (page size = B) against hash (block size = B) hit rate as B grows.

    One panel per workload (columns) and capacity (rows). The dotted line is
    radix at page 1, the token-granular reference; the grey line the
    workload's upper bound at page 1. What to look for: at a given granularity
    the tree and the hash chain reuse exactly the same whole blocks when
    nothing is evicted (the lines coincide); what a larger block costs is the
    distance down from the page-1 line (each request loses its partial last
    block of every shared prefix). Under eviction the two differ in what they
    evict (a whole leaf against one block, tail first), which can go either way.
    """
    data = [r for r in rows if _num(r.get("hit_rate")) is not None and r.get("arm")]
    if not data:
        return _empty("Figure 5: radix vs hash by block size")
    workloads = _ordered(r.get("workload", "?") for r in data)
    caps = _ordered(r.get("capacity_label", _capacity_title(r.get("capacity_tokens"))) for r in data)
    fig, axes = plt.subplots(len(caps), len(workloads), figsize=(5.2 * len(workloads), 3.5 * len(caps)),
                             squeeze=False, sharey="col")
    for i, cap in enumerate(caps):
        for j, w in enumerate(workloads):
            sel = [r for r in data if r.get("workload", "?") == w
                   and r.get("capacity_label", _capacity_title(r.get("capacity_tokens"))) == cap]
            _fig5_panel(axes[i, j], sel, w, cap)
    fig.suptitle("Figure 5: radix vs hash hit rate as the block size grows", fontsize=11)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- figure 6


def ablation_grid(rows: Sequence[dict], value: str = "pct_of_upper_bound") -> dict[Any, tuple[list, list, np.ndarray]]:
    """Per capacity: (evictions, schedules, mean over workloads of ``value``) with NaN where a cell is missing."""
    data = [r for r in rows if _num(r.get(value)) is not None and r.get("eviction_policy")]
    out = {}
    for cap in sorted(_ordered(_capacity_key(r) for r in data), key=lambda c: (c is None, c or 0)):
        at = [r for r in data if _capacity_key(r) == cap]
        evictions = _ordered(r["eviction_policy"] for r in at)
        schedules = _ordered(_schedule(r) for r in at)
        grid = np.full((len(evictions), len(schedules)), np.nan)
        for a, e in enumerate(evictions):
            for b, s in enumerate(schedules):
                vals = [float(r[value]) for r in at if r["eviction_policy"] == e and _schedule(r) == s]
                if vals:
                    grid[a, b] = np.mean(vals)
        out[cap] = (evictions, schedules, grid)
    return out


def fig6_ablation(rows: Sequence[dict], value: str = "pct_of_upper_bound") -> Figure:
    """Figure 6: eviction policy x scheduling policy, mean % of upper bound over the workloads, one map per capacity.

    What to look for: the scheduling order moves the hit rate far more than
    the eviction policy (columns differ, rows within a column barely do);
    ``lpm`` with in-batch prefix sharing is the column nearest 100% (SGLang:
    96% of optimal on average); ``belady`` (clairvoyant in arrival order) is
    no better than LRU once the order is cache-aware.
    """
    grids = ablation_grid(rows, value)
    if not grids:
        return _empty("Figure 6: eviction x scheduling ablation", f"no rows with '{value}'")
    n = len(grids)
    ncols = max(len(s) for _, s, _ in grids.values())
    fig, axes = plt.subplots(1, n, figsize=(1.15 * ncols * n + 1.5, 4.2), squeeze=False)
    vmax = 100 if value.startswith("pct") else None
    image = None
    for ax, (cap, (evictions, schedules, grid)) in zip(axes[0], grids.items(), strict=True):
        image = ax.imshow(grid, vmin=0, vmax=vmax or np.nanmax(grid), cmap="viridis", aspect="auto")
        best = np.nanmax(grid)
        for (a, b), v in np.ndenumerate(grid):
            if np.isnan(v):
                continue
            ax.text(b, a, f"{v:.1f}", ha="center", va="center", fontsize=8.5,
                    color="w" if v < 0.6 * (vmax or best) else "k", fontweight="bold" if v == best else None)
        ax.set_xticks(range(len(schedules)), schedules, rotation=25, ha="right", fontsize=8)
        ax.set_yticks(range(len(evictions)), evictions, fontsize=8.5)
        ax.set_xlabel("scheduling policy")
        if ax is axes[0, 0]:
            ax.set_ylabel("eviction policy")
        ax.set_title(_capacity_title(cap), fontsize=9.5)
    label = "% of upper bound (mean over workloads)" if value == "pct_of_upper_bound" else value
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.85, label=label)
    nw = len(_ordered(r.get("workload") for r in rows if r.get("workload")))
    fig.suptitle(f"Figure 6: eviction x scheduling ablation, radix cache ({nw} workloads; bold = best cell)",
                 fontsize=11)
    return fig
