"""A grid of simulated clusters (routers x replica counts x capacities x policies), run as Ray tasks.

``python -m experiments.sweep --trace ../shared/traces/conversation_trace.jsonl --routers affinity,cache_aware
--replicas 1,2,4,8,16 --capacities 4e6 --pooled --out results/sweep`` loads the workload once, puts it in
Ray's object store, runs every configuration of the grid as one task (``radixkv.sim.simulate_cluster``) and
appends one JSON line per finished configuration to ``DIR/sweep.jsonl`` as it finishes: its ``key`` (the
configuration as stable JSON), the ``config`` itself, the run's summary and the seconds it took. A second
run with the same flags skips every configuration whose key is already in the file, so an interrupted sweep
resumes where it stopped and a deleted line is redone alone. The references no routing can beat (the
workload's upper bound, one pooled cache under LRU and Belady: ``cluster_references``) are computed once
per (N, capacity, schedule policy) as tasks of their own and stored as rows of ``kind`` ``references``;
``joined`` attaches them to the router rows. ``DIR/config.json`` records the flags, the grid and the
environment. ``--ray-address`` joins a running cluster (whose nodes have radixkv installed); otherwise a
local Ray of ``--num-cpus`` (all cores) is started and shut down at the end; ``--no-ray`` runs in this
process, one configuration after the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from experiments.common import (
    DEFAULT_TRACE,
    _finite,
    _jsonable,
    add_settings,
    environment,
    fractions_from,
    names_from,
    parser,
    run_cli,
)
from radixkv import workloads
from radixkv.cache.eviction import POLICIES as _EVICTIONS
from radixkv.routing import ROUTERS, make_router
from radixkv.scheduling.policies import POLICIES as SCHEDULE_POLICIES
from radixkv.sim import CostModel, simulate_cluster
from radixkv.sim.cluster import cluster_references
from radixkv.workloads.request import Request

RESULTS = "sweep.jsonl"
CONFIG = "config.json"
# the fields of a router run that its references depend on (all but the router and the online eviction policy)
REFERENCE_FIELDS = ("workload", "replicas", "capacity_tokens", "cache", "page_size", "block_size", "schedule_policy",
                    "max_running", "cost_model", "seed")
REFERENCE_NAMES = ("upper_bound", "pooled_lru", "pooled_belady")
EVICTION_POLICIES = tuple(e for e in _EVICTIONS if e != "belady")  # online ones: belady is a reference


# ---------------------------------------------------------------------------------------------- the workload

def workload_spec(trace: str | None = None, workload: str | None = None, sizes: dict | None = None, seed: int = 0,
                  limit: int | None = None) -> dict:
    """What names a workload in a configuration (and so in its key): Mooncake's trace by file name and size
    (the path itself may differ between machines), or a synthetic workload by name, seed and sizes."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if trace is not None:
        path = Path(trace)
        if not path.is_file():
            raise FileNotFoundError(f"Mooncake trace not found at {path} (see shared/traces/README.md)")
        return {"name": "mooncake", "trace": path.name, "trace_bytes": path.stat().st_size, "limit": limit}
    if workload not in workloads.WORKLOADS:
        raise ValueError(f"--workload: unknown {workload!r}; choose from {', '.join(workloads.WORKLOADS)}")
    return {"name": workload, "seed": seed, "sizes": dict(sizes or {}), "limit": limit}


def trace_present(path: str | Path, what: str = "mooncake") -> bool:
    """Whether the Mooncake trace at ``path`` exists; where it does not, says that ``what`` is skipped."""
    if Path(path).is_file():
        return True
    print(f"skipping {what}: no trace at {path} (pass --trace PATH; see shared/traces/README.md)")
    return False


def load_workload(spec: dict, trace: str | None = None) -> list[Request]:
    """The requests ``spec`` names (``trace``: the Mooncake file's path), cut to its ``limit``: the first
    requests in arrival order (a turn's parent arrives before it, so the cut keeps every link)."""
    if spec["name"] == "mooncake":
        return workloads.mooncake(trace, spec["limit"])
    sizes = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["sizes"].items()}  # JSON lists: (lo, hi)
    requests = workloads.make(spec["name"], seed=spec["seed"], **sizes)
    return requests if spec["limit"] is None else requests[: spec["limit"]]


# ---------------------------------------------------------------------------------------------- the grid

def router_params(router: str, capacity_tokens: int | None, cache: str, page_size: int, block_size: int,
                  overrides: dict | None = None) -> dict:
    """A router's parameters in a cluster of these replicas: ``affinity`` is told the replicas' KV budget,
    ``kv_events`` indexes blocks of the replicas' own granularity; ``overrides`` (from ``--router-params``)
    win."""
    params: dict = {}
    if router == "affinity":
        params["capacity_tokens"] = capacity_tokens
    elif router == "kv_events":
        params["block_size"] = page_size if cache == "radix" else block_size
    return {**params, **(overrides or {}).get(router, {})}


def build_grid(workload: dict, routers: Sequence[str], shapes: Sequence[tuple[int, int | None]],
               schedule_policies: Sequence[str] = ("fcfs",), eviction_policies: Sequence[str] = ("lru",),
               cache: str = "radix", page_size: int = 16, block_size: int = 16, max_running: int = 64,
               cost_model: CostModel | None = None, seed: int = 0, overrides: dict | None = None) -> list[dict]:
    """Every configuration: for each (replicas, per-replica capacity) of ``shapes`` and schedule policy, one
    ``references`` row, then one ``run`` per router and eviction policy (references first: they take longest).
    Each router's parameters are checked here, before any task starts."""
    cost = asdict(cost_model or CostModel())
    refs, runs = [], []
    for replicas, capacity in shapes:
        for schedule in schedule_policies:
            base = {"workload": workload, "replicas": replicas, "capacity_tokens": capacity, "cache": cache,
                    "page_size": page_size, "block_size": block_size, "schedule_policy": schedule,
                    "max_running": max_running, "cost_model": cost, "seed": seed}
            refs.append({"kind": "references", **base})
            for router in routers:
                params = router_params(router, capacity, cache, page_size, block_size, overrides)
                make_router(router, **params)  # a bad parameter is a ValueError now, not in every task
                for eviction in eviction_policies:
                    runs.append({"kind": "run", **base, "router": router, "router_params": params,
                                 "eviction_policy": eviction})
    return refs + runs


def key(config: dict) -> str:
    """A configuration's identity: its JSON with sorted keys and no spaces (stable across runs and machines)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def reference_key(config: dict) -> str:
    """The key of the references row a router run is measured against."""
    return key({"kind": "references", **{f: config[f] for f in REFERENCE_FIELDS}})


# ---------------------------------------------------------------------------------------------- one task

def run_config(requests: Sequence[Request], config: dict) -> dict:
    """Run one configuration; the row to store: ``key``, ``config``, the summary (or the references) and the
    seconds it took. Pure: the same configuration gives the same row (but for the seconds)."""
    t0 = time.perf_counter()
    shared = dict(cache=config["cache"], page_size=config["page_size"], block_size=config["block_size"],
                  schedule_policy=config["schedule_policy"], max_running=config["max_running"],
                  cost_model=CostModel.from_dict(config["cost_model"]), seed=config["seed"])
    if config["kind"] == "references":
        result = cluster_references(requests, config["replicas"], config["capacity_tokens"], **shared)
    else:
        res = simulate_cluster(requests, replicas=config["replicas"], router=config["router"],
                               router_params=config["router_params"], capacity_tokens=config["capacity_tokens"],
                               eviction_policy=config["eviction_policy"], references=False, **shared)
        result = res.summary()
    return {"key": key(config), "config": config, **result, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- the results file

def read_results(path: str | Path) -> list[dict]:
    """The rows of a results file (none if it does not exist). A line that is not JSON (a write cut short by an
    interrupt) is dropped from the file, so appending after it stays valid."""
    path = Path(path)
    if not path.exists():
        return []
    rows, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    if bad:
        print(f"{path}: dropped {bad} unreadable line(s); their configurations will be rerun", file=sys.stderr)
        _write_lines(path, rows)
    return rows


def _write_lines(path: Path, rows: Iterable[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(result_line(r) for r in rows))
    tmp.replace(path)


def result_line(row: dict) -> str:
    """One results line, as ``write_rows`` writes them (NaN and infinities as null)."""
    return json.dumps(_finite(row), default=_jsonable, allow_nan=False) + "\n"


def write_config(path: Path, config: dict, invocation: dict) -> None:
    """``config.json``: ``config`` (what the results are of) and ``invocations``, every command that wrote to
    the results, oldest first (flags, environment, how many configurations it had to run)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**config, "invocations": [*old.get("invocations", []), invocation]}, indent=1,
                               default=str) + "\n")


def pending(configs: Sequence[dict], rows: Iterable[dict]) -> list[dict]:
    """The configurations not yet in ``rows`` (by key), in grid order, each once."""
    done = {r["key"] for r in rows}
    out, seen = [], set()
    for c in configs:
        k = key(c)
        if k not in done and k not in seen:
            seen.add(k)
            out.append(c)
    return out


# ---------------------------------------------------------------------------------------------- running

def provenance() -> dict:
    """What a row was computed by: ``git_commit`` and ``git_dirty`` (local changes to tracked files)."""
    env = environment()
    return {"git_commit": env["git_commit"], "git_dirty": env["git_dirty"]}


def commits_line(rows: Iterable[dict]) -> str:
    """One line saying which code the rows came from, so a table never mixes commits silently: the commit
    (and ``dirty`` where the tree had local changes) with its row count, ``unrecorded`` for rows from before
    rows recorded it; a warning first where there is more than one."""
    counts: dict[str, int] = {}
    for r in rows:
        commit = r.get("git_commit")
        name = "unrecorded" if commit is None else commit[:7] + (" dirty" if r.get("git_dirty") else "")
        counts[name] = counts.get(name, 0) + 1
    listed = ", ".join(f"{name} ({n} rows)" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"MIXED: rows from {len(counts)} versions of the code: {listed}" if len(counts) > 1
            else f"rows from {listed}")


def fresh_results(path: str | Path, resume: bool) -> None:
    """Refuse to add to a results file that holds rows unless ``resume`` (a rerun must not silently keep
    rows of other code): ``ValueError`` naming both ways out."""
    rows = read_results(path)
    if rows and not resume:
        raise ValueError(f"{path} already holds {len(rows)} rows ({commits_line(rows)}); pass --resume to add the "
                         f"missing ones to them, or choose a fresh --out")


def add_resume_flag(p) -> None:
    p.add_argument("--resume", action="store_true", help="add to the rows already in OUT, running only the missing "
                   "configurations (otherwise OUT must hold none)")


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None) -> Iterator:
    """Ray, initialized: joins ``address`` if given (shipping this ``experiments`` package to its workers;
    radixkv must be installed there), else starts a local instance of ``num_cpus`` (all cores); either is shut
    down afterwards. An instance already initialized by the caller is used as is and left up. Where Ray is not
    installed (the ``ray`` extra), None with a note: the configurations run in this process, one by one."""
    try:
        import ray
    except ImportError:
        if address:
            raise ValueError("--ray-address needs Ray: pip install 'radixkv[ray]'") from None
        print("Ray is not installed (pip install 'radixkv[ray]'): running the configurations here, one by one",
              file=sys.stderr)
        yield None
        return

    if ray.is_initialized():
        yield ray
        return
    if address:
        try:
            ray.init(address=address, runtime_env={"py_modules": [str(Path(__file__).resolve().parent)]})
        except ConnectionError as e:  # a wrong address (or, with token auth, no token): one line, exit status 2
            raise ValueError(f"--ray-address: cannot join the Ray cluster at {address}: {e}") from None
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def execute(requests: Sequence[Request], configs: Sequence[dict], path: str | Path, ray=None,
            desc: str = "sweep", run: Callable[[Sequence[Request], dict], dict] = run_config,
            ) -> tuple[list[dict], list[tuple[dict, str]]]:
    """Run ``configs`` (each through ``run``, ``run_config`` by default; another experiment passes its own) and
    append each row to ``path`` as it finishes; returns (rows, failures).

    With ``ray`` (an initialized ``ray`` module) the workload is put in the object store once and each
    configuration is a task of one CPU, collected with ``ray.wait`` as they finish; without, they run here in
    turn. A configuration that raises is reported (``failures``: config, error) and the others go on; it is
    not written, so the next run retries it. Each row carries the code it ran (``provenance``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    failures: list[tuple[dict, str]] = []
    stamp = provenance()
    with path.open("a") as f, tqdm(total=len(configs), desc=desc, unit="run", file=sys.stderr) as bar:
        def record(config: dict, row: dict | None, error: str | None) -> None:
            if row is not None:
                row = {**row, **stamp}
                f.write(result_line(row))
                f.flush()
                rows.append(row)
            else:
                failures.append((config, error))
                tqdm.write(f"failed: {key(config)}: {error}", file=sys.stderr)
            bar.update()

        if ray is None:
            for c in configs:
                try:
                    record(c, run(requests, c), None)
                except Exception as e:  # one bad configuration must not lose the others
                    record(c, None, f"{type(e).__name__}: {e}")
            return rows, failures
        workload = ray.put(list(requests))
        task = ray.remote(num_cpus=1)(run)
        waiting = {task.remote(workload, c): c for c in configs}
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1)
            for ref in done:
                config = waiting.pop(ref)
                try:
                    record(config, ray.get(ref), None)
                except Exception as e:  # a task's error (RayTaskError) included
                    record(config, None, f"{type(e).__name__}: {e}")
        del workload
    return rows, failures


def joined(rows: Iterable[dict]) -> list[dict]:
    """The router rows, flat (their config's fields beside the summary), each with its references and its hit
    rate as a share of each (``share_of_pooled_lru`` ...; None where the references are not in ``rows``)."""
    rows = list(rows)
    refs = {r["key"]: r for r in rows if r["config"]["kind"] == "references"}
    out = []
    for r in rows:
        c = r["config"]
        if c["kind"] != "run":
            continue
        flat = {**{k: v for k, v in c.items() if k != "kind"}, **{k: v for k, v in r.items() if k != "config"}}
        ref = refs.get(reference_key(c), {})
        for name in REFERENCE_NAMES:
            value = ref.get(name)
            flat[name] = value
            flat[f"share_of_{name}"] = r["hit_rate"] / value if value else None
        out.append(flat)
    return out


# ---------------------------------------------------------------------------------------------- the command

def add_ray_flags(p) -> None:
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto, ray://host:10001)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all cores)")
    p.add_argument("--no-ray", action="store_true", help="run the configurations in this process, one by one")


def parse_sizes(text: str | None) -> dict:
    """``--sizes``: a JSON object of the workload's size parameters (``{"sessions": 64, "turns": [4, 8]}``)."""
    if not text:
        return {}
    try:
        sizes = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--sizes: not JSON ({e.msg}): {text!r}") from None
    if not isinstance(sizes, dict):
        raise ValueError(f"--sizes: a JSON object of size parameters, got {text!r}")
    return sizes


def parse_router_params(text: str | None) -> dict:
    """``--router-params``: a JSON object, router name -> its parameters (``{"kv_events": {"event_delay": 0.5}}``)."""
    params = parse_sizes(text) if text else {}
    names_from(",".join(params) or "round_robin", ROUTERS, "--router-params")
    if not all(isinstance(v, dict) for v in params.values()):
        raise ValueError("--router-params: each router's parameters must be a JSON object")
    return params


def replica_counts(text: str) -> list[int]:
    values = fractions_from(text, "--replicas")
    if not all(v >= 1 and v == int(v) for v in values):
        raise ValueError(f"--replicas: integers >= 1, got {text!r}")
    return [int(v) for v in values]


def shapes_for(replicas: Sequence[int], capacities: Sequence[float], pooled: bool) -> list[tuple[int, int | None]]:
    """(N, per-replica capacity) pairs: each capacity as given (per replica) or, with ``pooled``, as the total
    over N replicas (capacity / N each, so every N has the same memory). 0 is unlimited."""
    out = []
    for cap in capacities:
        for n in replicas:
            out.append((n, None if cap == 0 else int(cap // n) if pooled else int(cap)))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/sweep")
    p.description += " --out is a directory: writes sweep.jsonl and config.json there."
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, help=f"Mooncake trace (.jsonl), e.g. {DEFAULT_TRACE}")
    src.add_argument("--workload", default=None, help=f"a synthetic workload: {', '.join(workloads.WORKLOADS)}")
    p.add_argument("--sizes", default=None, help='the synthetic workload\'s sizes as JSON, e.g. {"sessions": 64}')
    p.add_argument("--limit", type=int, default=None, help="only the first N requests (quick runs)")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated subset of {list(ROUTERS)}")
    p.add_argument("--router-params", default=None, help='JSON: router -> parameters, e.g. {"preble": {...}}')
    p.add_argument("--replicas", default="1,2,4,8,16", help="replica counts N")
    p.add_argument("--capacities", default="500000", help="KV budgets in tokens, per replica (0 = unlimited)")
    p.add_argument("--pooled", action="store_true", help="--capacities are totals over the N replicas (each: /N)")
    p.add_argument("--schedule-policies", default="fcfs", help="each replica's scheduling policies")
    p.add_argument("--eviction-policies", default="lru", help="each replica's eviction policies (online ones)")
    p.add_argument("--cache", default="radix", choices=["radix", "hash"], help="each replica's prefix cache")
    add_settings(p, "page_size", "block_size", "max_running", page_size=16)
    p.add_argument("--cost-model", default=None, help="a cost model preset name or JSON file (multiturn "
                                                      "--calibrate's, experiments.cost_fit's: CostModel.load)")
    add_ray_flags(p)
    args = p.parse_args(argv)
    if args.trace is None and args.workload is None:
        p.error("one of --trace or --workload is required")
    for flag in ("page_size", "block_size", "max_running"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    spec = workload_spec(args.trace, args.workload, parse_sizes(args.sizes), args.seed, args.limit)
    cost = CostModel.load(args.cost_model) if args.cost_model else CostModel()
    shapes = shapes_for(replica_counts(args.replicas), fractions_from(args.capacities, "--capacities"), args.pooled)
    configs = build_grid(spec, names_from(args.routers, ROUTERS, "--routers"), shapes,
                         names_from(args.schedule_policies, SCHEDULE_POLICIES, "--schedule-policies"),
                         names_from(args.eviction_policies, EVICTION_POLICIES, "--eviction-policies"),
                         cache=args.cache, page_size=args.page_size, block_size=args.block_size,
                         max_running=args.max_running, cost_model=cost, seed=args.seed,
                         overrides=parse_router_params(args.router_params))
    out = Path(args.out)
    rows, failures = sweep(configs, out / RESULTS, spec, args.trace, args, environment())
    if failures:
        raise SystemExit(f"{len(failures)} configuration(s) failed; rerun the same command to retry them")
    return rows


def sweep(configs: Sequence[dict], path: Path, spec: dict, trace: str | None, args, env: dict,
          ray_session_factory=None) -> tuple[list[dict], list]:
    """Run what is pending of ``configs`` into ``path`` (loading the workload only if something is), write
    ``config.json`` beside it; returns (every row of the file, failures)."""
    before = read_results(path)
    todo = pending(configs, before)
    write_config(path.parent / CONFIG, {"workload": spec, "trace_path": trace, "grid": len(configs)},
                 {"args": vars(args), "env": env, "to_run": len(todo)})
    print(f"{len(configs)} configurations, {len(configs) - len(todo)} already in {path}, {len(todo)} to run")
    failures: list = []
    if todo:
        requests = load_workload(spec, trace)
        if args.no_ray:
            _, failures = execute(requests, todo, path)
        else:
            with (ray_session_factory or ray_session)(args.ray_address, args.num_cpus) as ray:
                _, failures = execute(requests, todo, path, ray=ray)
    return read_results(path), failures


if __name__ == "__main__":
    run_cli(main)
