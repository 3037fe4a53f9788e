"""The simulator checked against the engine on agent traffic: predicted and measured replays side by side.

``--overhead MEASURED PREDICTED`` measures the server's own seconds per request (``frontend_overhead``), which
``agentic_online --simulate --frontend-overhead`` takes.

``python -m experiments.agentic_check --pair NAME MEASURED PREDICTED [--pair ...] --out FILE`` reads each
configuration's two ``experiments.agentic_online`` folders (one run on a server, one ``--simulate`` with
``--orders``), joins their rows on (session, stream, turn) and writes a table (``FILE.md``) and the figures
(``FILE.json``): mean TTFT, p90 TTFT, hit rate and mean session completion, measured (one run, or the mean of
several arrival orders' runs given comma-separated) against predicted (mean over the orders, with its 95%
interval; and over the measured runs' own orders, ``_paired``), the errors of both (``_error`` against the
simulator's mean over all its orders, as the targets are stated; ``_error_paired`` against its mean over the
measured orders), whether each is within the targets (TTFT mean 15%, p90 25%, hit rate 0.02), and the ranking
of the configurations by mean TTFT on both sides.

Two rankings can differ only where a side can tell the two configurations apart: ``ranking_pairs`` compares
every two configurations by their per-order differences in mean TTFT (over the orders both measured, and over
all the simulator's orders), and calls a pair that the two sides order oppositely a *tie* where neither side's
95% interval of the difference excludes zero, a *conflict* where one does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from experiments.common import HelpFormatter, environment, run_cli, table
from radixkv.sim.metrics import interval, separated

TARGETS = {"ttft_mean": 0.15, "ttft_p90": 0.25, "hit_rate": 0.02}  # relative, relative, absolute


def read(folder: str | Path) -> tuple[list[dict], dict]:
    """A replay folder's rows and summary."""
    folder = Path(folder)
    rows = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines() if line.strip()]
    return rows, json.loads((folder / "summary.json").read_text())


def compare(name: str, measured: str | Path, predicted: str | Path) -> dict:
    """One configuration's row of the check; ``ValueError`` where the replays are not the same requests.
    ``measured``: one server replay folder, or several joined by commas (the same configuration in other
    arrival orders, ``--order``): the measured figures are then their mean (``_ci95`` its interval), and
    ``_paired`` gives the simulator's mean over the same orders beside its mean over all of its orders."""
    folders = str(measured).split(",")
    runs = [read(folder) for folder in folders]
    p_rows, p = read(predicted)
    key = lambda r: (r["session"], r["stream"], r["turn"])  # noqa: E731
    for m_rows, _ in runs:
        if sorted(map(key, m_rows)) != sorted(map(key, p_rows)):
            raise ValueError(f"{name}: {measured} and {predicted} replayed different requests")
    measured_orders = [_order(folder) for folder in folders]
    orders = p.get("orders", {})
    first = runs[0][1]
    row = {"config": name, "requests": first["finished"], "failed": first["requests"] - first["finished"],
           "measured_orders": measured_orders}
    for metric in ("ttft_mean", "ttft_p90", "hit_rate", "session_completion_mean"):
        pred = orders.get(metric, {"mean": p[metric], "ci95": float("nan"), "values": [p[metric]]})
        meas = interval([m[metric] for _, m in runs])
        paired = [pred["values"][o] for o in measured_orders if o < len(pred["values"])]
        paired_mean = float(np.mean(paired)) if len(paired) == len(runs) else float("nan")
        row |= {f"{metric}_measured": meas["mean"], f"{metric}_measured_ci95": meas["ci95"],
                f"{metric}_measured_values": meas["values"], f"{metric}_predicted_values": list(pred["values"]),
                f"{metric}_predicted": pred["mean"], f"{metric}_ci95": pred["ci95"], f"{metric}_order0": p[metric],
                f"{metric}_predicted_paired": paired_mean,
                f"{metric}_error": _error(metric, pred["mean"], meas["mean"]),
                f"{metric}_error_paired": _error(metric, paired_mean, meas["mean"])}
    row["within"] = all(abs(row[f"{k}_error"]) <= bound for k, bound in TARGETS.items())
    row["within_paired"] = all(abs(row[f"{k}_error_paired"]) <= bound for k, bound in TARGETS.items())
    return row


def _error(metric: str, predicted: float, measured: float) -> float:
    """The hit rate's error is a difference; the others' are relative."""
    return predicted - measured if metric == "hit_rate" else predicted / measured - 1


def ranking_pairs(rows: list[dict], metric: str = "ttft_mean") -> list[dict]:
    """Every two configurations compared on both sides by their per-order differences in ``metric``: on the
    engine over the orders both measured, in the simulator over all its orders (the same orders for the two
    configurations, so each difference is paired). ``verdict``: ``agree`` where the two sides' mean differences
    have the same sign, else ``tie`` where neither side's 95% interval of the difference excludes zero (a
    single measured order has no interval) and ``conflict`` where one does."""
    zero = {"mean": 0.0, "ci95": 0.0}
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            ma = dict(zip(a["measured_orders"], a[f"{metric}_measured_values"], strict=True))
            mb = dict(zip(b["measured_orders"], b[f"{metric}_measured_values"], strict=True))
            common = sorted(set(ma) & set(mb))
            measured = interval([ma[o] - mb[o] for o in common] if common else
                                [np.mean(list(ma.values())) - np.mean(list(mb.values()))])
            pa, pb = a[f"{metric}_predicted_values"], b[f"{metric}_predicted_values"]
            predicted = interval([x - y for x, y in zip(pa, pb, strict=False)])
            agree = np.sign(measured["mean"]) == np.sign(predicted["mean"])
            resolved = separated(measured, zero) or separated(predicted, zero)
            out.append({"a": a["config"], "b": b["config"], "measured_orders": common,
                        "measured_difference": measured["mean"], "measured_ci95": measured["ci95"],
                        "predicted_difference": predicted["mean"], "predicted_ci95": predicted["ci95"],
                        "verdict": "agree" if agree else ("conflict" if resolved else "tie")})
    return out


def _order(folder: str | Path) -> int:
    """The arrival order a server replay ran (its ``config.json``; 0 where it does not say)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return int(config.get("config", {}).get("order", 0))


def frontend_overhead(measured: str | Path, predicted: str | Path, small: int = 128) -> dict:
    """The server's own seconds per request, from a replay and its simulation without them: the median of
    measured less predicted TTFT over the requests that computed at most ``small`` prompt tokens (where the
    engine's work is least and the server's shows)."""
    m = {(r["session"], r["stream"], r["turn"]): r for r in read(measured)[0] if not r.get("error")}
    p = {(r["session"], r["stream"], r["turn"]): r for r in read(predicted)[0]}
    gaps = [m[k]["ttft"] - p[k]["ttft"] for k in m if p[k]["prompt_tokens"] - p[k]["cached_tokens"] <= small]
    if not gaps:
        raise ValueError("no request computed few enough tokens to measure the server's overhead")
    return {"frontend_overhead": float(np.median(gaps)), "requests": len(gaps), "of": len(m)}


def ranking(rows: list[dict], side: str) -> list[str]:
    return [r["config"] for r in sorted(rows, key=lambda r: r[f"ttft_mean_{side}"])]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "MEASURED", "PREDICTED"),
                   help="a configuration's name, its server replay folder (or several, comma-separated: the same "
                   "configuration in other --order's, averaged) and its --simulate folder")
    p.add_argument("--overhead", nargs=2, metavar=("MEASURED", "PREDICTED"), default=None,
                   help="print the server's own seconds per request (frontend_overhead) from a replay and its "
                   "simulation with --frontend-overhead 0, and stop")
    p.add_argument("--out", default="results/agentic_check", help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    if args.overhead:
        found = frontend_overhead(*args.overhead)
        print(json.dumps(found))
        return found
    if not args.pair:
        p.error("give --pair (one or more) or --overhead")
    rows = [compare(*pair) for pair in args.pair]
    order = {"measured": ranking(rows, "measured"), "predicted": ranking(rows, "predicted")}
    pairs = ranking_pairs(rows)
    cols = ["config", "requests", "measured_orders", "ttft_mean_measured", "ttft_mean_measured_ci95",
            "ttft_mean_predicted", "ttft_mean_ci95", "ttft_mean_predicted_paired", "ttft_mean_error",
            "ttft_mean_error_paired", "ttft_p90_measured", "ttft_p90_predicted", "ttft_p90_error",
            "ttft_p90_error_paired", "hit_rate_measured", "hit_rate_predicted", "hit_rate_error",
            "hit_rate_error_paired", "session_completion_mean_measured", "session_completion_mean_predicted",
            "within", "within_paired"]
    flags = ("config", "requests", "within", "within_paired", "measured_orders")
    text = table(rows, cols, {c: ".3g" for c in cols if c not in flags})
    same = "the same" if order["measured"] == order["predicted"] else "differs"
    text += (f"\n\nranking by mean TTFT, measured: {', '.join(order['measured'])}; predicted: "
             f"{', '.join(order['predicted'])} ({same})\n")
    pair_cols = ["a", "b", "measured_orders", "measured_difference", "measured_ci95", "predicted_difference",
                 "predicted_ci95", "verdict"]
    text += "\npaired differences in mean TTFT (a less b, seconds):\n\n" + table(
        pairs, pair_cols, {c: ".3g" for c in pair_cols[3:7]}) + "\n"
    conflicts = [f"{q['a']} / {q['b']}" for q in pairs if q["verdict"] == "conflict"]
    text += f"\nranking conflicts: {', '.join(conflicts) if conflicts else 'none'}\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    result = {"rows": rows, "ranking": order, "ranking_pairs": pairs, "targets": TARGETS, "env": environment(),
              "pairs": [list(map(str, pair)) for pair in args.pair]}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run_cli(main)
