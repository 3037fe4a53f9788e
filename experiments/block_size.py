"""Radix (page size B) against hash (block size B) hit rate as the block size B grows.

``python -m experiments.block_size`` (seconds) runs the multi-turn and
shared-prefix workloads through the simulator with the radix tree at page
size B and the hash-block caches (v1 and v0) at block size B, for B in 1, 4, 16, 64, 256,
next to radix at page 1 (the token-granular reference) and the upper bound at
page 1 and at B. Each goes through the same requests, schedule and KV budget:
unlimited, and a limited one (by default 50% of the workload's distinct
tokens, i.e. of what an unlimited cache holds at the end; 50% of *all* tokens
would evict nothing on these workloads). Writes ``results/block_size.jsonl``
(one row per run, with its full config) and ``.png`` (figure 5).
``--max-batch-tokens`` and ``--chunked-prefill-size`` schedule each step as
the engine does (its defaults are 4,096 and 1,024); without them every
admitted prompt is prefilled whole in one step.

What to look for: with nothing evicted, the tree and the hash chain reuse
exactly the same whole blocks at equal granularity, so radix == hash at every
B; what a coarse block costs is the distance from the page-1 line (the
partial last block of every shared prefix is recomputed). The shared-prefix
system prompts are drawn between 1,024 and 3,072 tokens: the published shape's
fixed 2,048 is a multiple of every B tried and would hide that cost.
"""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

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
from experiments.plots import fig5_block_size  # noqa: E402
from radixkv import workloads  # noqa: E402
from radixkv.cache.radix import RadixCache  # noqa: E402
from radixkv.sim import simulate, upper_bound  # noqa: E402

SIZES = {  # workload -> make() sizes; the request counts of experiments.ablation
    "multi_turn": dict(sessions=20, turns=4),
    "shared_prefix": dict(groups=16, prompts_per_group=16, system_tokens=(1024, 3072)),
}
SCALED = {"multi_turn": "sessions", "shared_prefix": "groups"}  # the size --scale multiplies


def sizes(name: str, scale: float) -> dict:
    """``SIZES[name]`` with its request count multiplied by ``scale`` (at least one session / group)."""
    out = dict(SIZES[name])
    key = SCALED[name]
    out[key] = max(1, round(out[key] * scale))
    return out


def distinct_tokens(requests) -> int:
    """Tokens an unlimited page-1 cache holds after the workload: every distinct prompt + output[:-1] prefix."""
    tree = RadixCache(page_size=1)
    slot, fresh = 0, 0
    for r in requests:
        seq = r.prompt if r.output is None else np.concatenate([r.prompt, r.output[:-1]])
        tree.insert(seq, np.arange(slot, slot + len(seq)), r.namespace)
        slot += len(seq)
        if r.output is None:  # the simulator generates fresh ids nobody shares
            fresh += r.output_len - 1
    return tree.total_size + fresh


def run(name: str, block_sizes: list[int], fracs: list[float], args) -> list[dict]:
    """Every (capacity, B, cache) of one workload, plus radix at page 1 per capacity; rows with full config."""
    sz = sizes(name, args.scale)
    reqs = workloads.make(name, seed=args.seed, **sz)
    total = sum(r.prompt_len + r.output_len for r in reqs)
    distinct = distinct_tokens(reqs)
    longest = max(r.prompt_len + r.output_len for r in reqs)
    ub1 = upper_bound(reqs, page_size=1)
    ubs = {b: upper_bound(reqs, page_size=b) for b in block_sizes}
    base = distinct if args.capacity_of == "distinct" else total
    common = dict(eviction_policy=args.eviction_policy, schedule_policy=args.schedule_policy,
                  max_running=args.max_running, seed=args.seed, in_batch_sharing=args.in_batch_sharing or None,
                  **budgets(args))
    rows = []
    for frac in fracs:
        cap = None if frac == 0 else max(int(base * frac), longest)
        label = "unlimited" if cap is None else f"{frac:.0%} of {args.capacity_of} tokens"
        ctx = {"workload": name, "sizes": sz, "capacity_label": label, "capacity_frac": frac,
               "capacity_of": args.capacity_of, "total_tokens": total, "distinct_tokens": distinct,
               "upper_bound": ub1}
        arms = [("radix page 1", "radix", 1)] + [(c, c, b) for b in block_sizes for c in ("radix", "hash", "hash-v0")]
        results: dict[tuple[str, int], dict] = {}
        for arm, cache, b in arms:
            t0 = time.perf_counter()
            if (cache, b) not in results:  # radix at B = 1 is the reference run itself
                res = simulate(reqs, cache, capacity_tokens=cap, page_size=b, block_size=b, **common)
                results[(cache, b)] = {**res.config, **res.summary(), "seconds": time.perf_counter() - t0}
            summary = results[(cache, b)]
            ub_b = ub1 if b == 1 else ubs.get(b, ub1)
            rows.append({**ctx, "arm": arm, "granularity": b, **summary, "upper_bound_at_block": ub_b,
                         "pct_of_upper_bound": 100 * summary["hit_rate"] / ub1 if ub1 else 0.0})
    for r in rows:
        r["env"], r["args"] = environment(), vars(args)
    return rows


def comparison(rows: list[dict]) -> list[dict]:
    """One line per (workload, capacity, B): radix, hash, their difference and the page-1 reference."""
    out = []
    for r in rows:
        if r["arm"] != "radix":
            continue
        key = (r["workload"], r["capacity_label"])
        h, v0 = (next(x for x in rows if (x["workload"], x["capacity_label"]) == key and x["arm"] == arm
                      and x["granularity"] == r["granularity"]) for arm in ("hash", "hash-v0"))
        ref = next(x for x in rows if (x["workload"], x["capacity_label"]) == key and x["arm"] == "radix page 1")
        out.append({"workload": r["workload"], "capacity": r["capacity_label"], "capacity_tokens": r["capacity_tokens"],
                    "B": r["granularity"], "radix": r["hit_rate"], "hash": h["hit_rate"], "hash-v0": v0["hit_rate"],
                    "radix-hash": r["hit_rate"] - h["hit_rate"], "radix_page1": ref["hit_rate"],
                    "upper_bound_B": r["upper_bound_at_block"], "evicted_radix": r["evicted_tokens"],
                    "evicted_hash": h["evicted_tokens"], "evicted_hash_v0": v0["evicted_tokens"]})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/block_size")
    p.add_argument("--workloads", default=",".join(SIZES), help=f"comma-separated subset of {list(SIZES)}")
    p.add_argument("--block-sizes", default="1,4,16,64,256", help="radix page sizes = hash block sizes")
    p.add_argument("--capacity-fracs", default="0,0.5",
                   help="KV budgets as fractions (see --capacity-of); 0 = unlimited")
    p.add_argument("--capacity-of", default="distinct", choices=["distinct", "total"],
                   help="fractions of the workload's distinct tokens (an unlimited cache's final size) or all tokens")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the sessions / groups (small runs: 0.1)")
    add_settings(p, "eviction_policy", "schedule_policy", "in_batch_sharing", "max_running", max_running=32)
    p.add_argument("--no-plot", action="store_true", help="write the .jsonl only")
    add_budget_flags(p)
    args = p.parse_args(argv)
    check_budgets(p, args)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    fracs = fractions_from(args.capacity_fracs, "--capacity-fracs")
    if args.scale <= 0:
        p.error("--scale must be > 0")
    t0 = time.perf_counter()
    rows = [row for name in names_from(args.workloads, SIZES, "--workloads") for row in run(name, blocks, fracs, args)]
    print(table(comparison(rows), ["workload", "capacity", "capacity_tokens", "B", "radix", "hash", "hash-v0",
                                   "radix-hash", "radix_page1", "upper_bound_B", "evicted_radix", "evicted_hash",
                                   "evicted_hash_v0"],
                {"radix": ".4f", "hash": ".4f", "hash-v0": ".4f", "radix-hash": "+.4f", "radix_page1": ".4f",
                 "upper_bound_B": ".4f",
                 "capacity_tokens": ",", "evicted_radix": ",", "evicted_hash": ",",
                 "evicted_hash_v0": ","}))
    written = [write_rows(args.out, rows)]
    if not args.no_plot:
        fig = fig5_block_size(rows)
        written.append(save_figure(fig, args.out))
        plt.close(fig)
    print(f"{time.perf_counter() - t0:.1f} s; wrote", *written)
    return rows


if __name__ == "__main__":
    run_cli(main)
