"""Coding-agent sessions at full scale: the whole agentic trace through the simulator.

``python -m experiments.agentic --out docs/figures/agentic`` replays every request of
``shared/traces/agentic/sessions.jsonl`` (``--trace``; skipped with a message where it is absent; laid out
by ``radixkv.workloads.agentic``: Poisson session starts keeping ``--concurrency`` sessions active,
closed-loop streams with their recorded pauses) in four parts (``--parts``):

* ``capacity``: one replica, radix and hash at page 64, against device capacity (``--capacities``, millions
  of tokens), at each concurrency and cost preset, under every eviction policy of ``--policies`` (``belady``,
  radix only, is the clairvoyant reference); the workload's upper bound beside them.
* ``tiers``: one replica, radix LRU, with a host tier of ``--host-ratio`` x the device under each write policy.
* ``routers``: ``--replicas`` replicas behind each router of ``--routers`` (``affinity`` told each
  replica's capacity), with the pooled references (one cache of all the memory, LRU and Belady).
* ``sessions``: one replica, radix LRU against what knows the session (``--session-configs``, each a schedule
  policy and an eviction policy: ``SESSION_CONFIGS``; ``ttl`` at 5 minutes and 1 hour are the production
  baselines, ``belady`` the clairvoyant eviction; ``continuum``, ``kvflow`` and ``infercept`` those papers'
  own rules: ``radixkv.scheduling.continuum``, ``radixkv.cache.eviction.kvflow``,
  ``radixkv.scheduling.infercept``), on the device alone and over a host tier of ``--session-host-ratios``
  x the device (``write_back``); each row also gives the sessions' time in
  service (the sum over a session's requests of finish less ready) and the host traffic.
* defaults as the engines': a main agent waits for the sub-agents the trace shows it waited for
  (``--no-sub-agent-waits``: not); at most ``--chunked-prefill-size`` (8,192) prefill tokens a step, as vLLM
  and SGLang; a capacity must fit the preset's node (``radixkv.gpu_memory``) or be forced (``infeasible``).
* every configuration runs in ``--orders`` arrival orders (5; ``radixkv.workloads.agentic_scaled.reordered``),
  and each workload and order once more under an unlimited cache (part ``reference``, LRU + FCFS), which
  each row's session slowdowns are against; the tables (``experiments.agentic_tables``) give each metric's
  mean and 95% interval over the orders, with per-session completion, slowdown, first-request TTFT, the
  longest wait and Jain's fairness over the slowdowns beside TTFT, and call a configuration better than LRU
  only where the orders' paired differences separate from zero.
* each row also splits the tokens an unlimited cache would have hit and this one missed by what the
  request waited for: a tool call (``tool_use``), a human turn (``end_turn``), an unrecorded stop, or
  nothing (a stream's first request); and gives each session's time in service (its last answer's end
  less its start), mean and p50.

One JSON line per configuration in ``OUT/agentic.jsonl``, with its config and commit (``git_commit``,
``git_dirty``); OUT must hold no rows unless ``--resume`` (then only the missing configurations run); the
tables (``OUT/tables.md``, first line: the commits) and figures (``OUT/*_vs_capacity.png``) show every row,
folded over its orders.
Configurations run as Ray tasks of one CPU where Ray is installed (``--no-ray``, or no Ray: here, in turn).
One replay took about a minute (2M tokens, whole prompts, one core); the default grid is hours: pass subsets.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from experiments import sweep
from experiments.common import environment, names_from, parser, run_cli
from radixkv.bounds import upper_bound
from radixkv.cache.eviction import POLICIES as ONLINE
from radixkv.cache.tiered import WRITE_POLICIES
from radixkv.cache.tiers import HOST_LAYOUTS
from radixkv.cost import COST_PRESETS, CostModel
from radixkv.gpu_memory import check_capacity
from radixkv.routing import ROUTERS
from radixkv.sim import simulate, simulate_cluster
from radixkv.sim.cluster import cluster_references
from radixkv.sim.metrics import agent_metrics, completions
from radixkv.sim.served import belady_on_served_order
from radixkv.workloads import SPLITS, Request, agentic
from radixkv.workloads.agentic_scaled import reordered

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic" / "sessions.jsonl"
RESULTS = "agentic.jsonl"
PAGE = 64
PARTS = ("capacity", "tiers", "routers", "sessions")
REFERENCE = "reference"  # the part of the unlimited-cache rows each workload and order's slowdowns are against
AFTER = ("tool_use", "end_turn", "", None)  # what a request waited for (its parent's stop; None: nothing)
POLICIES = (*ONLINE, "belady")  # belady: the clairvoyant reference (radix only)
# part sessions: label -> (schedule policy, eviction policy, its parameters)
SESSION_CONFIGS = {
    "lru": ("fcfs", "lru", None),
    "belady": ("fcfs", "belady", None),
    "ttl-5m": ("fcfs", "ttl", {"ttl": 300.0}),
    "ttl-1h": ("fcfs", "ttl", {"ttl": 3600.0}),
    "session+lru": ("session", "lru", None),
    "session": ("session", "session", None),
    "session+prefetch": ("session", "session", None),  # and KVFlow's prefetch from the host (over one only)
    "continuum": ("continuum", "continuum", None),  # Continuum's tool-call TTL and program-level FCFS
    "kvflow": ("fcfs", "kvflow", None),  # KVFlow's steps-to-execution eviction, and its prefetch over a host tier
    "infercept": ("infercept", "infercept", None),  # InferCept's min-waste preserve / discard / swap
    "learned": ("fcfs", "learned", None),  # fed the stop reason, depth and context length
    # knows every future request and pause, and evicts by Belady on the order it served (device alone;
    # radixkv.sim.served: a fixed point, or the last of its rounds; not a bound)
    "oracle": ("session-oracle", "belady", {"order": "served"}),
}
PREFETCHING = ("session+prefetch",)  # labels whose rows prefetch (radixkv.scheduling.prefetch), over a host only
PREFETCH_OVER_HOST = ("kvflow",)  # labels that run on the device alone too, and prefetch over a host tier


def parse_args(argv: list[str] | None):
    p = parser(__doc__.splitlines()[0], "docs/figures/agentic")
    p.add_argument("--trace", default=str(TRACE), help="the agentic sessions file (.jsonl)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--capacities", default="0.25,0.5,1", help="device tokens per replica, millions; each must fit "
                   "the preset's node (radixkv.gpu_memory: HBM less weights less a 10%% activation reserve)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="tokens a step prefills, in chunks of at "
                   "most as many per request, as vLLM and SGLang do on these GPUs (8,192; 0: every prompt whole)")
    p.add_argument("--no-sub-agent-waits", action="store_true", help="a main agent resumes on its recorded pause "
                   "alone, as before (default: it also waits for the sub-agents the trace shows it waited for)")
    p.add_argument("--force-capacity", action="store_true", help="run capacities past the node's memory too; their "
                   "rows say infeasible")
    p.add_argument("--orders", type=int, default=5, help="arrival orders of the same sessions (their start times "
                   "dealt in a seeded shuffle: radixkv.workloads.agentic_scaled.reordered; 0 is --seed's own): every "
                   "configuration runs in each, and the tables give each metric's mean and 95%% interval over them")
    p.add_argument("--concurrency", default="16,64", help="active sessions (in all, for the routers' part)")
    p.add_argument("--cost-presets", default="llama3-70b-8xh100", help="the simulator's cost models")
    p.add_argument("--caches", default="radix,hash", help="part capacity's caches")
    p.add_argument("--policies", default=",".join(POLICIES), help="part capacity's eviction policies")
    p.add_argument("--host-ratio", type=float, default=4.0, help="part tiers: host tokens per device token")
    p.add_argument("--write-policies", default=",".join(WRITE_POLICIES), help="part tiers' write policies")
    p.add_argument("--routers", default=",".join(ROUTERS), help="part routers' routers")
    p.add_argument("--replicas", type=int, default=8, help="part routers' replicas")
    p.add_argument("--session-configs", default=",".join(SESSION_CONFIGS),
                   help=f"part sessions' configurations, of {tuple(SESSION_CONFIGS)}")
    p.add_argument("--session-host-ratios", default="0,1",
                   help="part sessions: host tokens per device token (0: the device alone)")
    p.add_argument("--session-write-policies", default="write_back",
                   help=f"part sessions' write policies over a host tier, of {WRITE_POLICIES}")
    p.add_argument("--session-host-layouts", default=",".join(HOST_LAYOUTS),
                   help=f"part sessions' host tier layouts, of {HOST_LAYOUTS} (radixkv.cache.segments)")
    p.add_argument("--max-pause", type=float, default=None, help="cap on every recorded pause, seconds")
    p.add_argument("--sessions", type=int, default=None, help="only the first N sessions of the seeded order")
    p.add_argument("--split", default=None, choices=SPLITS, help="only the sessions on this side of the project's "
                   "tune/test split (radixkv.workloads.split_of; None: every session, as the tables so far)")
    p.add_argument("--engine", action="store_true",
                   help="instead of the grid: a few sessions through radixkv.LLM, scaled down, and the simulator's "
                        "prediction of each request's hit (OUT/engine.jsonl)")
    p.add_argument("--model", default="smollm2-135m", help="--engine: the model")
    p.add_argument("--engine-sessions", type=int, default=3, help="--engine: sessions")
    p.add_argument("--engine-requests", type=int, default=12, help="--engine: requests per session at most")
    p.add_argument("--engine-max-prompt", type=int, default=1024, help="--engine: longest scaled prompt (tokens)")
    p.add_argument("--engine-kv-tokens", type=int, default=4096, help="--engine: the engine's KV pool")
    sweep.add_ray_flags(p)
    sweep.add_resume_flag(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the grid

def grid(args) -> list[dict]:
    """Every configuration of the chosen parts, cheapest capacities first."""
    parts = names_from(args.parts, PARTS, "--parts")
    caps = [int(float(c) * 1e6) for c in args.capacities.split(",")]
    concs = [float(c) for c in args.concurrency.split(",")]
    presets = names_from(args.cost_presets, sorted(COST_PRESETS), "--cost-presets")
    if args.orders < 1:
        raise ValueError(f"--orders must be at least 1, got {args.orders}")
    out: list[dict] = []
    for conc in concs:
        for preset in presets:
            base = {"concurrency": conc, "seed": args.seed, "max_pause": args.max_pause, "sessions": args.sessions,
                    "cost_preset": preset, **({"split": args.split} if args.split else {}),
                    "chunked_prefill_size": args.chunked_prefill_size or None,
                    **({} if args.no_sub_agent_waits else {"sub_agent_waits": True}),
                    "page_size": PAGE, "replicas": 1, "router": None, "host_ratio": 0.0, "write_policy": None}
            # every workload's sessions under an unlimited cache, LRU and FCFS: what slowdowns are against
            out.append({**base, "part": REFERENCE, "cache": "radix", "eviction_policy": "lru", "capacity_tokens": None})
            for cap in caps:
                at = {**base, "capacity_tokens": cap}  # forced past the node's HBM: the row says so
                if not check_capacity(preset, cap, args.force_capacity):
                    at["infeasible"] = True
                if "capacity" in parts:
                    for cache in names_from(args.caches, ("radix", "hash"), "--caches"):
                        for policy in names_from(args.policies, POLICIES, "--policies"):
                            if policy != "belady" or cache == "radix":
                                out.append({**at, "part": "capacity", "cache": cache, "eviction_policy": policy})
                if "tiers" in parts:
                    for write in names_from(args.write_policies, WRITE_POLICIES, "--write-policies"):
                        out.append({**at, "part": "tiers", "cache": "radix", "eviction_policy": "lru",
                                    "host_ratio": args.host_ratio, "write_policy": write})
                if "routers" in parts:
                    shape = {**at, "part": "routers", "cache": "radix", "eviction_policy": "lru",
                             "replicas": args.replicas}
                    out.append({**shape, "router": "references"})
                    out += [{**shape, "router": r} for r in names_from(args.routers, ROUTERS, "--routers")]
                if "sessions" in parts:
                    out += session_configs(args, at)
    out = [{**c, "order": order} for order in range(args.orders) for c in out]
    return sorted(out, key=lambda c: (c["order"], c["capacity_tokens"] or math.inf, c["eviction_policy"] == "belady"))


def session_configs(args, base: dict) -> list[dict]:
    """Part sessions at one capacity: each configuration of ``--session-configs`` at each host ratio, over a
    host tier under each of ``--session-write-policies`` and ``--session-host-layouts`` (``belady`` on the
    device alone: the reference eviction, not a tiered one; ``PREFETCHING`` labels over a host tier only: a
    prefetch loads from one; ``PREFETCH_OVER_HOST`` labels everywhere, prefetching over a host tier). A row
    names its layout where it is not ``prefix``, and its prefetch where it has one (rows from before the
    layouts and the prefetch keep their keys)."""
    out = []
    labels = names_from(args.session_configs, tuple(SESSION_CONFIGS), "--session-configs")
    writes = names_from(args.session_write_policies, WRITE_POLICIES, "--session-write-policies")
    layouts = names_from(args.session_host_layouts, HOST_LAYOUTS, "--session-host-layouts")
    for ratio in (float(r) for r in args.session_host_ratios.split(",")):
        tiers = itertools.product(writes, layouts) if ratio else [(None, "prefix")]
        for (write, layout), label in itertools.product(tiers, labels):
            schedule, policy, params = SESSION_CONFIGS[label]
            prefetch = label in PREFETCHING or (label in PREFETCH_OVER_HOST and ratio > 0)
            if (policy != "belady" or not ratio) and (ratio or label not in PREFETCHING):
                out.append({**base, "part": "sessions", "cache": "radix", "label": label, "schedule_policy": schedule,
                            "eviction_policy": policy, "eviction_params": params, "host_ratio": ratio,
                            "write_policy": write, **({"host_layout": layout} if layout != "prefix" else {}),
                            **({"prefetch": True} if prefetch else {})})
    return out


# ---------------------------------------------------------------------------------------------- one task

def run_one(requests: Sequence[Request], config: dict) -> dict:
    """One configuration: its summary, the missed reusable tokens by what each request waited for, and the
    sessions' time in service."""
    t0 = time.perf_counter()
    cost = CostModel.preset(config["cost_preset"])
    chunk = config.get("chunked_prefill_size")  # None (rows from before it was a flag): whole prompts
    common = dict(cache=config["cache"], capacity_tokens=config["capacity_tokens"], page_size=PAGE,
                  block_size=PAGE, cost_model=cost, max_batch_tokens=chunk, chunked_prefill_size=chunk)
    if config["router"] == "references":
        return {"key": sweep.key(config), "config": config, "seconds": time.perf_counter() - t0,
                **cluster_references(requests, config["replicas"], **common)}
    if config["router"] is not None:
        res = simulate_cluster(requests, replicas=config["replicas"], router=config["router"], references=False,
                               router_params=sweep.router_params(config["router"], config["capacity_tokens"],
                                                                 "radix", PAGE, PAGE), **common)
        rows = [row for rep in res.replicas for row in rep.per_request]
        learned = {}
    elif (config.get("eviction_params") or {}).get("order") == "served":  # Belady on the order served
        common = {k: v for k, v in common.items() if k != "cache"}
        res, found = belady_on_served_order(requests, schedule_policy=config.get("schedule_policy", "fcfs"),
                                            **common)
        rows, learned = res.per_request, {f"served_{k}": v for k, v in found.items()}
    else:
        host = int(config["host_ratio"] * (config["capacity_tokens"] or 0)) or None
        res = simulate(requests, eviction_policy=config["eviction_policy"], host_capacity_tokens=host,
                       write_policy=config["write_policy"] or "write_through",
                       schedule_policy=config.get("schedule_policy", "fcfs"),
                       eviction_params=config.get("eviction_params") or {},
                       host_layout=config.get("host_layout", "prefix"), prefetch=config.get("prefetch", False),
                       **common)
        rows = res.per_request
        # the session policy's learned holds, for one; the prefetch's predicted pauses
        learned = {k: res.config[k] for k in ("eviction", "prefetcher") if k in res.config}
    return {"key": sweep.key(config), "config": config, **res.summary(), **misses(rows), **sessions(rows),
            **learned, "seconds": time.perf_counter() - t0}



def misses(rows: list[dict]) -> dict:
    """Reusable tokens missed (``reusable - hit``, what an unlimited cache would have hit and this one did
    not), in all and by what the request waited for (``after``), as shares of the served requests' prompt
    tokens (a request whose KV can never fit the device is rejected, as ``rejected`` counts)."""
    served = [r for r in rows if not r["rejected"]]  # as the hit rate counts them
    total = sum(r["prompt_len"] for r in served) or 1
    lost = {str(a): 0 for a in AFTER}
    for r in served:
        lost[str(r["after"])] += max(r["reusable"] - r["hit"], 0)
    return {"missed_reusable": sum(lost.values()) / total, "missed_by_after": {k: v / total for k, v in lost.items()}}


def sessions(rows: list[dict]) -> dict:
    """Each session's span (its last answer's end less its first request's send), mean and p50, and its
    time in service (the sum over its requests of finish less ready: waiting and being served), mean."""
    service: dict[str, float] = {}
    for r in rows:
        if not r["rejected"]:
            service[r["session"]] = service.get(r["session"], 0.0) + r["finish"] - r["ready"]
    span = completions(rows)
    times = np.array(list(span.values())) if span else np.zeros(1)
    agents = {k: v for k, v in agent_metrics(rows).items() if not k.startswith(("slowdown", "jain", "ttft"))}
    return {"session_time_mean": float(times.mean()), "session_time_p50": float(np.median(times)),
            "service_time_mean": float(np.mean(list(service.values()))) if service else 0.0, **agents,
            "session_completions": {str(k): v for k, v in span.items()}}


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    configs = grid(args)
    out = Path(args.out)
    if not Path(args.trace).is_file():
        print(f"skipping the agentic experiment: no trace at {args.trace} (pass --trace PATH; see "
              "shared/traces/agentic/README.md)")
        return []
    out.mkdir(parents=True, exist_ok=True)
    if args.engine:
        from experiments.agentic_engine import engine_part

        return engine_part(args, out)
    path = out / RESULTS
    sweep.fresh_results(path, args.resume)
    layout = {"trace": Path(args.trace).name, "trace_bytes": Path(args.trace).stat().st_size, "seed": args.seed,
              "max_pause": args.max_pause, "sessions": args.sessions, "split": args.split, "page_size": PAGE}
    sweep.write_config(out / "config.json", {"workload": layout, "grid": configs,
                                             "cost_models": {p: asdict(CostModel.preset(p)) for p in COST_PRESETS}},
                       {"args": vars(args), "env": environment()})
    t0 = time.perf_counter()
    failures = []
    bound = upper_bound(agentic(args.trace, sessions=args.sessions, split=args.split),  # order and timing free
                        page_size=PAGE)
    done = sweep.read_results(path)
    with contextlib.nullcontext() if args.no_ray else sweep.ray_session(args.ray_address, args.num_cpus) as ray:
        for conc, order in sorted({(c["concurrency"], c["order"]) for c in configs}):
            todo = sweep.pending([c for c in configs if (c["concurrency"], c["order"]) == (conc, order)], done)
            if todo:
                requests = reordered(agentic(args.trace, concurrency=conc, seed=args.seed, max_pause=args.max_pause,
                                             sessions=args.sessions, split=args.split,
                                             wait_for_sub_agents=not args.no_sub_agent_waits), order)
                failures += sweep.execute(requests, todo, path, ray, desc=f"{conc:g} sessions, order {order}",
                                          run=run_one)[1]
    rows = sweep.read_results(path)  # the tables and figures show every row in the file, from any invocation
    print(f"ran in {time.perf_counter() - t0:.0f} s; {sum(r['seconds'] for r in rows):.0f} s of runs in the file")
    from experiments.agentic_tables import draw, over_orders, tables, with_slowdowns

    folded = over_orders(with_slowdowns(rows))
    text = tables(folded, bound, rows)
    print(text)
    (out / "tables.md").write_text(text + "\n")
    print("wrote", path, *draw(folded, out, bound))
    if failures:
        raise SystemExit(f"{len(failures)} configuration(s) failed; rerun the same command to retry them")
    return rows


if __name__ == "__main__":
    run_cli(main)
