"""Eviction policies between LRU and Belady: hit rate, prefill saved and TTFT on Mooncake and synthetic workloads.

``python -m experiments.eviction --out docs/figures/eviction`` runs every online policy of
``radixkv.cache.eviction.POLICIES`` and Belady's clairvoyant reference (radix only) on Mooncake's conversation
trace (``--trace``; skipped with a message where it is absent; page / block 512, device capacities 1M-8M
tokens) and on the multi-turn, shared-prefix and few-shot workloads (page / block 16, four capacities each, as
fractions of its distinct tokens), in a radix and a hash cache, alone (``one``) and above a host tier of 4 x the
device (``host``, write_through; its Belady reference is one radix cache of device + host tokens). Saved
prefill seconds and TTFT p50 / p99 come from a run under ``--cost-preset``; hit rates from a run under
simulate's default ``CostModel()`` (the targets' definition) on the synthetic workloads and Mooncake's one-tier
radix rows; Mooncake's other rows take the preset run's (within 0.003 there: docs/eviction.md). ``cost`` gets the
preset's prefill constants, every other policy its defaults. Each number is also a share of the way from LRU to
Belady: (x - LRU) / (Belady - LRU), for TTFT (LRU - x) / (LRU - Belady); "-" where Belady equals LRU.

One row per (workload, cache, tiers, capacity, policy) in ``OUT/eviction.jsonl`` with its full config and each
simulate call's results and seconds; a rerun skips the rows there (``--redo-policies learned`` drops a policy's
rows first). Ray tasks (``--no-ray``: this process); then the best online policy's simulate time against LRU's
on Mooncake 4M, back to back in this process. Writes ``OUT/config.json``, ``OUT/tables.md`` (as printed) and two
figures; prints the targets, PASS or MISS.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from matplotlib.figure import Figure

from experiments import sweep
from experiments.block_size import distinct_tokens
from experiments.common import DEFAULT_TRACE, environment, fractions_from, names_from, parser, run_cli, save_figure
from radixkv.bounds import upper_bound
from radixkv.cache.eviction import POLICIES, make_policy
from radixkv.cost import COST_PRESETS
from radixkv.sim import CostModel, simulate

# name -> sizes (synthetic), page / block size, device capacities: Mooncake's in tokens, the others' as fractions
# of their distinct tokens (where LRU falls short of an unlimited cache and, mostly, of Belady).
WORKLOADS = {
    "mooncake": {"sizes": None, "page_size": 512, "capacities": (1_000_000, 2_000_000, 4_000_000, 8_000_000)},
    # vLLM's multi-turn shape, 64 sessions 0.5 s apart, 5 s between an answer and the next turn: 959 requests
    "multi_turn": {"sizes": {"preset": "vllm", "sessions": 64, "session_gap": 0.5, "think_time": 5.0},
                   "page_size": 16, "fractions": (0.3, 0.4, 0.5, 0.6)},
    # SGLang's generated shared prefix: 64 groups of 16 questions behind 1,000-3,000-token system prompts
    "shared_prefix": {"sizes": {"groups": 64, "prompts_per_group": 16, "system_tokens": [1000, 3000],
                                "question_tokens": [64, 256], "output_tokens": [64, 256], "rate": 16},
                      "page_size": 16, "fractions": (0.1, 0.2, 0.3, 0.4)},
    # MMLU-style 5-shot prefixes: 32 subjects x 16 questions, all sent at once
    "few_shot": {"sizes": {"subjects": 32, "questions_per_subject": 16}, "page_size": 16,
                 "fractions": (0.1, 0.2, 0.3, 0.4)},
}
QUICK = {"multi_turn": {"preset": "vllm", "sessions": 6, "turns": [3, 4], "session_gap": 0.5, "think_time": 5.0},
         "shared_prefix": {"groups": 6, "prompts_per_group": 4, "system_tokens": [200, 400], "rate": 16,
                           "question_tokens": [16, 32], "output_tokens": [8, 16]},
         "few_shot": {"subjects": 4, "questions_per_subject": 4}}  # --quick: tiny synthetic workloads
RESULTS = "eviction.jsonl"
HOST_RATIO = 4  # host tier = 4 x device
TIERS, CACHES = ("one", "host"), ("radix", "hash")
TARGET_CAPS = (4_000_000, 1_000_000)  # Mooncake's target capacities: the best policy is chosen at the first
METRICS = (("hit_rate", False), ("saved_prefill_s", False), ("ttft_p50", True), ("ttft_p99", True))  # lower better?


def parse_args(argv: list[str] | None = None):
    p = parser(__doc__.splitlines()[0], "docs/figures/eviction")
    p.description += " --out is a directory."
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (.jsonl); skipped if absent")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {list(WORKLOADS)}")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="online eviction policies (lru, and belady as the reference, always run)")
    p.add_argument("--redo-policies", default="", help="drop these policies' rows and timings first (their code "
                   "changed), then run them again; default none")
    p.add_argument("--caches", default=",".join(CACHES), help="prefix caches: radix, hash")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"one: the device alone; host: a host tier of "
                   f"{HOST_RATIO} x the device below it (write_through)")
    p.add_argument("--mooncake-capacities", default=",".join(str(c) for c in WORKLOADS["mooncake"]["capacities"]),
                   help="Mooncake's device capacities (tokens)")
    p.add_argument("--fractions", default=None, help="the synthetic device capacities as fractions of each "
                   "workload's distinct tokens (default: each workload's own, in WORKLOADS)")
    p.add_argument("--cost-preset", default="llama3-8b-h100", choices=sorted(COST_PRESETS),
                   help="the GPU cost model of the TTFT and saved-prefill columns, and of cost's parameters")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload")
    p.add_argument("--quick", action="store_true", help="tiny synthetic workloads (a smoke test in seconds)")
    p.add_argument("--timing-repeats", type=int, default=3,
                   help="runs each of LRU and the best policy on Mooncake 4M for the time target (0: skip)")
    sweep.add_ray_flags(p)
    args = p.parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.timing_repeats < 0:
        p.error("--limit must be >= 1 and --timing-repeats >= 0")
    return args


# ---------------------------------------------------------------------------------------------- the grid

def device_capacities(args, name: str, requests) -> list[tuple[int, float | None]]:
    """(device tokens, fraction of the distinct tokens or None): Mooncake's as given, the others' from fractions,
    in whole pages and at least the longest request's KV (a shorter cache would reject it)."""
    if name == "mooncake":
        return [(int(c), None) for c in fractions_from(args.mooncake_capacities, "--mooncake-capacities")]
    page = WORKLOADS[name]["page_size"]
    fracs = fractions_from(args.fractions, "--fractions") if args.fractions else WORKLOADS[name]["fractions"]
    distinct, longest = distinct_tokens(requests), max(len(r.prompt) + r.output_len for r in requests)
    return [(max(int(f * distinct) // page * page, -(-longest // page) * page), f) for f in fracs]


def run_entry(base: dict, name: str, cache: str, tiers: str, device: int, frac, policy: str, cost: CostModel,
              default_too: bool) -> dict:
    """One configuration; Belady's of a tiered group is one radix cache of device + host tokens. ``cost`` gets the
    preset's prefill constants, every other policy its defaults."""
    reference = policy == "belady" and tiers == "host"
    models = {"default": asdict(CostModel())} if default_too else {}
    params = {"prefill_per_token": cost.prefill_per_token, "attention_per_pair": cost.attention_per_pair}
    return {**base, "kind": "run", "workload_name": name, "cache": cache, "tiers": tiers, "device_tokens": device,
            "capacity_fraction": frac, "capacity_tokens": device * (1 + HOST_RATIO) if reference else device,
            "host_capacity_tokens": HOST_RATIO * device if tiers == "host" and not reference else None,
            "write_policy": "write_through" if tiers == "host" and not reference else None,
            "eviction_policy": policy, "eviction_params": params if policy == "cost" else {},
            "cost_models": {**models, base["cost_preset"]: asdict(cost)}}


def workload_grid(args, name: str, spec: dict, requests) -> list[dict]:
    """The upper bound, then per tiers, capacity, cache and policy one run (Belady once per tiers and capacity),
    the slowest first (hash, tiered, two cost models), so the tasks pack well."""
    page, cost = WORKLOADS[name]["page_size"], CostModel.preset(args.cost_preset)
    base = {"workload": spec, "page_size": page, "block_size": page, "cost_preset": args.cost_preset,
            "seed": args.seed}
    policies = list(dict.fromkeys(["lru", *names_from(args.policies, POLICIES, "--policies")]))
    caches, tiers = names_from(args.caches, CACHES, "--caches"), names_from(args.tiers, TIERS, "--tiers")
    runs = []
    for t in tiers:
        for device, frac in device_capacities(args, name, requests):
            for cache in caches:
                both = name != "mooncake" or (cache == "radix" and t == "one")
                runs += [run_entry(base, name, cache, t, device, frac, p, cost, both) for p in policies]
            both = name != "mooncake" or t == "one"
            runs.append(run_entry(base, name, "radix", t, device, frac, "belady", cost, both))
    runs.sort(key=lambda c: -len(c["cost_models"]) * (1 + (c["cache"] == "hash")) * (1 + (c["tiers"] == "host")))
    return [{"kind": "bound", "workload": spec, "workload_name": name, "page_size": page}, *runs]


def grids(args) -> dict[str, tuple[dict, list[dict], list | None]]:
    """workload name -> (its spec, its configurations, its requests if loaded); Mooncake only where its trace is."""
    out = {}
    for name in names_from(args.workloads, WORKLOADS, "--workloads"):
        if name == "mooncake":
            if not sweep.trace_present(args.trace):
                continue
            spec, requests = sweep.workload_spec(trace=args.trace, limit=args.limit), None
        else:
            sizes = (QUICK if args.quick else {k: w["sizes"] for k, w in WORKLOADS.items()})[name]
            spec = sweep.workload_spec(workload=name, sizes=sizes, seed=args.seed, limit=args.limit)
            requests = sweep.load_workload(spec)
        out[name] = spec, workload_grid(args, name, spec, requests), requests
    if not out:
        raise ValueError("no workload to run (Mooncake's trace is absent and no synthetic workload was chosen)")
    return out


def settings_of(config: dict) -> dict:
    """``simulate``'s keywords of a run configuration (no eviction_params for Belady, no tier without one)."""
    out = {k: config[k] for k in ("cache", "page_size", "block_size", "capacity_tokens", "eviction_policy", "seed")}
    if config["eviction_params"]:
        out["eviction_params"] = config["eviction_params"]
    if config["host_capacity_tokens"]:
        out.update(host_capacity_tokens=config["host_capacity_tokens"], write_policy=config["write_policy"])
    return out


def simulate_once(requests, config: dict, cost: dict) -> dict:
    """One simulate call: hit rate, saved prefill seconds, TTFT, what it evicted, its wall seconds."""
    t0 = time.perf_counter()
    res = simulate(requests, cost_model=CostModel.from_dict(cost), **settings_of(config))
    seconds, s = time.perf_counter() - t0, res.summary()
    keep = ("hit_rate", "ttft_mean", "ttft_p50", "ttft_p99", "hit_rate_by_tier", "evicted_tokens", "rejected",
            "makespan", "loaded_tokens")
    return {**{k: s[k] for k in keep}, "saved_prefill_s": getattr(res, "saved_prefill_s", None), "seconds": seconds}


def run_config(requests, config: dict) -> dict:
    """A configuration's row: key, config, each cost model's run (``runs``) and the flat columns: hit rate (the
    default cost model's run where there is one), saved prefill and TTFT (the preset's), the preset run's wall
    seconds."""
    t0 = time.perf_counter()
    if config["kind"] == "bound":
        return {"key": sweep.key(config), "config": config, "upper_bound": upper_bound(requests, config["page_size"]),
                "seconds": time.perf_counter() - t0}
    runs = {name: simulate_once(requests, config, cost) for name, cost in config["cost_models"].items()}
    gpu = runs[config["cost_preset"]]
    hit_model = "default" if "default" in runs else config["cost_preset"]
    policy = {"name": "belady"} if config["eviction_policy"] == "belady" else \
        make_policy(config["eviction_policy"], **config["eviction_params"]).describe()
    return {"key": sweep.key(config), "config": config, "hit_rate": runs[hit_model]["hit_rate"],
            "hit_rate_cost_model": hit_model, "saved_prefill_s": gpu["saved_prefill_s"], "ttft_p50": gpu["ttft_p50"],
            "ttft_p99": gpu["ttft_p99"], "seconds": gpu["seconds"], "policy": policy, "runs": runs,
            "seconds_total": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- running

def drop_policies(path: Path, names: list[str]) -> int:
    """Remove ``names``' run and timing rows from the results file (to rerun them); how many were dropped."""
    rows = sweep.read_results(path)
    keep = [r for r in rows if r["config"].get("eviction_policy", r["config"].get("policy")) not in names]
    if len(keep) < len(rows):
        path.with_name(path.name + ".tmp").write_text("".join(sweep.result_line(r) for r in keep))
        path.with_name(path.name + ".tmp").replace(path)
    return len(rows) - len(keep)


def run_simulations(args, todo: dict, path: Path) -> list[str]:
    rows = sweep.read_results(path)
    pending = {name: (spec, sweep.pending(configs, rows), reqs) for name, (spec, configs, reqs) in todo.items()}
    print(f"{sum(len(c) for _, c, _ in todo.values())} configurations, "
          f"{sum(len(c) for _, c, _ in pending.values())} to run")
    failures: list[str] = []
    with contextlib.ExitStack() as stack:
        ray = None if args.no_ray or not any(c for _, c, _ in pending.values()) else \
            stack.enter_context(sweep.ray_session(args.ray_address, args.num_cpus))
        for name, (spec, configs, reqs) in pending.items():
            if configs:
                requests = reqs if reqs is not None else sweep.load_workload(spec, args.trace)
                _, failed = sweep.execute(requests, configs, path, ray, desc=name, run=run_config)
                failures += [f"{sweep.key(config)}: {error}" for config, error in failed]
    return failures


def timing(args, todo: dict, rows: list[dict], path: Path) -> dict | None:
    """The best online policy's simulate seconds against LRU's on Mooncake, one radix cache at 4M, default cost
    model: in this process, alternating, ``--timing-repeats`` each; reused from the file when already measured."""
    best = best_policy(rows)
    if best is None or not args.timing_repeats or "mooncake" not in todo:
        return None
    lru, mine = (find(rows, "mooncake", "radix", "one", TARGET_CAPS[0], p) for p in ("lru", best))
    config = {"kind": "timing", "workload": todo["mooncake"][0], "policy": best, "repeats": args.timing_repeats,
              "capacity_tokens": TARGET_CAPS[0], "eviction_params": mine["eviction_params"]}
    if done := [r for r in sweep.read_results(path) if r["key"] == sweep.key(config)]:
        return done[0]
    requests = sweep.load_workload(todo["mooncake"][0], args.trace)
    seconds: dict[str, list[float]] = {"lru": [], "policy": []}
    for _ in range(args.timing_repeats):
        for p, c in (("lru", lru), ("policy", mine)):
            seconds[p].append(simulate_once(requests, {**c["config"], "eviction_params": c["eviction_params"]},
                                            asdict(CostModel()))["seconds"])
    med = {p: statistics.median(s) for p, s in seconds.items()}
    row = {"key": sweep.key(config), "config": config, "seconds": seconds, "median_lru_s": med["lru"],
           "median_policy_s": med["policy"], "ratio": med["policy"] / med["lru"], "requests": len(requests),
           "us_per_request": {p: 1e6 * m / len(requests) for p, m in med.items()}, "env": environment()}
    with path.open("a") as f:
        f.write(sweep.result_line(row))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    if args.redo_policies:
        redo = names_from(args.redo_policies, POLICIES, "--redo-policies")
        print(f"dropped {drop_policies(path, redo)} row(s) of {', '.join(redo)} from {path}")
    todo = grids(args)
    sweep.write_config(out / "config.json", {
        "workloads": {n: {"spec": spec, "page_size": WORKLOADS[n]["page_size"], "device_tokens": sorted(
            {c["device_tokens"] for c in cs if c["kind"] == "run"})} for n, (spec, cs, _) in todo.items()},
        "host_ratio": HOST_RATIO, "write_policy": "write_through", "cost_preset": args.cost_preset,
        "cost_model": asdict(CostModel.preset(args.cost_preset)), "hit_rate_cost_model": asdict(CostModel())},
        {"args": vars(args), "env": environment()})
    t0 = time.perf_counter()
    failures = run_simulations(args, todo, path)
    wanted = {sweep.key(c) for _, cs, _ in todo.values() for c in cs}
    rows = [{**r["config"], **r} for r in sweep.read_results(path) if r["key"] in wanted]
    timed = timing(args, todo, rows, path)
    print(f"ran in {time.perf_counter() - t0:.0f} s; {sum(r['seconds'] for r in rows):.0f} s of runs in the file")
    text, checks = tables(rows, list(todo), timed), targets(rows, timed)
    print(text, *checks, sep="\n")
    (out / "tables.md").write_text(text + "\n\n" + "".join(f"- {c}\n" for c in checks))
    print("wrote", path, *draw(rows, list(todo), out))
    if failures:
        raise SystemExit(f"{len(failures)} configuration(s) failed; rerun the same command to retry them")
    return rows


def find(rows: list[dict], w: str, cache: str, tiers: str, device: int, policy: str) -> dict | None:
    for r in rows:
        if r["kind"] == "run" and (r["workload_name"], r["cache"], r["tiers"], r["device_tokens"],
                                   r["eviction_policy"]) == (w, cache, tiers, device, policy):
            return r
    return None


def metric(r: dict, name: str, model: str) -> float | None:
    """``name`` of ``r``'s run under ``model`` (hit rate) or the preset (the rest), else its preset run's."""
    run = r["runs"].get(model if name == "hit_rate" else r["cost_preset"]) or r["runs"][r["cost_preset"]]
    return run.get(name)


def share(r: dict, lru: dict | None, bel: dict | None, name: str, lower: bool) -> float | None:
    """How far ``r`` went from LRU toward Belady in ``name`` (None: a reference missing, or Belady = LRU)."""
    if lru is None or bel is None:
        return None
    model = r["hit_rate_cost_model"]
    x, a, b = (metric(q, name, model) for q in (r, lru, bel))
    if x is None or a is None or b is None or abs(b - a) <= 1e-12 * max(abs(a), 1.0):
        return None
    return (a - x) / (a - b) if lower else (x - a) / (b - a)


def shares(rows: list[dict], r: dict) -> dict[str, float | None]:
    refs = [find(rows, r["workload_name"], c, r["tiers"], r["device_tokens"], p)
            for c, p in ((r["cache"], "lru"), ("radix", "belady"))]
    return {name: share(r, *refs, name, lower) for name, lower in METRICS}


def online_at(rows: list[dict], device: int) -> list[dict]:
    """The online policies' rows on Mooncake, one radix cache of ``device`` tokens, the highest hit rate first."""
    return sorted((r for r in rows if r["kind"] == "run" and r["eviction_policy"] != "belady" and (
        r["workload_name"], r["cache"], r["tiers"], r["device_tokens"]) == ("mooncake", "radix", "one", device)),
        key=lambda r: -r["hit_rate"])


def best_policy(rows: list[dict]) -> str | None:
    """The online policy of the highest hit rate on Mooncake, one radix cache at 4M (None: no such rows)."""
    return next((r["eviction_policy"] for r in online_at(rows, TARGET_CAPS[0])), None)


# ---------------------------------------------------------------------------------------------- tables

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{round(100 * x) or 0}%"  # no "-0%"


def _raw(r: dict) -> str:
    num = [("-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}")
           for x in (r.get("saved_prefill_s"), r["ttft_p50"], r["ttft_p99"])]
    return f"{num[0]} s; {num[1]} / {num[2]} s"


def group_table(rows: list[dict], w: str, cache: str, tiers: str) -> list[str]:
    devices = sorted({r["device_tokens"] for r in rows if r["kind"] == "run" and r["workload_name"] == w})
    policies = [p for p in ["lru", *POLICIES] if any(find(rows, w, cache, tiers, d, p) for d in devices)]
    if not policies:
        return []
    out = [f"### {w}: {cache}, {'device + host x4 (write_through)' if tiers == 'host' else 'one tier'}", "",
           "| policy | " + " | ".join(f"{d:,} | shares" for d in devices) + " |",
           "| --- |" + " ---: | ---: |" * len(devices)]
    for p in [*dict.fromkeys(policies), "belady"]:
        cells = []
        for d in devices:
            r = find(rows, w, "radix" if p == "belady" else cache, tiers, d, p)
            s = shares(rows, r) if r and p not in ("lru", "belady") else {}
            cells += ["", ""] if r is None else [f"{r['hit_rate']:.4f}", _raw(r) if p in ("lru", "belady") else
                                                 " / ".join(_pct(s[m]) for m, _ in METRICS)]
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return [*out, ""]


def tables(rows: list[dict], workloads: list[str], timed: dict | None) -> str:
    preset = next((r["cost_preset"] for r in rows if r["kind"] == "run"), "the GPU preset")
    parts = [f"Per device capacity (tokens): the hit rate, then the share of the LRU -> Belady gap closed in hit rate "
             f"/ saved prefill / TTFT p50 / TTFT p99 under {preset} (the LRU and Belady rows: saved prefill s; TTFT "
             "p50 / p99 s). Belady: one radix cache; for a host tier, one radix cache of device + host tokens.", ""]
    for w in workloads:
        bound = next((r for r in rows if r["kind"] == "bound" and r["workload_name"] == w), None)
        parts += [f"## {w}" + (f" (upper bound {bound['upper_bound']:.4f})" if bound else ""), ""]
        for tiers in TIERS:
            for cache in CACHES:
                parts += group_table(rows, w, cache, tiers)
    both = [r for r in rows if r["kind"] == "run" and r["workload_name"] == "mooncake" and len(r["runs"]) == 2]
    if both:  # Mooncake's rows run under both cost models: how far apart their hit rates are
        diff = max(abs(r["runs"]["default"]["hit_rate"] - r["runs"][preset]["hit_rate"]) for r in both)
        parts += [f"Mooncake: {len(both)} configurations ran under both CostModel() and {preset}: the largest "
                  f"hit-rate difference is {diff:.5f}.", ""]
    if timed:
        us = timed["us_per_request"]
        parts.append(f"Simulate time, Mooncake 4M, one radix cache, CostModel(), median of {timed['config']['repeats']}"
                     f": lru {timed['median_lru_s']:.2f} s ({us['lru']:.0f} us / request), {timed['config']['policy']} "
                     f"{timed['median_policy_s']:.2f} s ({us['policy']:.0f} us / request).")
    return "\n".join(parts).rstrip()


def gap_target(rows: list[dict], n: int, best: str, device: int) -> str:
    lru, bel, mine = (find(rows, "mooncake", "radix", "one", device, p) for p in ("lru", "belady", best))
    what = f"target {n} (Mooncake, one radix cache page 512, {device / 1e6:g}M: the best online policy closes >= 25% " \
           f"of the LRU -> Belady hit-rate gap)"
    if not (lru and bel and mine):
        return f"{what}: not checked (no rows)"
    s = share(mine, lru, bel, "hit_rate", False)
    verdict = "MISS (Belady = LRU)" if s is None else "PASS" if s >= 0.25 else "MISS"
    rivals = online_at(rows, device)
    return (f"{what}: {verdict}: {best} {mine['hit_rate']:.4f} against LRU {lru['hit_rate']:.4f} and Belady "
            f"{bel['hit_rate']:.4f}: {_pct(s)} of the gap (best here: {rivals[0]['eviction_policy']} "
            f"{rivals[0]['hit_rate']:.4f}, {_pct(share(rivals[0], lru, bel, 'hit_rate', False))})")


def synthetic_target(rows: list[dict], best: str) -> str:
    what = f"target 3 ({best} not below LRU by more than 0.01 hit rate on multi_turn, shared_prefix, few_shot, at " \
           f"every capacity, cache and tiers)"
    deltas = []
    for r in rows:
        if r["kind"] == "run" and r["eviction_policy"] == best and r["workload_name"] != "mooncake":
            lru = find(rows, r["workload_name"], r["cache"], r["tiers"], r["device_tokens"], "lru")
            if lru:
                deltas.append((r["hit_rate"] - lru["hit_rate"], r))
    if not deltas:
        return f"{what}: not checked (no synthetic rows)"
    worst, r = min(deltas, key=lambda x: x[0])
    radix = [d for d, q in deltas if (q["cache"], q["tiers"]) == ("radix", "one")]
    alone = f"; one radix cache alone: worst {min(radix):+.4f}" if radix else ""
    return (f"{what}: {'PASS' if worst >= -0.01 else 'MISS'}: worst {worst:+.4f} ({r['workload_name']}, {r['cache']}, "
            f"{r['tiers']}, {r['device_tokens']:,}) over {len(deltas)} configurations, "
            f"{sum(d < -0.01 for d, _ in deltas)} below -0.01{alone}")


def targets(rows: list[dict], timed: dict | None) -> list[str]:
    best = best_policy(rows)
    if best is None:
        return ["targets 1-4: not checked (no Mooncake rows at 4M, one radix cache: the trace is absent)"]
    out = [f"best online policy (highest hit rate, Mooncake 4M, one radix cache): {best}",
           *(gap_target(rows, i + 1, best, d) for i, d in enumerate(TARGET_CAPS)), synthetic_target(rows, best)]
    if timed is None:
        return [*out, "target 4 (simulate time at most 2x LRU's): not checked (--timing-repeats 0)"]
    return [*out, f"target 4 ({best}'s simulate time at most 2x LRU's, Mooncake 4M, median of "
                  f"{timed['config']['repeats']} back to back): {'PASS' if timed['ratio'] <= 2 else 'MISS'}: "
                  f"x{timed['ratio']:.2f} ({timed['median_policy_s']:.2f} s against {timed['median_lru_s']:.2f} s)"]


# ---------------------------------------------------------------------------------------------- figures

def draw(rows: list[dict], workloads: list[str], out: Path) -> list[Path]:
    shown = [w for w in workloads if any(r["kind"] == "run" and r["workload_name"] == w for r in rows)]
    paths = [save_figure(plot_capacity(rows, shown), out / "hit_rate_vs_capacity.png")] if shown else []
    if any(r["kind"] == "run" and r["workload_name"] == "mooncake" for r in rows):
        paths.append(save_figure(plot_shares(rows), out / "share_of_gap_mooncake.png"))
    return paths


def plot_capacity(rows: list[dict], shown: list[str]):
    """Rows: workloads; columns: (cache, tiers). Hit rate against the device capacity, a line per policy, Belady
    dashed, the upper bound dotted."""
    combos = [(c, t) for t in TIERS for c in CACHES if any(r["kind"] == "run" and r["eviction_policy"] != "belady"
                                                           and (r["cache"], r["tiers"]) == (c, t) for r in rows)]
    fig = Figure(figsize=(4.2 * len(combos), 3.3 * len(shown)))
    axes = fig.subplots(len(shown), len(combos), squeeze=False)
    extra = ("olive", "teal", "navy", "maroon", "gold", "indigo", "sienna", "lime")  # past the ten default colours
    colors = {p: f"C{i}" if i < 10 else extra[(i - 10) % len(extra)] for i, p in enumerate(POLICIES)}
    for ax_row, w in zip(axes, shown, strict=True):
        mine = [r for r in rows if r["workload_name"] == w]
        for ax, (cache, tiers) in zip(ax_row, combos, strict=True):
            for p in [*POLICIES, "belady"]:  # Belady: the radix cache's, in every panel
                if pts := sorted((r["device_tokens"], r["hit_rate"]) for r in mine if r["kind"] == "run" and (
                        r["cache"] == cache or p == "belady") and (r["tiers"], r["eviction_policy"]) == (tiers, p)):
                    ax.plot(*zip(*pts, strict=True), "--" if p == "belady" else ".-", color=colors.get(p, "k"),
                            lw=1.6 if p in ("lru", "belady") else 0.8, label="belady (radix)" if p == "belady" else p)
            for r in (r for r in mine if r["kind"] == "bound"):
                ax.axhline(r["upper_bound"], color="grey", ls=":", label="upper bound")
            caps = sorted({r["device_tokens"] for r in mine if r["kind"] == "run"})
            ax.set(xscale="log", xlabel="device tokens", ylabel="hit rate",
                   title=f"{w}: {cache}, {'host x4' if tiers == 'host' else 'one tier'}")
            ax.set_xticks(caps, [f"{c / 1e6:g}M" if c >= 1e6 else f"{c:,}" for c in caps])
            ax.minorticks_off()
            ax.title.set_fontsize(9)
    handles = {}
    for ax in axes.flat:
        handles.update(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.tight_layout()
    fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=8,
               fontsize=8, frameon=False)
    return fig


def plot_shares(rows: list[dict]):
    """Mooncake, one radix cache: each online policy's share of the LRU -> Belady gap in hit rate and TTFT p99,
    one panel per capacity."""
    mine = [r for r in rows if r["kind"] == "run" and r["workload_name"] == "mooncake"]
    devices = sorted({r["device_tokens"] for r in mine})
    policies = [p for p in POLICIES if p != "lru" and any(r["eviction_policy"] == p for r in mine)]
    fig = Figure(figsize=(3.6 * len(devices), 4.4))
    axes = fig.subplots(1, len(devices), squeeze=False, sharey=True)[0]
    for ax, d in zip(axes, devices, strict=True):
        found = [(p, shares(rows, r) if (r := find(rows, "mooncake", "radix", "one", d, p)) else {}) for p in policies]
        ys = range(len(found))
        for k, (m, color) in enumerate((("hit_rate", "C0"), ("ttft_p99", "C1"))):
            ax.barh([y + 0.2 - 0.4 * k for y in ys], [100 * (s.get(m) or 0) for _, s in found], height=0.4, color=color,
                    label="hit rate" if m == "hit_rate" else "TTFT p99")
        ax.set_yticks(list(ys), [p for p, _ in found])
        ax.axvline(0, color="k", lw=0.8)
        ax.axvline(25, color="grey", ls=":", lw=0.8)
        lru, bel = (find(rows, "mooncake", "radix", "one", d, p) or {"hit_rate": 0} for p in ("lru", "belady"))
        ax.set(xlabel="% of the LRU -> Belady gap",
               title=f"Mooncake, radix 512, {d / 1e6:g}M\nLRU {lru['hit_rate']:.3f}, Belady {bel['hit_rate']:.3f}")
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    run_cli(main)
