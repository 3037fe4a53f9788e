"""Hierarchical prefix caches (device, host, storage tiers): hit rate and TTFT on a cluster and on the engine.

``python -m experiments.tiers --out docs/figures/tiers`` runs three parts (``--parts a,b,c``):

* (a) Mooncake's conversation trace (``--trace``; skipped with a message where it is absent) and
  ``experiments.routing``'s multi-turn and shared-prefix workloads on 8 simulated replicas behind ``affinity``
  (told each replica's device + host tokens), each a radix cache (page 512 on Mooncake, 16 otherwise) with a
  device tier of 3-4 sizes and a host tier of 0, 2, 4 or 8 times it under each write policy; beside them
  single-tier LRU caches of the same total memory (device x (1 + ratio)) and of the host's size, and
  ``cluster_references`` (upper bound, pooled LRU and Belady of the device memory). Cost: ``--cost-preset``.
* (b) Mooncake: each replica with a private lower tier of ``--local-storage`` tokens (its host tier) against
  one store of N x that shared by all, behind ``affinity`` and ``round_robin``: global / local beside x2.22.
* (c) The engine (``--model``) on ``experiments.multiturn``'s workload with a 2,048-token device pool and a
  16,384-token host tier (write_through), without the host tier, and with one 18,432-token pool: hit rate,
  mean TTFT of turns >= 2, tokens loaded and written, greedy outputs against the one pool's. It runs the
  real model (minutes); ``--parts a,b`` skips it.

One row per configuration in ``OUT/tiers.jsonl`` with its full config (a rerun skips the rows already there);
simulations run as Ray tasks (``--no-ray``: in this process). Also ``OUT/config.json``, ``OUT/tables.md`` (as
printed), ``OUT/*.png``; prints the targets, each PASS or MISS with its numbers.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict
from pathlib import Path

from matplotlib.figure import Figure

from experiments import multiturn, routing, sweep
from experiments.common import (
    DEFAULT_TRACE,
    add_settings,
    environment,
    fractions_from,
    names_from,
    parser,
    run_cli,
    save_figure,
)
from radixkv.cache.tiered import WRITE_POLICIES
from radixkv.cost import COST_PRESETS
from radixkv.routing import ROUTERS
from radixkv.sim import CostModel, simulate_cluster
from radixkv.sim.cluster import cluster_references

# name -> sizes (synthetic: routing.py's), radix page, device tokens per replica. The synthetic capacities are
# routing.py's pooled budgets / 8 and their halvings; Mooncake's trace shares whole 512-token blocks.
WORKLOADS = {
    "mooncake": {"sizes": None, "page_size": 512, "capacities": (125_000, 250_000, 500_000, 1_000_000)},
    "multi_turn": {"sizes": routing.WORKLOADS["multi_turn"]["sizes"], "page_size": 16,
                   "capacities": (14_000, 28_000, 56_000)},
    "shared_prefix": {"sizes": routing.WORKLOADS["shared_prefix"]["sizes"], "page_size": 16,
                      "capacities": (9_400, 18_800, 37_600)},
}
HEADLINE = 250_000  # Mooncake's device tokens per replica in part (b) and in the router ablation
MOONCAKE_GLOBAL = {"conversation": 2.22, "tool-and-agent": 1.38, "synthetic": 2.36}  # FAST'25: global / local
RESULTS = "tiers.jsonl"
SETTINGS = ("cache", "page_size", "capacity_tokens", "host_capacity_tokens", "storage_capacity_tokens",
            "write_policy", "write_threshold", "seed")
ENGINES = {"one_pool": lambda a: {"kv_cache_tokens": a.device_tokens + a.host_tokens},  # part (c): KV settings
           "tiered": lambda a: {"kv_cache_tokens": a.device_tokens, "host_kv_cache_tokens": a.host_tokens,
                                "write_policy": "write_through"},
           "device_only": lambda a: {"kv_cache_tokens": a.device_tokens}}


def engine_settings(args, name: str) -> dict:
    """Part (c): the engine's KV settings, and ``batch_invariant`` where asked (absent when off, so rows of
    runs without it keep their keys)."""
    return {**ENGINES[name](args), **({"batch_invariant": True} if args.batch_invariant else {})}


def parse_args(argv: list[str] | None = None):
    p = parser(__doc__.splitlines()[0], "docs/figures/tiers")
    p.description += " --out is a directory."
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (.jsonl); skipped if absent")
    p.add_argument("--parts", default="a,b,c", help="comma-separated subset of a, b, c")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"part (a): subset of {list(WORKLOADS)}")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload (quick runs)")
    p.add_argument("--replicas", type=int, default=8, help="simulated replicas")
    p.add_argument("--router", default="affinity", choices=ROUTERS, help="part (a)'s router")
    p.add_argument("--ratios", default="0,2,4,8", help="host tier / device tier ratios (0: no host tier)")
    p.add_argument("--policies", default=",".join(WRITE_POLICIES), help="write policies")
    add_settings(p, "write_threshold")
    p.add_argument("--cost-preset", default="llama3-70b-8xh100", choices=sorted(COST_PRESETS),
                   help="every replica's cost model")
    p.add_argument("--local-storage", type=int, default=3_000_000,
                   help="part (b): each replica's private lower tier (tokens); the global store is N x it")
    p.add_argument("--local-routers", default="affinity,kv_events,round_robin", help="part (b)'s routers")
    p.add_argument("--model", default="smollm2-135m", help="part (c): the engine's model")
    p.add_argument("--device-tokens", type=int, default=2048, help="part (c): the device KV pool")
    p.add_argument("--host-tokens", type=int, default=16384, help="part (c): the host tier")
    p.add_argument("--dtype", default="auto", help="part (c): the model's dtype (auto: its own)")
    p.add_argument("--threads", type=int, default=2, help="part (c): torch threads")
    p.add_argument("--repeats", type=int, default=3, help="part (c): runs of each engine, in turns (median TTFT)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="part (c): engines with batch_invariant=True (logits independent of the batch)")
    sweep.add_ray_flags(p)
    args = p.parse_args(argv)
    if min(1 if args.limit is None else args.limit, args.replicas, args.write_threshold, args.local_storage,
           args.device_tokens, args.host_tokens, args.repeats) < 1:
        p.error("--limit, --replicas, --write-threshold, --local-storage, --repeats and token counts must be >= 1")
    return args


def cluster(base: dict, arm: str, router: str, device: int, host: int = 0, storage: int = 0,
            policy: str | None = None, told: int | None = None, threshold: int = 2) -> dict:
    """A cluster: device, host tokens per replica, one shared store; the router told ``told`` (device + host)."""
    tiers = {"write_policy": policy, "write_threshold": threshold} if host or storage else {}
    params = sweep.router_params(router, told or device + host, "radix", base["page_size"], base["page_size"])
    return {**base, "arm": arm, "router": router, "router_params": params, "capacity_tokens": device,
            "host_capacity_tokens": host or None, "storage_capacity_tokens": storage or None, **tiers}


def part_a(args, base: dict, name: str) -> list[dict]:
    """Per device size: references, single tiers (x1, x(1 + r), x r), tiered; Mooncake: router told the device."""
    ratios = [int(r) for r in fractions_from(args.ratios, "--ratios") if r > 0]
    policies, t = names_from(args.policies, WRITE_POLICIES, "--policies"), args.write_threshold
    out = []
    for d in WORKLOADS[name]["capacities"]:
        out += [{**base, "arm": "references", "capacity_tokens": d}, cluster(base, "single", args.router, d)]
        for r in ratios:
            out += [cluster(base, "single", args.router, d * m) for m in (1 + r, r)]
            out += [cluster(base, "tiered", args.router, d, d * r, policy=p, threshold=t) for p in policies]
    if name == "mooncake" and 4 in ratios:
        out.append(cluster(base, "tiered", args.router, HEADLINE, 4 * HEADLINE, policy="write_through",
                           told=HEADLINE, threshold=t))
    return out


def part_b(args, base: dict) -> list[dict]:
    """Per router: the device tier alone, each replica's own lower tier of S, one store of N x S."""
    s, out = args.local_storage, [{**base, "arm": "references", "capacity_tokens": HEADLINE}]
    for router in names_from(args.local_routers, ROUTERS, "--local-routers"):
        out += [cluster(base, "single", router, HEADLINE),
                cluster(base, "local", router, HEADLINE, host=s, policy="write_through"),
                cluster(base, "global", router, HEADLINE, storage=args.replicas * s, policy="write_through",
                        told=HEADLINE + s)]
    return out


def grids(args, parts: list[str]) -> dict[str, tuple[dict, list[dict]]]:
    """workload name -> (its spec, its configurations); Mooncake only where its trace exists."""
    chosen = names_from(args.workloads, WORKLOADS, "--workloads") if "a" in parts else []
    out = {}
    for name in dict.fromkeys(chosen + (["mooncake"] if "b" in parts else [])):
        if name == "mooncake" and not sweep.trace_present(args.trace, "mooncake (parts a, b)"):
            continue
        spec = sweep.workload_spec(trace=args.trace, limit=args.limit) if name == "mooncake" else \
            sweep.workload_spec(workload=name, sizes=WORKLOADS[name]["sizes"], seed=args.seed, limit=args.limit)
        base = {"workload": spec, "replicas": args.replicas, "cache": "radix",
                "page_size": WORKLOADS[name]["page_size"], "cost_preset": args.cost_preset,
                "cost_model": asdict(CostModel.preset(args.cost_preset)), "seed": args.seed}
        out[name] = spec, (part_a(args, base, name) if name in chosen else []) + \
            (part_b(args, base) if "b" in parts and name == "mooncake" else [])
    return out


def run_config(requests, config: dict) -> dict:
    """One configuration's row: its key, config, summary (or references) and the seconds it took."""
    t0 = time.perf_counter()
    cost = CostModel.from_dict(config["cost_model"])
    settings = {k: config[k] for k in SETTINGS if config.get(k) is not None}
    if config["arm"] == "references":
        result = cluster_references(requests, config["replicas"], cost_model=cost, **settings)
    else:
        res = simulate_cluster(requests, replicas=config["replicas"], router=config["router"],
                               router_params=config["router_params"], cost_model=cost, references=False,
                               **settings)
        t = res.ttfts()
        result = {**res.summary(), "ttft_mean": float(t.mean()) if len(t) else None}  # load_seconds: summed there
    return {"key": sweep.key(config), "config": config, **result, "seconds": time.perf_counter() - t0}


def run_simulations(args, todo: dict, path: Path) -> list[str]:
    rows = sweep.read_results(path)
    pending = {name: (spec, sweep.pending(configs, rows)) for name, (spec, configs) in todo.items()}
    print(f"{sum(len(c) for _, c in todo.values())} simulated configurations, "
          f"{sum(len(c) for _, c in pending.values())} to run")
    failures: list[str] = []
    with contextlib.ExitStack() as stack:
        ray = None if args.no_ray or not any(c for _, c in pending.values()) else \
            stack.enter_context(sweep.ray_session(args.ray_address, args.num_cpus))
        for name, (spec, configs) in pending.items():
            if configs:
                _, failed = sweep.execute(sweep.load_workload(spec, args.trace), configs, path, ray, desc=name,
                                          run=run_config)
                failures += [f"{sweep.key(config)}: {error}" for config, error in failed]
    return failures


def engine_config(args, name: str, repeat: int = 0) -> dict:
    return {"arm": "engine", "engine": name, "model": args.model, "dtype": args.dtype, "seed": args.seed,
            "threads": args.threads, **engine_settings(args, name), "workload": "experiments.multiturn",
            "repeat": repeat}


def engines(rows: list[dict]) -> dict[str, dict]:
    """Each engine's run of median mean TTFT over turns >= 2 among its repeats, with every run's (``runs``)."""
    by = {n: sorted((r for r in rows if r.get("engine") == n), key=lambda r: r["ttft_mean_later"]) for n in ENGINES}
    return {n: {**rs[(len(rs) - 1) // 2], "runs": [r["ttft_mean_later"] for r in rs]} for n, rs in by.items() if rs}


def serve_engine(args, name: str, repeat: int) -> dict:
    """``experiments.multiturn``'s workload through one engine: its summary, tier counters, greedy outputs."""
    import torch

    from radixkv import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    kv = engine_settings(args, name)
    mt = multiturn.parse_args(["--model", args.model, "--dtype", args.dtype, "--seed", str(args.seed),
                               "--kv-cache-tokens", str(kv["kv_cache_tokens"])])
    system, users = multiturn.user_turns(mt)
    llm = LLM(mt.model, **{**multiturn.engine_kwargs("radix", mt), **kv})
    params = SamplingParams(max_new_tokens=mt.max_new_tokens, ignore_eos=True)
    llm.generate([list(system)], SamplingParams(max_new_tokens=1))  # the warm system prompt, as multiturn's
    llm.reset_stats()
    history, rows, outputs = [list(system) for _ in range(mt.sessions)], [], []
    t0 = time.perf_counter()
    for turn in range(mt.turns):
        prompts = [history[s] + users[s][turn].tolist() for s in range(mt.sessions)]
        outs = llm.generate(prompts, params)
        outputs.append([o.token_ids for o in outs])
        for s, o in enumerate(outs):
            history[s] = prompts[s] + o.token_ids
            rows.append({"cache": name, "source": "measured", "session": s, "turn": turn, "ttft": o.ttft,
                         "prompt_tokens": o.num_prompt_tokens, "cached_tokens": o.num_cached_tokens,
                         "generated": len(o.token_ids)})
    wall = time.perf_counter() - t0
    llm.check_idle()
    stats, config = llm.stats(), engine_config(args, name, repeat)
    return {"key": sweep.key(config), "config": config, **multiturn.summarize(name, rows, wall),
            **{k: stats[k] for k in ("hit_tokens_by_tier", "loaded_tokens", "written_tokens")},
            "engine_config": llm.config.to_dict(), "outputs": outputs, "seconds": time.perf_counter() - t0,
            "loadavg_1min": os.getloadavg()[0]}  # the machine is shared: how busy it was


def run_engines(args, path: Path) -> set[str]:
    """Part (c): each engine ``--repeats`` times, in turns (those not in ``path`` yet); their rows' keys."""
    runs = [(i, n, sweep.key(engine_config(args, n, i))) for i in range(args.repeats) for n in ENGINES]
    done = {r["key"] for r in sweep.read_results(path)}
    for i, name, _ in [run for run in runs if run[2] not in done]:
        with path.open("a") as f:
            f.write(sweep.result_line(row := serve_engine(args, name, i)))
        print(f"engine {name}, run {i + 1}: {row['seconds']:.0f} s")
    return {k for _, _, k in runs}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    parts = names_from(args.parts, "abc", "--parts")
    todo = grids(args, parts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    sweep.write_config(out / "config.json", {
        "replicas": args.replicas, "router": args.router, "cost_model": asdict(CostModel.preset(args.cost_preset)),
        "workloads": {n: {"spec": spec, **{k: v for k, v in WORKLOADS[n].items() if k != "sizes"}}
                      for n, (spec, _) in todo.items()}, "headline_device": HEADLINE,
        "engines": {n: engine_config(args, n) for n in ENGINES}}, {"args": vars(args), "env": environment()})
    t0 = time.perf_counter()
    failures = run_simulations(args, todo, path)
    wanted = run_engines(args, path) if "c" in parts else set()
    wanted |= {sweep.key(c) for _, cs in todo.values() for c in cs}
    names = {sweep.key(spec): name for name, (spec, _) in todo.items()}
    rows = [{**r["config"], **r, "workload_name": names.get(sweep.key(r["config"]["workload"]), "engine")}
            for r in sweep.read_results(path) if r["key"] in wanted]
    print(f"ran in {time.perf_counter() - t0:.0f} s; {sum(r['seconds'] for r in rows):.0f} s of runs in the file")
    text, checks = tables(rows, args), targets(rows, args)
    print(text, *checks, sep="\n")
    (out / "tables.md").write_text(text + "\n\n" + "".join(f"- {c}\n" for c in checks))
    print("wrote", path, *draw(rows, out, args.router))
    if failures:
        raise SystemExit(f"{len(failures)} configuration(s) failed; rerun the same command to retry them")
    return rows


# ---------------------------------------------------------------------------------------------- tables

def find(rows: list[dict], w: str, arm: str, device: int, host=None, policy=None, storage=None,
         router: str | None = None, told: int | None = None) -> dict | None:
    """The row of that configuration (the router told ``told`` tokens, default device + host), or None."""
    told = told or device + (host or 0)
    for r in rows:
        if (r["workload_name"], r["arm"], r.get("capacity_tokens")) != (w, arm, device):
            continue
        if arm == "references" or (
                (r.get("host_capacity_tokens"), r.get("write_policy"), r.get("storage_capacity_tokens"), r["router"])
                == (host, policy, storage, router) and r["router_params"].get("capacity_tokens", told) == told):
            return r
    return None


def _cell(r: dict | None, split: bool = False) -> str:
    """Hit rate (mean TTFT), or the hit rate by tier."""
    return "" if r is None else " + ".join(f"{k} {v:.3f}" for k, v in r["hit_rate_by_tier"].items()) if split else \
        f"{r['hit_rate']:.3f} ({r['ttft_mean']:.2f})"


def table_a(rows: list[dict], w: str, args) -> list[str]:
    ratios = [int(r) for r in fractions_from(args.ratios, "--ratios") if r > 0]
    pols, router, out = names_from(args.policies, WRITE_POLICIES, "--policies"), args.router, []
    out += [f"### (a) {w}: hit rate (mean TTFT, s), {args.replicas} replicas behind {router}", "",
            "| device / replica | host / device | device alone | " + " | ".join(pols) + " | single tier, device x "
            "(1 + r) | single tier, device x r | write_through, by tier |",
            "| ---: | ---: |" + " ---: |" * (len(pols) + 3) + " --- |"]
    for d in WORKLOADS[w]["capacities"]:
        alone = find(rows, w, "single", d, router=router)
        for r in ratios:
            got = [find(rows, w, "tiered", d, d * r, p, router=router) for p in pols]
            one, hosts = (find(rows, w, "single", d * m, router=router) for m in (1 + r, r))
            out += [f"| {d:,} | {r} | {_cell(alone)} | " + " | ".join(map(_cell, got)) + f" | {_cell(one)} | "
                    f"{_cell(hosts)} | {_cell(got[0], True)} |"] if any(got) else []
    told = find(rows, w, "tiered", HEADLINE, 4 * HEADLINE, "write_through", router=router, told=HEADLINE)
    out += ["", f"The router told the device tier only (device {HEADLINE:,}, host x4, write_through): "
            f"{_cell(told)}, by tier {_cell(told, True)}."] if told else []
    out += ["", f"{w}: references (pooled: one cache of {args.replicas} x the device tier)", "",
            "| device / replica | upper bound | pooled Belady | pooled LRU |", "| ---: | ---: | ---: | ---: |"]
    refs = [r for d in WORKLOADS[w]["capacities"] if (r := find(rows, w, "references", d))]
    return out + [f"| {r['capacity_tokens']:,} | {r['upper_bound']:.3f} | {r.get('pooled_belady', 0):.3f} | "
                  f"{r['pooled_lru']:.3f} |" for r in refs] + [""]


def part_b_rows(rows: list[dict], args, router: str) -> tuple[dict | None, dict | None, dict | None]:
    """Part (b)'s rows of one router: device alone, local, global."""
    s = args.local_storage
    return (find(rows, "mooncake", "single", HEADLINE, router=router),
            find(rows, "mooncake", "local", HEADLINE, s, "write_through", router=router),
            find(rows, "mooncake", "global", HEADLINE, None, "write_through", args.replicas * s, router, HEADLINE + s))


def table_b(rows: list[dict], args) -> list[str]:
    s, n = args.local_storage, args.replicas
    ref = find(rows, "mooncake", "references", HEADLINE)
    out = [f"### (b) Mooncake: local against global lower tiers (device {HEADLINE:,} per replica)", "",
           "| router | tiers | hit rate | by tier | % of upper bound | TTFT p50 / p99 (s) | global / local |",
           "| --- | --- | ---: | --- | ---: | --- | ---: |"]
    for router in args.local_routers.split(","):
        alone, local, glob = part_b_rows(rows, args, router)
        for label, r in (("device only", alone), (f"local: own host tier of {s:,}", local),
                         (f"global: one store of {n} x {s:,}", glob)):
            share = f"{100 * r['hit_rate'] / ref['upper_bound']:.1f}%" if ref and r else ""
            ratio = f"x{glob['hit_rate'] / local['hit_rate']:.2f}" if r is glob and local and glob else ""
            out += [f"| {router} | {label} | {r['hit_rate']:.3f} | {_cell(r, True)} | {share} | "
                    f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {ratio} |"] if r else []
    return out + ["", "Mooncake (FAST'25), global / local: " +
                  ", ".join(f"{k} x{v}" for k, v in MOONCAKE_GLOBAL.items()), ""]


def table_c(rows: list[dict], args) -> list[str]:
    eng = engines(rows)
    out = [f"### (c) the engine ({args.model}, the main job's workload): {args.repeats} run(s) each, median TTFT",
           "", "| engine | hit rate | hit tokens, device / host | mean TTFT, turns >= 2 (s; all runs) | loaded / "
           "written tokens | end to end (s) | greedy outputs equal one_pool's |", "|" + " --- | ---: |" * 3 + " --- |"]
    for name, r in eng.items():
        host = f" + host {r['host_kv_cache_tokens']:,}" if r.get("host_kv_cache_tokens") else ""
        out.append(f"| {name} ({r['kv_cache_tokens']:,}{host}) | {r['hit_rate']:.3f} | "
                   f"{r['hit_tokens_by_tier']['device']:,} / {r['hit_tokens_by_tier']['host']:,} | "
                   f"{r['ttft_mean_later']:.2f} ({', '.join(f'{t:.2f}' for t in r['runs'])}) | "
                   f"{r['loaded_tokens']:,} / {r['written_tokens']:,} | {r['end_to_end_s']:.1f} | "
                   f"{same(r, eng.get('one_pool'))} |")
    return out


def same(r: dict, ref: dict | None) -> str:
    """Whether ``r``'s greedy outputs are ``ref``'s, or how many (session, turn) outputs differ."""
    diff = ref and sum(x != y for x, y in zip(sum(r["outputs"], []), sum(ref["outputs"], []), strict=True))
    return "" if ref is None else "yes" if not diff else f"no: {diff} of {sum(map(len, r['outputs']))} differ"


def tables(rows: list[dict], args) -> str:
    parts: list[str] = []
    for w in WORKLOADS:
        parts += table_a(rows, w, args) if any(r["workload_name"] == w and r["arm"] == "tiered" for r in rows) else []
    parts += table_b(rows, args) if any(r["arm"] == "local" for r in rows) else []
    parts += table_c(rows, args) if any(r["arm"] == "engine" for r in rows) else []
    return "\n".join(parts).rstrip()


def targets(rows: list[dict], args) -> list[str]:
    """The three targets, each PASS or MISS with its numbers (or why it was not checked)."""
    out = []
    for d in WORKLOADS["mooncake"]["capacities"]:
        t = find(rows, "mooncake", "tiered", d, 4 * d, "write_through", router=args.router)
        one, alone = (find(rows, "mooncake", "single", c, router=args.router) for c in (5 * d, d))
        ub = (find(rows, "mooncake", "references", d) or {}).get("upper_bound", 1.0)
        if t and one and alone:
            ok = t["hit_rate"] >= 0.95 * one["hit_rate"] and t["hit_rate"] >= 1.5 * alone["hit_rate"]
            out.append(f"target 1 (Mooncake, device {d:,}, host x4, write_through: >= 95% of one pool of x5, >= 1.5x "
                       f"the device alone): {'PASS' if ok else 'MISS'}: {t['hit_rate']:.4f} is "
                       f"{100 * t['hit_rate'] / one['hit_rate']:.1f}% of {one['hit_rate']:.4f} and "
                       f"x{t['hit_rate'] / alone['hit_rate']:.2f} of {alone['hit_rate']:.4f}" + (
                        f" (1.5x is above the upper bound {ub:.4f})" if 1.5 * alone["hit_rate"] > ub else ""))
    out = out or ["target 1: not checked (no Mooncake rows at host ratio 4 with write_through)"]
    eng, line = engines(rows), "target 2: not checked (part c not run)"
    if all(n in eng for n in ENGINES):
        t, big, small = eng["tiered"], eng["one_pool"], eng["device_only"]
        ok = [abs(t["hit_rate"] - big["hit_rate"]) <= 0.02, t["ttft_mean_later"] <= 0.5 * small["ttft_mean_later"],
              same(t, big) == "yes"]
        line = (f"target 2 (engine): {'PASS' if all(ok) else 'MISS'}: hit rate {t['hit_rate']:.4f} against one "
                f"pool's {big['hit_rate']:.4f} (within 2 points: {ok[0]}); mean TTFT turns >= 2 "
                f"{t['ttft_mean_later']:.2f} s, {t['ttft_mean_later'] / small['ttft_mean_later']:.2f} of the "
                f"device only's {small['ttft_mean_later']:.2f} s (<= 0.5: {ok[1]}); greedy outputs equal one "
                f"pool's: {same(t, big)} (device only: {same(small, big)})")
    out, found = [*out, line], []
    for router in args.local_routers.split(","):
        _, local, glob = part_b_rows(rows, args, router)
        if local and glob:
            ratio = glob["hit_rate"] / local["hit_rate"]
            found.append(f"{router} x{ratio:.2f} ({'PASS' if abs(ratio / 2.22 - 1) <= 0.25 else 'MISS'})")
    return out + [f"target 3 (global / local within 25% of Mooncake's x2.22): {'; '.join(found)}" if found else
                  "target 3: not checked (no part (b) rows: Mooncake's trace absent or part b not run)"]


# ---------------------------------------------------------------------------------------------- figures

def draw(rows: list[dict], out: Path, router: str) -> list[Path]:
    """The figures of part (a) (its router's runs and the references) and of part (c)."""
    arms, sim = {r["arm"] for r in rows}, [r for r in rows if r["arm"] == "references" or r.get("router") == router]
    return ([save_figure(plot_capacity(sim), out / "hit_rate_vs_capacity.png")] if "tiered" in arms else []) + \
        ([save_figure(plot_engine(rows), out / "engine_ttft_by_turn.png")] if "engine" in arms else [])


def _tiered(rows: list[dict], w: str, k: int, policy: str, ys: str) -> list:
    """(device capacities, ``ys``) of the tiered runs at host ratio ``k`` under ``policy``, router told all."""
    pts = sorted((r["capacity_tokens"], r[ys]) for r in rows if r["workload_name"] == w and r["arm"] == "tiered"
                 and r["write_policy"] == policy and r["host_capacity_tokens"] == k * r["capacity_tokens"]
                 and r["router_params"].get("capacity_tokens", 0) in (0, (1 + k) * r["capacity_tokens"]))
    return list(zip(*pts, strict=True))


def _panel(ax, rows: list[dict], w: str, k: int, ys: str) -> None:
    """One workload at host ratio ``k``: the write policies, the single tiers and (hit rate) the references."""
    for i, p in enumerate(WRITE_POLICIES):
        if pts := _tiered(rows, w, k, p, ys):
            ax.plot(*pts, marker="os^"[i], color=f"C{i}", label=p)
    single = {r["capacity_tokens"]: r[ys] for r in rows if r["workload_name"] == w and r["arm"] == "single"}
    for mult, style, label in ((1, "k-", "device alone"), (1 + k, "k--", "single tier, device x (1 + r)"),
                               (k, "k:", "single tier, device x r (the host's size)")):
        if pts := [(c, single[c * mult]) for c in WORKLOADS[w]["capacities"] if c * mult in single]:
            ax.plot(*zip(*pts, strict=True), style, lw=1, label=label)
    for name, color in (("pooled_belady", "C3"), ("upper_bound", "C7")) if ys == "hit_rate" else ():
        if pts := sorted((r["capacity_tokens"], r[name]) for r in rows if r["workload_name"] == w
                         and r["arm"] == "references" and r.get(name) is not None):
            ax.plot(*zip(*pts, strict=True), "-.", color=color, lw=1, label=f"{name.replace('_', ' ')} (pooled device)")
    ax.set(xscale="log", xlabel="device tokens per replica", ylabel="hit rate" if ys == "hit_rate" else "mean TTFT (s)")
    ax.set_xticks(WORKLOADS[w]["capacities"], [f"{c / 1000:g}k" for c in WORKLOADS[w]["capacities"]], minor=False)
    ax.minorticks_off()
    ax.set_title(f"{w}, host = {k} x device" + ("" if ys == "hit_rate" else ": TTFT"), fontsize=9)


def plot_capacity(rows: list[dict]):
    """Rows: workloads. Columns: hit rate against device capacity at each host ratio, then mean TTFT at 4."""
    ratios = sorted({r["host_capacity_tokens"] // r["capacity_tokens"] for r in rows if r["arm"] == "tiered"})
    shown = [w for w in WORKLOADS if any(r["workload_name"] == w and r["arm"] == "tiered" for r in rows)]
    fig = Figure(figsize=(4 * len(ratios) + 4, 3.3 * len(shown)))
    axes = fig.subplots(len(shown), len(ratios) + 1, squeeze=False)
    for ax_row, w in zip(axes, shown, strict=True):
        for ax, k in zip(ax_row[:-1], ratios, strict=True):
            _panel(ax, rows, w, k, "hit_rate")
        _panel(ax_row[-1], rows, w, 4 if 4 in ratios else ratios[-1], "ttft_mean")
    fig.tight_layout()  # the first panel has every line
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4,
               fontsize=8, frameon=False)
    return fig


def plot_engine(rows: list[dict]):
    fig = Figure(figsize=(5.5, 3.6))
    ax = fig.subplots()
    for i, r in enumerate(engines(rows).values()):
        turns = sorted(int(k.removeprefix("ttft_mean_t")) for k in r if k.startswith("ttft_mean_t"))
        ax.plot(turns, [r[f"ttft_mean_t{t}"] for t in turns], marker="o", color=f"C{i}",
                label=f"{r['engine']}: hit rate {r['hit_rate']:.2f}")
    ax.set(xlabel="turn", ylabel="mean TTFT (s)", title="the engine on the main job's workload", xticks=turns)
    ax.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    run_cli(main)
