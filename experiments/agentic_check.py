"""The simulator checked against the engine on agent traffic: predicted and measured replays side by side.

``--overhead MEASURED PREDICTED`` measures the server's own seconds per request (``frontend_overhead``), which
``agentic_online --simulate --frontend-overhead`` takes.

``python -m experiments.agentic_check --pair NAME MEASURED PREDICTED [--pair ...] --out FILE`` reads each
configuration's two ``experiments.agentic_online`` folders (one run on a server, one ``--simulate`` with
``--orders``), joins their rows on (session, stream, turn) and writes a table (``FILE.md``) and the figures
(``FILE.json``): mean TTFT, p90 TTFT, hit rate and mean session completion, measured (one run, or the mean of
several arrival orders' runs given comma-separated) against predicted (mean over the orders, with its 95%
interval; and over the measured runs' own orders, ``_paired``), the relative errors, whether each is within
the targets (TTFT mean 15%, p90 25%, hit rate 0.02), and the ranking of the configurations by mean TTFT on
both sides.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from experiments.common import HelpFormatter, environment, run_cli, table
from radixkv.sim.metrics import interval

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
        row |= {f"{metric}_measured": meas["mean"], f"{metric}_measured_ci95": meas["ci95"],
                f"{metric}_predicted": pred["mean"], f"{metric}_ci95": pred["ci95"], f"{metric}_order0": p[metric],
                f"{metric}_predicted_paired": float(np.mean(paired)) if len(paired) == len(runs) else float("nan")}
        if metric == "hit_rate":
            row["hit_rate_error"] = pred["mean"] - meas["mean"]
        else:
            row[f"{metric}_error"] = pred["mean"] / meas["mean"] - 1
    row["within"] = all(abs(row[f"{k}_error"]) <= bound for k, bound in TARGETS.items())
    return row


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
    cols = ["config", "requests", "measured_orders", "ttft_mean_measured", "ttft_mean_measured_ci95",
            "ttft_mean_predicted", "ttft_mean_ci95", "ttft_mean_predicted_paired", "ttft_mean_error",
            "ttft_p90_measured", "ttft_p90_predicted", "ttft_p90_error", "hit_rate_measured", "hit_rate_predicted",
            "hit_rate_error", "session_completion_mean_measured", "session_completion_mean_predicted", "within"]
    text = table(rows, cols, {c: ".3g" for c in cols if c not in ("config", "requests", "within", "measured_orders")})
    same = "the same" if order["measured"] == order["predicted"] else "differs"
    text += (f"\n\nranking by mean TTFT, measured: {', '.join(order['measured'])}; predicted: "
             f"{', '.join(order['predicted'])} ({same})\n")
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    result = {"rows": rows, "ranking": order, "targets": TARGETS, "env": environment(),
              "pairs": [list(map(str, pair)) for pair in args.pair]}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run_cli(main)
