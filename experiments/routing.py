"""Routers on a simulated cluster: hit rate against the pooled references, imbalance and TTFT, for N = 1 to 16.

``python -m experiments.routing --out docs/figures/routing`` runs every router of ``radixkv.routing`` on
Mooncake's conversation trace (``--trace``; skipped with a message where it is absent) and on two synthetic
workloads with many prefix groups (multi-turn sessions, shared-prefix groups), for N = 1, 2, 4, 8 and 16
replicas. The memory is fixed, not the replica: the N replicas share a pooled KV budget (Mooncake: 4M tokens,
where one pooled LRU cache reaches about half the trace's upper bound; each replica holds 4M / N), so the
pooled references are the same cache at every N and the curves show only what splitting it costs. The cost
model is the same at every N, so the cluster's load falls as N grows (N = 8 is moderately loaded on
Mooncake: prefill is about half of each replica's time; N < 8 is overloaded and its TTFT is queueing).

Runs go through ``experiments.sweep`` (Ray tasks, or this process with ``--no-ray`` / ``--workers 1``) into
``OUT/routing.jsonl``, one row per configuration, so a rerun resumes; ``OUT/config.json`` records the flags,
each workload's sizes and capacities and the cost model. Draws ``OUT/hit_rate_vs_replicas.png`` and
``OUT/hit_rate_vs_imbalance.png``, prints the N = 8 tables (Mooncake's with the pooled LRU / Belady caches
and the upper bound) as markdown (also ``OUT/tables.md``) and whether radixkv's target holds: ``affinity``
at >= 90% of pooled LRU with imbalance <= 1.1, beating ``cache_aware`` and ``kv_events`` on hit rate and TTFT
p99 (Mooncake, N = 8).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments import sweep  # noqa: E402
from experiments.common import DEFAULT_TRACE, add_settings, environment, names_from, parser, run_cli, save_figure  # noqa: E402
from radixkv.routing import ROUTERS  # noqa: E402
from radixkv.sim import CostModel  # noqa: E402

# Each replica: prefill 0.12 ms per token, a decode step 15 ms + 0.5 ms per sequence. Chosen so that 8 replicas
# serve Mooncake's trace moderately loaded (prefill about half of each replica's time).
COST = CostModel(prefill_per_token=1.2e-4, attention_per_pair=1e-10, decode_step=0.015, decode_per_seq=5e-4,
                 step_overhead=0.002)
# name -> sizes (synthetic) and the pooled KV budget (tokens, over all N replicas): where one pooled LRU cache
# reaches about half of the upper bound, so routing decides what is kept.
WORKLOADS = {
    # 12,031 requests, 145M prompt tokens over an hour; pooled LRU 0.177, upper bound 0.374
    "mooncake": {"sizes": None, "pooled_capacity": 4_000_000},
    # vLLM's multi-turn shape (500-token system prompt, 1,000-token session prefix, 12-18 turns of 120-160 user
    # and 80-120 generated tokens), 384 sessions starting 0.5 s apart, 5 s between a turn's answer and the next:
    # 5,723 requests, 19M prompt tokens, about 1.2M distinct; pooled LRU 0.35 against an upper bound of 0.94
    # (the LRU cliff: at 500,000 pooled tokens it reaches the bound)
    "multi_turn": {"sizes": {"preset": "vllm", "sessions": 384, "session_gap": 0.5, "think_time": 5.0},
                   "pooled_capacity": 450_000},
    # SGLang's generated-shared-prefix shape: 256 groups of 16 questions behind 1,000-3,000-token system
    # prompts, shuffled, Poisson arrivals at 16 per second: 4,096 requests, 8.7M prompt tokens; pooled LRU 0.42
    # against an upper bound of 0.86
    "shared_prefix": {"sizes": {"groups": 256, "prompts_per_group": 16, "system_tokens": [1000, 3000],
                                "question_tokens": [64, 256], "output_tokens": [64, 256], "rate": 16},
                      "pooled_capacity": 300_000},
}
RESULTS = "routing.jsonl"
TARGET_N = 8
TARGET = ("affinity >= 90% of pooled LRU with imbalance <= 1.1, and above cache_aware and kv_events on hit rate "
          "and below them on TTFT p99 (Mooncake, N = 8)")


def parse_args(argv: list[str] | None = None):
    p = parser(__doc__.splitlines()[0], "docs/figures/routing")
    p.description += " --out is a directory."
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (.jsonl); skipped if absent")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {list(WORKLOADS)}")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated subset of {list(ROUTERS)}")
    p.add_argument("--replicas", default="1,2,4,8,16", help="replica counts N")
    p.add_argument("--mooncake-capacity", type=float, default=WORKLOADS["mooncake"]["pooled_capacity"],
                   help="Mooncake's pooled KV budget in tokens (each of N replicas holds it / N)")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests of each workload (quick runs)")
    add_settings(p, "page_size", page_size=16)
    p.add_argument("--workers", type=int, default=None,
                   help="CPUs of the local Ray instance (default: all cores); 1 runs in this process")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--no-ray", action="store_true", help="run in this process, one configuration after the other")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    if args.page_size < 1 or args.mooncake_capacity < 1 or (args.workers is not None and args.workers < 1):
        p.error("--page-size, --mooncake-capacity and --workers must be >= 1")
    return args


def grids(args) -> dict[str, tuple[dict, list[dict]]]:
    """workload name -> (its spec, its configurations); Mooncake only where its trace exists. Each replica's
    capacity is the workload's pooled capacity / N."""
    routers = names_from(args.routers, ROUTERS, "--routers")
    replicas = sweep.replica_counts(args.replicas)
    out = {}
    for name in names_from(args.workloads, WORKLOADS, "--workloads"):
        if name == "mooncake":
            if not sweep.trace_present(args.trace):
                continue
            spec, pooled = sweep.workload_spec(trace=args.trace, limit=args.limit), args.mooncake_capacity
        else:
            w = WORKLOADS[name]
            spec, pooled = sweep.workload_spec(workload=name, sizes=w["sizes"], seed=args.seed, limit=args.limit), \
                w["pooled_capacity"]
        shapes = sweep.shapes_for(replicas, [pooled], pooled=True)
        out[name] = spec, sweep.build_grid(spec, routers, shapes, page_size=args.page_size, cost_model=COST,
                                           seed=args.seed)
    if not out:
        raise ValueError("no workload to run (Mooncake's trace is absent and no synthetic workload was chosen)")
    return out


def run(args, todo: dict[str, tuple[dict, list[dict]]], path: Path) -> list:
    """Run what is pending of every workload's grid into ``path``; returns the failures."""
    rows = sweep.read_results(path)
    pending = {name: (spec, sweep.pending(configs, rows)) for name, (spec, configs) in todo.items()}
    total = sum(len(c) for _, c in pending.values())
    print(f"{sum(len(c) for _, c in todo.values())} configurations, {total} to run")
    failures: list = []
    if not total:
        return failures
    in_process = args.no_ray or (args.workers == 1 and not args.ray_address)
    with contextlib.ExitStack() as stack:
        ray = None if in_process else stack.enter_context(sweep.ray_session(args.ray_address, args.workers))
        for name, (spec, configs) in pending.items():
            if configs:
                requests = sweep.load_workload(spec, args.trace)
                failures += sweep.execute(requests, configs, path, ray=ray, desc=name)[1]
    return failures


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    todo = grids(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    pending = sum(len(sweep.pending(configs, sweep.read_results(path))) for _, configs in todo.values())
    sweep.write_config(out / "config.json", {
        "capacity_rule": "pooled: each of N replicas holds pooled_capacity / N tokens",
        "workloads": {name: {"spec": spec, "per_replica_capacity": {
            str(c["replicas"]): c["capacity_tokens"] for c in configs if c["kind"] == "references"}}
            for name, (spec, configs) in todo.items()},
        "mooncake_pooled_capacity": args.mooncake_capacity,
        "synthetic_pooled_capacity": {k: w["pooled_capacity"] for k, w in WORKLOADS.items() if w["sizes"]},
        "cost_model": asdict(COST)}, {"args": vars(args), "env": environment(), "to_run": pending})
    t0 = time.perf_counter()
    failures = run(args, todo, path)
    wanted = {sweep.key(c) for _, configs in todo.values() for c in configs}
    rows = sweep.joined(r for r in sweep.read_results(path) if r["key"] in wanted)
    names = {sweep.key(spec): name for name, (spec, _) in todo.items()}
    for r in rows:
        r["workload_name"] = names[sweep.key(r["workload"])]
    print(f"ran in {time.perf_counter() - t0:.0f} s; {sum(r['seconds'] for r in rows):.0f} s of runs in the file")
    text = tables(rows, list(todo))
    print(text)
    (out / "tables.md").write_text(text + "\n")
    print(target(rows))
    if rows:
        print("wrote", path, save_figure(plot_replicas(rows, list(todo)), out / "hit_rate_vs_replicas.png"),
              save_figure(plot_imbalance(rows, list(todo)), out / "hit_rate_vs_imbalance.png"))
    plt.close("all")
    if failures:
        raise SystemExit(f"{len(failures)} configuration(s) failed; rerun the same command to retry them")
    return rows


# ---------------------------------------------------------------------------------------------- tables

def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def decisions(row: dict) -> str:
    """The router's own tally (``affinity 11,961 / balance 69``) and the requests per replica (min-max)."""
    counts = row.get("decision_counts") or {}
    own = " / ".join(f"{k} {v:,}" for k, v in counts.items() if not k.startswith("replica "))
    per = [v for k, v in counts.items() if k.startswith("replica ")]
    spread = f"per replica {min(per):,}-{max(per):,}" if per else ""
    return "; ".join(s for s in (own, spread) if s)


def tables(rows: list[dict], workloads: list[str]) -> str:
    """Markdown: per workload, the N = 8 table (references first), then % of pooled LRU, imbalance and TTFT p99
    by router and N."""
    parts = []
    for w in workloads:
        mine = [r for r in rows if r["workload_name"] == w]
        if not mine:
            continue
        at = sorted((r for r in mine if r["replicas"] == TARGET_N), key=lambda r: -r["hit_rate"])
        if at:
            ref = at[0]
            parts += [f"### {w}, N = {TARGET_N} (each replica {ref['capacity_tokens']:,} tokens)", "",
                      "| router | hit rate | % of pooled LRU | % of pooled Belady | % of upper bound | imbalance "
                      "| TTFT p50 (s) | TTFT p99 (s) | decisions |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
            for name, label in (("upper_bound", "upper bound (unlimited cache)"),
                                ("pooled_belady", "pooled Belady (one cache, N x capacity)"),
                                ("pooled_lru", "pooled LRU (one cache, N x capacity)")):
                if ref.get(name) is not None:
                    parts.append(f"| {label} | {ref[name]:.4f} | {_pct(ref[name] / ref['pooled_lru'])} | | | | | | |")
            for r in at:
                parts.append(f"| {r['router']} | {r['hit_rate']:.4f} | {_pct(r['share_of_pooled_lru'])} | "
                             f"{_pct(r['share_of_pooled_belady'])} | {_pct(r['share_of_upper_bound'])} | "
                             f"{r['imbalance']:.3f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {decisions(r)} |")
            parts.append("")
        ns = sorted({r["replicas"] for r in mine})
        routers = list(dict.fromkeys(r["router"] for r in sorted(mine, key=lambda r: list(ROUTERS).index(r["router"]))))
        cell = {(r["router"], r["replicas"]): r for r in mine}
        for title, fmt in (("hit rate, % of pooled LRU", lambda r: _pct(r["share_of_pooled_lru"])),
                           ("imbalance (max / mean computed tokens)", lambda r: f"{r['imbalance']:.3f}"),
                           ("TTFT p99 (s)", lambda r: f"{r['ttft_p99']:.2f}")):
            parts += [f"{w}: {title}", "", "| router | " + " | ".join(f"N = {n}" for n in ns) + " |",
                      "| --- |" + " ---: |" * len(ns)]
            for router in routers:
                parts.append(f"| {router} | " + " | ".join(fmt(cell[router, n]) if (router, n) in cell else ""
                                                           for n in ns) + " |")
            parts.append("")
        pooled = {n: cell[routers[0], n].get("pooled_lru") for n in ns if (routers[0], n) in cell}
        parts += [f"{w}: pooled LRU by N: " + ", ".join(f"{n}: {v:.4f}" for n, v in pooled.items() if v is not None),
                  ""]
    return "\n".join(parts).rstrip()


def target(rows: list[dict]) -> str:
    """One line: does affinity meet radixkv's target on Mooncake at N = 8?"""
    at = {r["router"]: r for r in rows if r["workload_name"] == "mooncake" and r["replicas"] == TARGET_N}
    missing = [r for r in ("affinity", "cache_aware", "kv_events") if r not in at]
    if missing:
        return f"target ({TARGET}): not checked, no Mooncake N = {TARGET_N} rows for {', '.join(missing)}"
    a, others = at["affinity"], [at["cache_aware"], at["kv_events"]]
    checks = {
        f"{_pct(a['share_of_pooled_lru'])} of pooled LRU >= 90%": (a["share_of_pooled_lru"] or 0) >= 0.9,
        f"imbalance {a['imbalance']:.3f} <= 1.1": a["imbalance"] <= 1.1,
        **{f"hit rate {a['hit_rate']:.4f} > {o['router']}'s {o['hit_rate']:.4f}": a["hit_rate"] > o["hit_rate"]
           for o in others},
        **{f"TTFT p99 {a['ttft_p99']:.2f} s < {o['router']}'s {o['ttft_p99']:.2f} s": a["ttft_p99"] < o["ttft_p99"]
           for o in others},
    }
    failed = [c for c, ok in checks.items() if not ok]
    verdict = "HOLDS" if not failed else "DOES NOT HOLD (fails: " + "; ".join(failed) + ")"
    return f"target ({TARGET}): {verdict}; " + "; ".join(checks)


# ---------------------------------------------------------------------------------------------- figures

def _markers(routers: list[str]) -> dict[str, str]:
    return dict(zip(routers, "osD^v<>phX*", strict=False))


def _legend(fig, axes) -> None:
    """One legend for every panel, below them."""
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.tight_layout()
    fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(len(handles), 6), fontsize=8, frameon=False)


def plot_replicas(rows: list[dict], workloads: list[str]):
    """Hit rate against N, one line per router, the pooled references dashed; one panel per workload."""
    shown = [w for w in workloads if any(r["workload_name"] == w for r in rows)]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    routers = [r for r in ROUTERS if any(x["router"] == r for x in rows)]
    marks = _markers(routers)
    for ax, w in zip(axes[0], shown, strict=True):
        mine = [r for r in rows if r["workload_name"] == w]
        for router in routers:
            pts = sorted((r["replicas"], r["hit_rate"]) for r in mine if r["router"] == router)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=marks[router], label=router)
        by_n = {r["replicas"]: r for r in mine}
        ns = sorted(by_n)
        for name, style in (("pooled_lru", "k--"), ("pooled_belady", "k-."), ("upper_bound", "k:")):
            pts = [(n, by_n[n][name]) for n in ns if by_n[n].get(name) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, lw=1, label=name.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("replicas N (pooled capacity fixed)")
        ax.set_ylabel("prefix hit rate (prompt tokens)")
        ax.set_title(w)
    _legend(fig, axes)
    return fig


def plot_imbalance(rows: list[dict], workloads: list[str]):
    """Hit rate as a share of pooled LRU against imbalance, one marker per router, each point labelled with N
    (N > 1); the target's corner shaded."""
    shown = [w for w in workloads if any(r["workload_name"] == w and r["replicas"] > 1 for r in rows)] or workloads[:1]
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    routers = [r for r in ROUTERS if any(x["router"] == r for x in rows)]
    marks = _markers(routers)
    for ax, w in zip(axes[0], shown, strict=True):
        mine = [r for r in rows if r["workload_name"] == w and r["replicas"] > 1 and r["share_of_pooled_lru"]]
        for i, router in enumerate(routers):
            pts = sorted((r["imbalance"], r["share_of_pooled_lru"], r["replicas"]) for r in mine
                         if r["router"] == router)
            if not pts:
                continue
            xs, ys, ns = zip(*pts, strict=True)
            ax.scatter(xs, ys, marker=marks[router], color=f"C{i}", label=router)
            for x, y, n in pts:
                ax.annotate(str(n), (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        top = max([1.0, *(r["share_of_pooled_lru"] for r in mine)]) + 0.02
        ax.fill_between([1.0, 1.1], 0.9, top, color="green", alpha=0.08, label="target: >= 90%, <= 1.1")
        ax.set_xscale("log")
        hi = max([1.1, *(r["imbalance"] for r in mine)])
        ticks = [t for t in (1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50) if t <= hi * 1.05]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("imbalance (max / mean computed tokens; log)")
        ax.set_ylabel("hit rate / pooled LRU's")
        ax.set_title(f"{w} (labels: N)")
    _legend(fig, axes)
    return fig


if __name__ == "__main__":
    run_cli(main)
