"""Eviction policy x scheduling policy x capacity on the synthetic workloads.

``python -m experiments.ablation`` runs every workload through the radix
cache under each eviction policy (lru, lfu, fifo, mru, filo and the
clairvoyant belady) and each scheduling policy (fcfs, lpm, dfs-weight, random,
and lpm with in-batch prefix sharing) at several KV capacities, and prints hit
rate and its percentage of the workload's upper bound. SGLang reports its
cache-aware scheduling at 96% of the optimal hit rate on average over its
workloads. Writes ``results/ablation.jsonl`` and a ``.png`` heat map.
``--max-batch-tokens`` and ``--chunked-prefill-size`` schedule each step as
the engine does (its defaults are 4,096 and 1,024); without them every
admitted prompt is prefilled whole in one step.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.common import (  # noqa: E402
    add_budget_flags,
    add_settings,
    budgets,
    check_budgets,
    environment,
    fractions_from,
    names_from,
    parser,
    run_cli,
    save_figure,
    table,
    write_rows,
)
from radixkv import workloads  # noqa: E402
from radixkv.sim import simulate, upper_bound  # noqa: E402

SCHEDULES = {  # label -> simulate() arguments
    "fcfs": dict(schedule_policy="fcfs"),
    "lpm": dict(schedule_policy="lpm"),
    "dfs-weight": dict(schedule_policy="dfs-weight"),
    "random": dict(schedule_policy="random"),
    "lpm+in-batch": dict(schedule_policy="lpm", in_batch_sharing=32),
}
EVICTIONS = ("lru", "lfu", "fifo", "mru", "filo", "belady")
# Sizes that keep every workload at a few hundred requests, so the grid runs in minutes.
SIZES = {
    "multi_turn": dict(sessions=20, turns=4),
    "shared_prefix": dict(groups=16, prompts_per_group=16),
    "few_shot": dict(subjects=8, questions_per_subject=16),
    "tree_of_thought": dict(trees=4),
    "self_consistency": dict(questions=16, samples=8),
}


def run(names: list[str], fractions: list[float], evictions: list[str], schedules: list[str], args) -> list[dict]:
    rows = []
    jobs = [(w, f, e, s) for w in names for f in fractions for e in evictions for s in schedules]
    cache: dict[str, tuple] = {}
    for name, frac, ev, sched in tqdm(jobs, desc="ablation", unit="run"):
        if name not in cache:
            reqs = workloads.make(name, seed=args.seed, **SIZES[name])
            cache[name] = (reqs, upper_bound(reqs), sum(r.prompt_len + r.output_len for r in reqs))
        reqs, ub, total = cache[name]
        longest = max(r.prompt_len + r.output_len for r in reqs)
        cap = max(int(total * frac), longest)
        res = simulate(reqs, cache="radix", capacity_tokens=cap, eviction_policy=ev, seed=args.seed,
                       max_running=args.max_running, **budgets(args), **SCHEDULES[sched])
        rows.append({"workload": name, "capacity_frac": frac, "schedule": sched, **res.config, **res.summary(),
                     "upper_bound": ub, "pct_of_upper_bound": 100 * res.hit_rate / ub if ub else 0.0,
                     "sizes": SIZES[name], "env": environment(), "args": vars(args)})
    return rows


def add_belady_share(rows: list[dict]) -> None:
    """Each row's hit rate as a percentage of Belady's at the same workload, capacity and schedule."""
    belady = {(r["workload"], r["capacity_frac"], r["schedule"]): r["hit_rate"]
              for r in rows if r["eviction_policy"] == "belady"}
    for r in rows:
        ref = belady.get((r["workload"], r["capacity_frac"], r["schedule"]))
        r["belady_hit_rate"] = ref
        r["pct_of_belady"] = 100 * r["hit_rate"] / ref if ref else None


def summarize(rows: list[dict]) -> list[dict]:
    """Mean % of upper bound over workloads, per (capacity, eviction, schedule)."""
    keys = sorted({(r["capacity_frac"], r["eviction_policy"], r["schedule"]) for r in rows})
    out = []
    for frac, ev, sched in keys:
        sel = [r for r in rows if (r["capacity_frac"], r["eviction_policy"], r["schedule"]) == (frac, ev, sched)]
        out.append({"capacity_frac": frac, "eviction": ev, "schedule": sched,
                    "mean_hit_rate": float(np.mean([r["hit_rate"] for r in sel])),
                    "mean_pct_of_upper_bound": float(np.mean([r["pct_of_upper_bound"] for r in sel])),
                    "mean_pct_of_belady": _mean_or_none([r["pct_of_belady"] for r in sel])})
    return out


def _mean_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def plot(summary: list[dict], evictions: list[str], schedules: list[str]):
    fracs = sorted({s["capacity_frac"] for s in summary})
    fig, axes = plt.subplots(1, len(fracs), figsize=(4.5 * len(fracs), 3.6), squeeze=False)
    for ax, frac in zip(axes[0], fracs, strict=True):
        grid = np.array([[next(s["mean_pct_of_upper_bound"] for s in summary if s["capacity_frac"] == frac
                               and s["eviction"] == e and s["schedule"] == sc) for sc in schedules] for e in evictions])
        ax.imshow(grid, vmin=0, vmax=100, cmap="viridis")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="w" if v < 60 else "k", fontsize=8)
        ax.set_xticks(range(len(schedules)), schedules, rotation=30, fontsize=7)
        ax.set_yticks(range(len(evictions)), evictions, fontsize=8)
        ax.set_title(f"capacity {frac:.0%} of tokens: % of upper bound", fontsize=9)
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/ablation")
    p.add_argument("--workloads", default=",".join(SIZES), help=f"comma-separated subset of {list(SIZES)}")
    p.add_argument("--capacity-fracs", default="0.05,0.2",
                   help="KV budgets as fractions of all tokens (at least the longest request: 0 is that minimum)")
    p.add_argument("--evictions", default=",".join(EVICTIONS), help=f"eviction policies, a subset of {list(EVICTIONS)}")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help=f"scheduling policies, a subset of {list(SCHEDULES)}")
    add_settings(p, "max_running", max_running=32)
    add_budget_flags(p)
    args = p.parse_args(argv)
    check_budgets(p, args)
    evictions = names_from(args.evictions, EVICTIONS, "--evictions")
    schedules = names_from(args.schedules, SCHEDULES, "--schedules")
    fracs = fractions_from(args.capacity_fracs, "--capacity-fracs")
    rows = run(names_from(args.workloads, SIZES, "--workloads"), fracs, evictions, schedules, args)
    add_belady_share(rows)
    summary = summarize(rows)
    print(table(summary, ["capacity_frac", "eviction", "schedule", "mean_hit_rate", "mean_pct_of_upper_bound",
                          "mean_pct_of_belady"],
                {"mean_hit_rate": ".3f", "mean_pct_of_upper_bound": ".1f", "mean_pct_of_belady": ".1f"}))
    print("wrote", write_rows(args.out, rows), save_figure(plot(summary, evictions, schedules), args.out))
    return rows


if __name__ == "__main__":
    run_cli(main)
