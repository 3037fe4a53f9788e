"""The tree's cost per request against an older commit's, in alternation: ``experiments.bench_tree`` (radix,
LRU, page 1, its 1,600-request multi-turn trace) run on ``git archive REV radixkv`` and on this checkout's
``radixkv`` in turn, ``--alternations`` times (which goes first alternates too), each run the median of
``--repeats``. Reports each side's median microseconds a request and the mean ratio (this checkout over REV)
with its 95% interval over the alternations (Student's t), which resolves differences well below the spread
of single runs on a noisy machine. The bench harness is this checkout's, so both sides run the same trace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.common import HelpFormatter, environment, run_cli
from radixkv.sim.metrics import interval

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "radix x1 page=1"


def request_us(root: Path, repeats: int, scratch: Path) -> float:
    """One run of the bench with ``root``'s radixkv: the median over ``repeats`` of a request's microseconds."""
    out = scratch / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(ROOT)]))
    subprocess.run([sys.executable, "-m", "experiments.bench_tree", "--caches", "radix", "--page-sizes", "1",
                    "--scale", "0", "--repeats", str(repeats), "--out", str(out)], cwd=scratch, env=env, check=True,
                   capture_output=True)
    row = next(r for r in json.loads(out.read_text())["results"] if r["name"] == CONFIG)
    return float(row["summary"]["request_us"]["median"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--rev", default="e744e1b", help="the commit to compare with (its radixkv, by git archive)")
    p.add_argument("--alternations", type=int, default=30, help="runs of each side, alternating")
    p.add_argument("--repeats", type=int, default=5, help="bench_tree repeats per run (a run reports their median)")
    p.add_argument("--out", default="results/bench_tree_versus.json", help="the figures, as JSON")
    args = p.parse_args(argv)
    if args.alternations < 2 or args.repeats < 1:
        p.error("--alternations must be >= 2 and --repeats >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        scratch, old = Path(tmp), Path(tmp) / "old"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "radixkv"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        sides = {"rev": old, "here": ROOT}
        runs: dict[str, list[float]] = {"rev": [], "here": []}
        for i in range(args.alternations):
            for side in ("rev", "here") if i % 2 == 0 else ("here", "rev"):
                runs[side].append(request_us(sides[side], args.repeats, scratch))
    ratio = interval([h / r for h, r in zip(runs["here"], runs["rev"], strict=True)])
    result = {"rev": args.rev, "config": vars(args), "env": environment(), "request_us": runs,
              "rev_median_us": statistics.median(runs["rev"]), "here_median_us": statistics.median(runs["here"]),
              "ratio_mean": ratio["mean"], "ratio_ci95": ratio["ci95"]}
    print(f"radix page 1, us a request: {args.rev} {result['rev_median_us']:.2f}, here {result['here_median_us']:.2f}; "
          f"here / {args.rev} = {ratio['mean']:.3f} ± {ratio['ci95']:.3f} over {args.alternations} alternations")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run_cli(main)
