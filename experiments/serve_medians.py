"""Medians over repeated ``serve_bench`` runs: one row per run name, its repeats pooled.

``python -m experiments.serve_medians FILE.jsonl [FILE.jsonl ...]`` reads the ``kind: summary`` rows of
``experiments.serve_bench`` result files, groups them by run label with a trailing ``-<repeat>``
dropped (``vllm-sp2-0``, ``vllm-sp2-1``, ... are one group ``vllm-sp2``), and prints the median of each
figure per group, with how many runs it pooled, and writes them to ``<out>.jsonl``. docs/serving.md's
side-by-side table against vLLM's server is this command's output over the files in
``docs/figures/serving/``.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

from experiments.common import environment, parser, read_rows, run_cli, table, write_rows

FIGURES = ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "e2e_p50", "request_throughput", "output_tok_s",
           "hit_rate_usage")


def medians(rows: list[dict]) -> list[dict]:
    """Per run label (``-<repeat>`` dropped), the median of each of ``FIGURES`` over its summary rows."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("kind") == "summary":
            groups[re.sub(r"-\d+$", "", str(row["run"]))].append(row)
    return [{"run": name, "runs": len(group),
             **{f: statistics.median(r[f] for r in group) for f in FIGURES if all(r.get(f) is not None
                                                                                   for r in group)}}
            for name, group in groups.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    p = parser(__doc__.splitlines()[0], "results/serve_medians")
    p.add_argument("files", nargs="+", help="serve_bench result files (.jsonl)")
    args = p.parse_args(argv)
    rows = medians([row for f in args.files for row in read_rows(f)])
    if not rows:
        raise ValueError("no serve_bench summary rows in the files given")
    print(table(rows, ["run", "runs", *FIGURES], {f: ".3f" for f in FIGURES}))
    print("wrote", write_rows(args.out, [{**r, "config": vars(args), "env": environment()} for r in rows]))
    return rows


if __name__ == "__main__":
    run_cli(main)
