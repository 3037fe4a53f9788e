"""Hit rate against cache capacity on Mooncake's conversation trace.

``python -m experiments.mooncake --trace ../shared/traces/conversation_trace.jsonl``
replays the trace (real tokens: 512 per block id) through radix (page 1 and
512) and hash (block 16 and 512) caches (``--arms`` adds vLLM v0's ``hash-v0``) at several capacities, next to the
upper bound (the trace's own bound from ``hash_ids``), and writes
``results/mooncake.jsonl`` and ``.png``. The Mooncake paper reports about 40%
prefix reuse with an unlimited cache on this workload.
``--max-batch-tokens`` and ``--chunked-prefill-size`` schedule each step as
the engine does (its defaults are 4,096 and 1,024); without them every
admitted prompt is prefilled whole in one step.
"""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from experiments.common import (  # noqa: E402
    DEFAULT_TRACE,
    add_budget_flags,
    add_settings,
    budgets,
    check_budgets,
    environment,
    fractions_from,
    log_capacity_axis,
    names_from,
    parser,
    run_cli,
    save_figure,
    table,
    write_rows,
)
from radixkv.sim import simulate  # noqa: E402
from radixkv.workloads.mooncake import read_trace, trace_requests, trace_upper_bound  # noqa: E402

ARMS = {  # name -> simulate() arguments
    "radix page 1": dict(cache="radix", page_size=1),
    "radix page 512": dict(cache="radix", page_size=512),
    "hash block 16": dict(cache="hash", block_size=16),
    "hash block 512": dict(cache="hash", block_size=512),
    # vLLM v0's whole-prefix hashes: O(L^2 / block) hashing per lookup, so off by default (block 512: ~7 min
    # per capacity here; block 16: ~110x v1's time, hours for the whole trace)
    "hash-v0 block 512": dict(cache="hash-v0", block_size=512),
    "hash-v0 block 16": dict(cache="hash-v0", block_size=16),
}
DEFAULT_ARMS = ("radix page 1", "radix page 512", "hash block 16", "hash block 512")
REFERENCE_ARM = "radix page 1"  # the cache the Belady reference runs: at unlimited capacity, this arm's replay


def plot(rows: list[dict], bound: float):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pts = sorted((r["capacity_tokens"] / 1e6, r["hit_rate"]) for r in rows
                     if r["arm"] == arm and r["capacity_tokens"] is not None)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=arm)
    first = [r for r in rows if r["arm"] == rows[0]["arm"] and r["capacity_tokens"] is not None]
    ref = sorted((r["capacity_tokens"] / 1e6, r["belady_hit_rate"]) for r in first if r["belady_hit_rate"])
    if ref:
        ax.plot(*zip(*ref, strict=True), "k--", label="belady (radix page 1)")
    ax.axhline(bound, color="grey", linestyle=":", label=f"upper bound {bound:.1%}")
    log_capacity_axis(ax, (r["capacity_tokens"] / 1e6 for r in rows if r["capacity_tokens"] is not None),
                      "KV cache capacity (million tokens)")
    ax.set_ylabel("prefix hit rate (prompt tokens)")
    ax.set_title("Mooncake conversation trace: hit rate vs capacity")
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/mooncake")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--capacities", default="2e6,4e6,8e6,16e6,32e6,0",
                   help="KV budgets in tokens; 0 = unlimited")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {list(ARMS)}")
    add_settings(p, "max_running")
    p.add_argument("--no-belady", action="store_true", help="skip the clairvoyant (Belady) reference runs")
    add_budget_flags(p)
    args = p.parse_args(argv)
    check_budgets(p, args)
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    arms = names_from(args.arms, ARMS, "--arms")
    records = read_trace(args.trace, args.limit)  # read and checked once, for the replay and its bound
    requests = trace_requests(records)
    bound = trace_upper_bound(records)
    caps = [None if c == 0 else int(c) for c in fractions_from(args.capacities, "--capacities")]
    belady = {}
    if not args.no_belady:  # the clairvoyant reference at each capacity (radix, page 1, the arms' seed)
        # unlimited: nothing is evicted, so the reference is a plain replay, the "radix page 1" arm's own if it runs
        refs = [c for c in caps if c is not None or REFERENCE_ARM not in arms]
        for cap in tqdm(refs, desc="belady", leave=False):
            belady[cap] = simulate(requests, capacity_tokens=cap, max_running=args.max_running, seed=args.seed,
                                   eviction_policy="belady" if cap is not None else "lru", **budgets(args)).hit_rate
    rows, ub = [], bound["hit_rate"]
    for arm in tqdm(arms, desc="arms"):
        for cap in tqdm(caps, desc=arm, leave=False):
            t0 = time.perf_counter()
            res = simulate(requests, capacity_tokens=cap, max_running=args.max_running, seed=args.seed,
                           **budgets(args), **ARMS[arm])
            if cap is None and arm == REFERENCE_ARM and not args.no_belady:
                belady[None] = res.hit_rate
            rows.append({"arm": arm, **res.config, **res.summary(), "upper_bound": ub,
                         "pct_of_upper_bound": 100 * res.hit_rate / ub if ub else None,
                         "replay_seconds": time.perf_counter() - t0, "trace": args.trace, "limit": args.limit,
                         "env": environment(), "args": vars(args)})
    for r in rows:  # after the arms: the unlimited reference may be one of them
        ref = belady.get(r["capacity_tokens"])
        r.update(belady_hit_rate=ref, pct_of_belady=100 * r["hit_rate"] / ref if ref else None)
    print(f"trace: {len(requests)} requests, {bound['prompt_tokens']:,} prompt tokens, "
          f"upper bound {bound['hit_rate']:.1%} (paper: about 40%)")
    print(table(rows, ["arm", "capacity_tokens", "hit_rate", "pct_of_upper_bound", "belady_hit_rate",
                       "pct_of_belady", "evicted_tokens", "rejected", "replay_seconds"],
                {"hit_rate": ".3f", "pct_of_upper_bound": ".1f", "belady_hit_rate": ".3f", "pct_of_belady": ".1f",
                 "replay_seconds": ".1f", "evicted_tokens": ","}))
    print("wrote", write_rows(args.out, rows), save_figure(plot(rows, bound["hit_rate"]), args.out))
    return rows


if __name__ == "__main__":
    run_cli(main)
