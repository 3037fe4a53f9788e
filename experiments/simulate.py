"""One workload through caches x capacities x policies in the simulator.

``python -m experiments.simulate --workload shared_prefix --caches radix,hash,none``
prints a table of hit rates next to the upper bound (and Belady's bound at
each capacity), writes ``results/simulate-<workload>.jsonl`` with every
run's full config and ``.png`` with hit rate against capacity.
``--max-batch-tokens`` and ``--chunked-prefill-size`` schedule each step as
the engine does (its defaults are 4,096 and 1,024); without them every
admitted prompt is prefilled whole in one step.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.common import (  # noqa: E402
    add_budget_flags,
    add_settings,
    budgets,
    check_budgets,
    environment,
    fractions_from,
    parser,
    run_cli,
    save_figure,
    table,
    write_rows,
)
from radixkv import workloads  # noqa: E402
from radixkv.cache import CACHES  # noqa: E402
from radixkv.cache.eviction import POLICIES  # noqa: E402
from radixkv.scheduling import POLICIES as SCHEDULE_POLICIES  # noqa: E402
from radixkv.sim import simulate, upper_bound  # noqa: E402


def capacities(requests, fractions: list[float]) -> list[int | None]:
    """KV budgets as fractions of the workload's total tokens (prompt + output); 0 means unlimited."""
    total = sum(r.prompt_len + r.output_len for r in requests)
    longest = max(r.prompt_len + r.output_len for r in requests)
    return [None if f == 0 else max(int(total * f), longest) for f in fractions]


def run_grid(requests, caches, caps, evictions, schedules, args) -> list[dict]:
    """Every combination, plus Belady at each capacity and schedule; rows carry their full config.

    Each row's upper bound is at its cache's granularity (the hash cache's
    block, else the page), and its Belady reference ran under its own
    schedule with the same seed: a reference from another schedule can be
    far off (lpm against fcfs on multi_turn: 0.43 against 0.02).
    """
    bounds: dict[int, float] = {}
    jobs = [(c, cap, e, s) for c in caches for cap in caps for e in evictions for s in schedules]
    rows, belady = [], {}
    for cache, cap, ev, sched in tqdm(jobs, desc="simulate", unit="run"):
        common = dict(capacity_tokens=cap, page_size=args.page_size, schedule_policy=sched,
                      max_running=args.max_running, seed=args.seed, in_batch_sharing=args.in_batch_sharing,
                      **budgets(args))
        res = simulate(requests, cache=cache, block_size=args.block_size, eviction_policy=ev, **common)
        if (cap, sched) not in belady:
            belady[cap, sched] = simulate(requests, cache="radix", eviction_policy="belady", **common).hit_rate
        granularity = args.block_size if cache in ("hash", "hash-v0") else args.page_size
        if granularity not in bounds:
            bounds[granularity] = upper_bound(requests, page_size=granularity)
        ub, bel = bounds[granularity], belady[cap, sched]
        row = {"workload": args.workload, **res.config, **res.summary(), "upper_bound": ub, "belady_hit_rate": bel}
        row["pct_of_upper_bound"] = 100 * res.hit_rate / ub if ub else 0.0
        row["pct_of_belady"] = 100 * res.hit_rate / bel if bel else 0.0
        rows.append(row)
    return rows


def plot(rows: list[dict], title: str):
    fig, ax = plt.subplots(figsize=(6, 4))
    finite = [r for r in rows if r["capacity_tokens"] is not None]
    for key in sorted({(r["cache"], r["eviction_policy"], r["schedule_policy"]) for r in finite}):
        pts = sorted((r["capacity_tokens"], r["hit_rate"]) for r in finite
                     if (r["cache"], r["eviction_policy"], r["schedule_policy"]) == key)
        ax.plot(*zip(*pts, strict=True), marker="o", label="/".join(key))
    if finite:
        caps = sorted({r["capacity_tokens"] for r in finite})
        for sched in sorted({r["schedule_policy"] for r in finite}):
            ax.plot(caps, [next(r["belady_hit_rate"] for r in finite if r["capacity_tokens"] == c
                                and r["schedule_policy"] == sched) for c in caps],
                    "k--", label=f"belady (radix, {sched})")
        ax.axhline(max(r["upper_bound"] for r in rows), color="grey", linestyle=":", label="upper bound")
        ax.legend(fontsize=7)
    else:  # only unlimited capacity: nothing to draw against capacity
        ax.text(0.5, 0.5, "unlimited capacity only: see the table", ha="center", transform=ax.transAxes)
    ax.set_xlabel("KV capacity (tokens)")
    ax.set_ylabel("hit rate (prompt tokens)")
    ax.set_title(title)
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/simulate")
    p.add_argument("--workload", default="shared_prefix", choices=sorted(workloads.WORKLOADS),
                   help="the synthetic workload")
    p.add_argument("--caches", default="radix,hash,none", help=f"comma-separated subset of {list(CACHES)}")
    p.add_argument("--capacity-fracs", default="0.05,0.1,0.2,0.4,0",
                   help="KV budgets as fractions of all tokens of the workload; 0 = unlimited")
    p.add_argument("--eviction-policies", default="lru", help=f"comma-separated subset of {sorted(POLICIES)}")
    p.add_argument("--schedule-policies", default="lpm", help=f"comma-separated subset of {list(SCHEDULE_POLICIES)}")
    add_settings(p, "page_size", "block_size", "max_running", "in_batch_sharing", in_batch_sharing=None)
    add_budget_flags(p)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the workload's request count")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale must be > 0")
    check_budgets(p, args)
    sizes = _scaled_sizes(args.workload, args.scale)
    requests = workloads.make(args.workload, seed=args.seed, **sizes)
    caps = capacities(requests, fractions_from(args.capacity_fracs, "--capacity-fracs"))
    rows = run_grid(requests, args.caches.split(","), caps, args.eviction_policies.split(","),
                    args.schedule_policies.split(","), args)
    for r in rows:
        r["env"], r["args"] = environment(), vars(args)
    out = args.out if args.out != "results/simulate" else f"results/simulate-{args.workload}"
    print(table(rows, ["cache", "capacity_tokens", "eviction_policy", "schedule_policy", "hit_rate",
                       "upper_bound", "belady_hit_rate", "pct_of_upper_bound", "pct_of_belady", "ttft_mean"],
                {"hit_rate": ".3f", "upper_bound": ".3f", "belady_hit_rate": ".3f", "pct_of_upper_bound": ".1f",
                 "pct_of_belady": ".1f", "ttft_mean": ".3f"}))
    print("wrote", write_rows(out, rows), save_figure(plot(rows, args.workload), out))
    return rows


def _scaled_sizes(workload: str, scale: float) -> dict:
    """Size overrides that multiply a workload's number of requests by ``scale``."""
    if scale == 1.0:
        return {}
    key = {"multi_turn": "sessions", "shared_prefix": "groups", "few_shot": "subjects", "tree_of_thought": "trees",
           "self_consistency": "questions", "no_sharing": "requests"}[workload]
    base = {"multi_turn": 20, "shared_prefix": 64, "few_shot": 16, "tree_of_thought": 8, "self_consistency": 16,
            "no_sharing": 256}[workload]
    return {key: max(1, round(base * scale))}


if __name__ == "__main__":
    run_cli(main)
