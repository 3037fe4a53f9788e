"""How fast the simulator replays the whole agentic trace, and in how much memory.

``python -m experiments.bench_agentic --out docs/figures/agentic/bench`` replays every request of
``shared/traces/agentic/sessions.jsonl`` (``--trace``) twice, each in a fresh process so that its peak
resident memory is its own:

* ``single``: one replica, radix, page 64, LRU, ``--capacity`` device tokens, ``--concurrency`` active
  sessions;
* ``cluster``: ``--replicas`` replicas behind ``affinity`` (told each replica's capacity), ``--capacity``
  tokens each, ``--replicas`` x ``--concurrency`` active sessions;

both under ``--cost-preset``. It prints requests per second of wall time (reading the file included) and
the peak RSS of each, and writes them with the full config to ``OUT.jsonl``. The bounds it checks: 10 minutes
and 8 GiB each on 2 cores.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from pathlib import Path

from experiments.common import environment, parser, run_cli, table, write_rows

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic" / "sessions.jsonl"
LIMIT_S, LIMIT_GIB = 600, 8


def replay(kind: str, args: dict) -> dict:
    """One full replay in this process: its summary, seconds and peak RSS (GiB)."""
    from radixkv.cost import CostModel
    from radixkv.sim import simulate, simulate_cluster
    from radixkv.workloads import agentic

    t0 = time.perf_counter()
    replicas = 1 if kind == "single" else args["replicas"]
    requests = agentic(args["trace"], concurrency=args["concurrency"] * replicas, seed=args["seed"])
    common = dict(capacity_tokens=args["capacity"], page_size=64, cost_model=CostModel.preset(args["cost_preset"]))
    if kind == "single":
        res = simulate(requests, cache="radix", eviction_policy="lru", **common)
    else:
        res = simulate_cluster(requests, replicas=replicas, router="affinity", references=False,
                               router_params={"capacity_tokens": args["capacity"]}, **common)
    seconds = time.perf_counter() - t0
    summary = res.summary()
    return {"replay": kind, "requests": len(requests), "replicas": replicas, "seconds": seconds,
            "requests_per_s": len(requests) / seconds,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "hit_rate": summary["hit_rate"], "ttft_mean": summary["ttft_mean"], "ttft_p99": summary["ttft_p99"],
            "prompt_tokens": summary["prompt_tokens"]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "docs/figures/agentic/bench")
    p.add_argument("--trace", default=str(TRACE), help="the agentic sessions file (.jsonl)")
    p.add_argument("--capacity", type=int, default=2_000_000, help="device tokens per replica")
    p.add_argument("--concurrency", type=float, default=16, help="active sessions per replica")
    p.add_argument("--replicas", type=int, default=8, help="replicas of the cluster replay")
    p.add_argument("--cost-preset", default="llama3-70b-8xh100", help="the simulator's cost model")
    p.add_argument("--replays", default="single,cluster", help="comma-separated subset of single, cluster")
    args = p.parse_args(argv)
    if not Path(args.trace).is_file():
        raise FileNotFoundError(f"agentic trace not found at {args.trace} (see shared/traces/agentic/README.md)")
    config = {k: getattr(args, k) for k in ("trace", "capacity", "concurrency", "replicas", "cost_preset", "seed")}
    spawn = multiprocessing.get_context("spawn")  # a fresh process per replay: its peak RSS is its own
    rows = []
    for kind in args.replays.split(","):
        if kind not in ("single", "cluster"):
            raise ValueError(f"--replays: unknown {kind!r}; choose from single, cluster")
        with spawn.Pool(1, maxtasksperchild=1) as pool:  # its error, if any, is raised here
            row = pool.apply(replay, (kind, config))
        row["within_bounds"] = row["seconds"] <= LIMIT_S and row["peak_rss_gib"] <= LIMIT_GIB
        rows.append({**row, "config": config, "env": environment()})
        print(f"{kind}: {row['requests']:,} requests in {row['seconds']:.0f} s ({row['requests_per_s']:.0f}/s), "
              f"peak RSS {row['peak_rss_gib']:.2f} GiB, hit rate {row['hit_rate']:.4f}", flush=True)
    print(table(rows, ["replay", "replicas", "requests", "seconds", "requests_per_s", "peak_rss_gib", "hit_rate",
                       "ttft_mean", "within_bounds"],
                {"seconds": ".0f", "requests_per_s": ".0f", "peak_rss_gib": ".2f", "hit_rate": ".4f",
                 "ttft_mean": ".2f"}))
    print("wrote", write_rows(args.out, rows))
    return rows


if __name__ == "__main__":
    run_cli(main)
