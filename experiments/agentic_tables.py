"""The agentic experiment's tables and figures (``experiments.agentic`` writes its rows, this reads them).

A configuration runs in several arrival orders (``--orders``: the same sessions, their start times dealt to
them in a seeded shuffle, ``radixkv.workloads.reordered``). ``over_orders`` folds a configuration's rows into
one: each metric's mean over the orders, with its 95% interval (``_ci95``) and the per-order values
(``_values``, by order); the tables print ``mean ± interval``. ``with_slowdowns`` gives each row its
sessions' slowdowns against the ``reference`` row of the same workload and order (an unlimited cache under
LRU and FCFS): mean and max, and Jain's fairness over them (``radixkv.sim.metrics``). ``versus`` compares two
configurations order by order: one beats the other only where the interval of their paired differences
excludes zero; otherwise they tie.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from experiments import sweep
from experiments.agentic import POLICIES, SESSION_CONFIGS
from experiments.common import save_figure
from radixkv.sim.metrics import interval, jain

# the metrics folded over orders (a row from before one was recorded lacks it)
METRICS = ("hit_rate", "ttft_mean", "ttft_p99", "session_completion_mean", "session_completion_p50",
           "first_ttft_mean", "first_ttft_p99", "longest_wait", "slowdown_mean", "slowdown_max", "jain_fairness",
           "service_time_mean", "session_time_mean", "session_time_p50", "missed_reusable", "loaded_tokens",
           "written_tokens", "rejected")
WORKLOAD = ("concurrency", "seed", "max_pause", "sessions", "split", "cost_preset", "chunked_prefill_size",
            "sub_agent_waits", "page_size", "order")  # what a reference row must share with the rows it serves


# ---------------------------------------------------------------------------------------------- orders

def with_slowdowns(rows: list[dict]) -> list[dict]:
    """``rows`` with each one's ``slowdown_mean``, ``slowdown_max`` and ``jain_fairness``: its sessions'
    completion times over the same sessions' in the ``reference`` row of its workload and order (NaN where
    there is none). O(rows x sessions)."""
    refs = {_workload(r["config"]): r for r in rows if r["config"]["part"] == "reference"}
    out = []
    for r in rows:
        ref = refs.get(_workload(r["config"]))
        done, base = r.get("session_completions") or {}, (ref or {}).get("session_completions") or {}
        slow = [done[s] / base[s] for s in done if base.get(s, 0) > 0]
        out.append({**r, "slowdown_mean": float(np.mean(slow)) if slow else math.nan,
                    "slowdown_max": float(np.max(slow)) if slow else math.nan,
                    "jain_fairness": jain(slow) if slow else math.nan})
    return out


def _workload(config: dict) -> tuple:
    return tuple(config.get(k) for k in WORKLOAD)


def over_orders(rows: list[dict]) -> list[dict]:
    """One row per configuration: the first order's row with each of ``METRICS`` replaced by its mean over
    the configuration's orders, beside ``METRIC_ci95`` (NaN for one order) and ``METRIC_values`` (by order);
    ``orders``: how many. A row without an ``order`` is one order of its own. O(rows)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        config = {k: v for k, v in r["config"].items() if k != "order"}
        groups.setdefault(sweep.key(config), []).append(r)
    out = []
    for group in groups.values():
        group.sort(key=lambda r: r["config"].get("order", 0))
        row = {**group[0], "orders": len(group)}
        for metric in METRICS:
            values = [r[metric] for r in group if metric in r and r[metric] is not None]
            if len(values) == len(group):
                found = interval(values)
                row |= {metric: found["mean"], f"{metric}_ci95": found["ci95"], f"{metric}_values": values}
        out.append(row)
    return out


def versus(a: dict, b: dict, metric: str = "ttft_mean") -> str:
    """``lower``, ``higher`` or ``tie``: ``a``'s ``metric`` against ``b``'s, over their orders paired (the
    interval of the per-order differences must exclude zero; one order is always a tie)."""
    pairs = list(zip(a.get(f"{metric}_values", []), b.get(f"{metric}_values", []), strict=False))
    if len(pairs) < 2:
        return "tie"
    d = interval([x - y for x, y in pairs])
    return "tie" if not abs(d["mean"]) > d["ci95"] else ("lower" if d["mean"] < 0 else "higher")


def _pm(row: dict, metric: str, fmt: str) -> str:
    """A metric as the tables print it: ``mean ± interval`` over orders, the value alone for one order."""
    value, ci = row.get(metric, math.nan), row.get(f"{metric}_ci95", math.nan)
    return f"{value:{fmt}}" + (f" ± {ci:{fmt}}" if isinstance(ci, float) and math.isfinite(ci) else "")


# ---------------------------------------------------------------------------------------------- tables

def tables(rows: list[dict], bound: float, raw: list[dict] | None = None) -> str:
    """The headline table (capacity x policy at 16 sessions, llama3-70b-8xh100, radix), the cliff per
    concurrency, where LRU falls furthest below the bound and which misses cause it, then the other parts.
    ``rows``: folded over orders (``over_orders``); ``raw``: every row, whose commits the first line names."""
    out = [sweep.commits_line(raw if raw is not None else rows), "",
           f"Upper bound of the hit rate (unlimited memory, every request in order): {bound:.4f}", ""]
    cap_rows = [r for r in rows if r["config"]["part"] == "capacity"]
    for conc in sorted({r["config"]["concurrency"] for r in cap_rows}):
        for preset in sorted({r["config"]["cost_preset"] for r in cap_rows}):
            for cache in ("radix", "hash"):
                sel = [r for r in cap_rows if (r["config"]["concurrency"], r["config"]["cost_preset"],
                                               r["config"]["cache"]) == (conc, preset, cache)]
                if sel:
                    out += capacity_table(sel, f"{cache}, {conc:g} active sessions, {preset}", bound)
    for part in ("tiers", "routers"):
        sel = [r for r in rows if r["config"]["part"] == part]
        if sel:
            out += part_table(sel, part)
    sel = [r for r in rows if r["config"]["part"] == "sessions"]
    if sel:
        out += session_table(sel)
    return "\n".join(out).rstrip()


def session_table(rows: list[dict]) -> list[str]:
    """Part sessions: per capacity, concurrency and host tier, every configuration, each metric's mean over the
    orders ± its 95% interval, and how its mean TTFT and session completion compare with ``lru`` beside it
    (``versus``: lower, higher, or a tie where the paired interval holds zero)."""
    lines = ["### sessions", "", "| device tokens | host tokens | concurrency | configuration | orders | hit rate | "
             "TTFT mean | TTFT p99 | session completion (s) | slowdown mean / max | first-request TTFT | "
             "longest wait | Jain | TTFT / completion vs lru | host loaded / written (M tokens) |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    order = list(SESSION_CONFIGS)
    place = lambda c: (c["concurrency"], c["capacity_tokens"], c["host_ratio"], _write(c))  # noqa: E731
    lru = {place(r["config"]): r for r in rows if r["config"]["label"] == "lru"}
    for r in sorted(rows, key=lambda r: (*place(r["config"]), order.index(r["config"]["label"]))):
        c = r["config"]
        host = c["host_ratio"] * c["capacity_tokens"]
        base = lru.get(place(c))
        against = "-" if base is None or base is r else \
            f"{versus(r, base)} / {versus(r, base, 'session_completion_mean')}"
        lines.append(f"| {_device(c)} | {f'{host / 1e6:g}M{_write(c)}' if host else '-'} | "
                     f"{c['concurrency']:g} | {c['label']} | {r.get('orders', 1)} | {_pm(r, 'hit_rate', '.3f')} | "
                     f"{_pm(r, 'ttft_mean', '.2f')} | {_pm(r, 'ttft_p99', '.1f')} | "
                     f"{_pm(r, 'session_completion_mean', '.0f')} | "
                     f"{_pm(r, 'slowdown_mean', '.2f')} / {_pm(r, 'slowdown_max', '.1f')} | "
                     f"{_pm(r, 'first_ttft_mean', '.2f')} | {_pm(r, 'longest_wait', '.0f')} | "
                     f"{_pm(r, 'jain_fairness', '.2f')} | {against} | "
                     f"{r['loaded_tokens'] / 1e6:.0f} / {r['written_tokens'] / 1e6:.0f} |")
    learned = [r for r in rows if "learned_hold_main" in (r.get("eviction") or {})]
    if learned:
        lines += ["", "Tool-call holds the session eviction policy learned (device tier, at the end of order 0; main "
                  "agent / sub-agents, seconds): " + "; ".join(
                      f"{r['config']['capacity_tokens'] / 1e6:g}M"
                      f"{' + host' + _write(r['config']) if r['config']['host_ratio'] else ''} "
                      f"at {r['config']['concurrency']:g}: {r['eviction']['learned_hold_main']:.1f} / "
                      f"{r['eviction']['learned_hold_sub']:.1f}" for r in learned) + "."]
    return [*lines, ""]


def _write(config: dict) -> str:
    """A sessions row's host tier where it is not the default, ``write_back`` over a ``prefix`` layout:
    " (write_through)", " (segments)", " (write_through, segments)", else ""."""
    write = config.get("write_policy")
    tags = [write] if write not in (None, "write_back") else []
    tags += [config["host_layout"]] if config.get("host_layout", "prefix") != "prefix" else []
    return f" ({', '.join(tags)})" if tags else ""


def _device(config: dict) -> str:
    """A row's device capacity as the tables show it: millions of tokens, ``infeasible`` where it was forced
    past its node's memory (``--force-capacity``)."""
    return f"{config['capacity_tokens'] / 1e6:g}M" + (" infeasible" if config.get("infeasible") else "")


def capacity_table(rows: list[dict], title: str, bound: float) -> list[str]:
    caps = sorted({r["config"]["capacity_tokens"] for r in rows})
    policies = [p for p in POLICIES if any(r["config"]["eviction_policy"] == p for r in rows)]
    cell = {(r["config"]["capacity_tokens"], r["config"]["eviction_policy"]): r for r in rows}
    orders = max(r.get("orders", 1) for r in rows)
    lines = [f"### {title}", "", f"hit rate (mean TTFT s, p99 TTFT s), over {orders} order(s) (mean ± 95% interval); "
             f"upper bound {bound:.3f}. A request whose "
             "prompt and answer exceed the device is rejected (counted beside the capacity, not in the rates).", "",
             "| device tokens | " + " | ".join(policies) + " |", "| ---: |" + " ---: |" * len(policies)]
    for c in caps:
        rejected = max(r["rejected"] for r in rows if r["config"]["capacity_tokens"] == c)
        config = next(r["config"] for r in rows if r["config"]["capacity_tokens"] == c)
        lines.append(f"| {_device(config)}{f' ({rejected} rejected)' if rejected else ''} | " + " | ".join(
            f"{_pm(cell[c, p], 'hit_rate', '.3f')} ({_pm(cell[c, p], 'ttft_mean', '.2f')}, "
            f"{_pm(cell[c, p], 'ttft_p99', '.1f')})"
            if (c, p) in cell else "" for p in policies) + " |")
    lru = [cell[c, "lru"] for c in caps if (c, "lru") in cell]
    if lru:
        worst = max(lru, key=lambda r: bound - r["hit_rate"])
        by = worst["missed_by_after"]
        lines += ["", f"LRU falls furthest below the bound at {worst['config']['capacity_tokens'] / 1e6:g}M: "
                  f"{worst['hit_rate']:.3f} against {bound:.3f}; the missed reusable tokens "
                  f"({worst['missed_reusable']:.3f} of prompt tokens) follow a tool call {by['tool_use']:.3f}, "
                  f"a human turn {by['end_turn']:.3f}, an unrecorded stop {by['']:.3f}, nothing (a stream's "
                  f"first request) {by['None']:.3f}.", cliff(lru)]
    return [*lines, ""]


def cliff(lru: list[dict]) -> str:
    """The capacity cliff: the smallest capacity whose mean TTFT is within 2x of the largest capacity's;
    below it TTFT jumps."""
    ttft = {r["config"]["capacity_tokens"]: r["ttft_mean"] for r in lru}
    caps = sorted(ttft)
    floor = ttft[caps[-1]]
    fine = [c for c in caps if ttft[c] <= 2 * floor]
    edge = min(fine)
    below = max((c for c in caps if c < edge), default=None)
    return (f"Capacity cliff (LRU): mean TTFT is within 2x of the largest capacity's ({floor:.2f} s) down to "
            f"{edge / 1e6:g}M" + ("" if below is None else f"; at {below / 1e6:g}M it is {ttft[below]:.2f} s")
            + ".")


def part_table(rows: list[dict], part: str) -> list[str]:
    name = "write_policy" if part == "tiers" else "router"
    lines = [f"### {part}", "", f"| device tokens | concurrency | preset | {name} | hit rate | TTFT mean | TTFT p99 |",
             "| ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["config"]["capacity_tokens"], r["config"]["concurrency"],
                                         str(r["config"][name]))):
        c = r["config"]
        if c.get("router") == "references":
            lines.append(f"| {_device(c)} | {c['concurrency']:g} | {c['cost_preset']} | "
                         f"pooled: lru {r['pooled_lru']:.3f}, belady {r.get('pooled_belady', math.nan):.3f} | "
                         f"bound {r['upper_bound']:.3f} | | |")
        else:
            lines.append(f"| {_device(c)} | {c['concurrency']:g} | {c['cost_preset']} | "
                         f"{c[name]} | {r['hit_rate']:.3f} | {r['ttft_mean']:.2f} | {r['ttft_p99']:.1f} |")
    return [*lines, ""]


def draw(rows: list[dict], out: Path, bound: float) -> list[Path]:
    """Hit rate and mean TTFT against capacity per policy, at each concurrency (radix, the first preset)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.common import log_capacity_axis

    cap_rows = [r for r in rows if r["config"]["part"] == "capacity" and r["config"]["cache"] == "radix"]
    if not cap_rows:
        return draw_sessions(rows, out, plt)
    preset = sorted({r["config"]["cost_preset"] for r in cap_rows})[0]
    concs = sorted({r["config"]["concurrency"] for r in cap_rows})
    paths = []
    for metric, label, name in (("hit_rate", "hit rate", "hit_rate_vs_capacity"),
                                ("ttft_mean", "mean TTFT (s)", "ttft_vs_capacity")):
        fig, axes = plt.subplots(1, len(concs), figsize=(5.5 * len(concs), 4), squeeze=False)
        for ax, conc in zip(axes[0], concs, strict=True):
            sel = [r for r in cap_rows if r["config"]["concurrency"] == conc and r["config"]["cost_preset"] == preset]
            caps = sorted({r["config"]["capacity_tokens"] for r in sel})
            for policy in [p for p in POLICIES if any(r["config"]["eviction_policy"] == p for r in sel)]:
                pts = sorted((r["config"]["capacity_tokens"], r[metric]) for r in sel
                             if r["config"]["eviction_policy"] == policy)
                ax.plot([c / 1e6 for c, _ in pts], [v for _, v in pts], marker="o", label=policy,
                        lw=2.2 if policy in ("lru", "belady") else 1.0)
            if metric == "hit_rate":
                ax.axhline(bound, color="k", ls="--", lw=1, label="upper bound")
            else:
                ax.set_yscale("log")
            log_capacity_axis(ax, [c / 1e6 for c in caps], "device tokens per replica (millions)")
            ax.set_ylabel(label)
            ax.set_title(f"{conc:g} active sessions, {preset}")
        axes[0][-1].legend(fontsize=7)
        paths.append(save_figure(fig, out / name))
        plt.close(fig)
    return paths + draw_sessions(rows, out, plt)


def draw_sessions(rows: list[dict], out: Path, plt) -> list[Path]:
    """Part sessions: mean TTFT against device capacity per configuration (device alone, and with a host
    tier), at each concurrency; LRU with FCFS from part capacity too, so the whole cliff shows."""
    from experiments.common import log_capacity_axis

    sel = [r for r in rows if r["config"]["part"] == "sessions"]
    if not sel:
        return []
    preset = sel[0]["config"]["cost_preset"]
    concs = sorted({r["config"]["concurrency"] for r in sel})
    fig, axes = plt.subplots(len(concs), 1, figsize=(9, 4.5 * len(concs)), squeeze=False)  # stacked: legends beside
    for ax, conc in zip(axes[:, 0], concs, strict=True):
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            c = r["config"]
            if (c["concurrency"], c["cost_preset"], c["cache"]) != (conc, preset, "radix"):
                continue
            if c["part"] == "capacity" and c["eviction_policy"] == "lru":
                label = "lru (capacity grid)"
            elif c["part"] == "sessions":
                label = c["label"] + (f" + host {c['host_ratio']:g}x{_write(c)}" if c["host_ratio"] else "")
            else:
                continue
            lines.setdefault(label, []).append((c["capacity_tokens"] / 1e6, r["ttft_mean"]))
        colors = {name: f"C{i}" for i, name in enumerate(SESSION_CONFIGS)} | {"lru (capacity grid)": "k"}
        for label, pts in sorted(lines.items()):
            pts.sort()
            name = label.split(" + ")[0]  # one colour per configuration; dashed with a host tier
            # dotted: write_through; dash-dotted: segments
            style = ":" if "write_through" in label else "-." if "segments" in label else "--" if "host" in label \
                else "-"
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=label, color=colors[name],
                    ls=style, lw=2.2 if name.startswith(("lru", "session")) else 1.0)
        ax.set_yscale("log")
        log_capacity_axis(ax, sorted({c for pts in lines.values() for c, _ in pts}),
                          "device tokens per replica (millions)")
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title(f"sessions: {conc:g} active, {preset}")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))  # beside the plot: many rows
    return [save_figure(fig, out / "sessions_ttft_vs_capacity")]


