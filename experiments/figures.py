"""Redraw the paper's figures 2-6 from the experiments' JSONL results.

``python -m experiments.figures [--results-dir docs/figures] [--out-dir docs/figures]``
reads ``ablation.jsonl`` (figures 2 and 6), ``mooncake.jsonl`` (3), the
multi-turn results (4; ``--multiturn``, by default ``multiturn.jsonl`` in the
results folder or else its newest ``multiturn-*.jsonl``) and
``block_size.jsonl`` (5), and writes ``fig2_policy_bounds.png``,
``fig3_mooncake_capacity.png``, ``fig4_multiturn_ttft.png``,
``fig5_block_size.png`` and ``fig6_ablation.png``. A figure whose JSONL is
missing is skipped with a message. Nothing is rerun: the rows are the figures'
only input (see ``experiments.plots``). Figure 1 is ``python -m
experiments.fig3_tree_steps``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments import plots  # noqa: E402
from experiments.common import HelpFormatter, names_from, read_rows, run_cli, save_figure  # noqa: E402

FIGURES: dict[str, tuple[str, Callable]] = {  # output name -> (source, plot function)
    "fig2_policy_bounds": ("ablation", plots.fig2_policy_bounds),
    "fig3_mooncake_capacity": ("mooncake", plots.fig3_mooncake_capacity),
    "fig4_multiturn_ttft": ("multiturn", plots.fig4_multiturn_ttft),
    "fig5_block_size": ("block_size", plots.fig5_block_size),
    "fig6_ablation": ("ablation", plots.fig6_ablation),
}


def source_path(results_dir: Path, name: str, multiturn: str | None = None) -> Path | None:
    """The JSONL file a figure reads, or None when there is none."""
    if name == "multiturn" and multiturn:
        return Path(multiturn) if Path(multiturn).is_file() else None
    path = results_dir / f"{name}.jsonl"
    if path.is_file():
        return path
    if name == "multiturn":  # experiments.multiturn's default names: multiturn-<timestamp>.jsonl
        runs = sorted(results_dir.glob("multiturn-*.jsonl"))
        return runs[-1] if runs else None
    return None


def draw(results_dir: str | Path = "docs/figures", out_dir: str | Path = "docs/figures",
         multiturn: str | None = None, only: list[str] | None = None) -> dict[str, Path]:
    """Draw every figure (or those in ``only``) whose source exists; returns name -> PNG path.

    A ``results_dir`` that is not a directory (where a figure to draw reads
    from it), or a ``multiturn`` file that does not exist, is a
    ``FileNotFoundError``: a typo would otherwise only print a skip for every
    figure.
    """
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if multiturn and not Path(multiturn).is_file():
        raise FileNotFoundError(f"multi-turn results {multiturn} not found")
    written, cache = {}, {}
    for name, (source, fn) in FIGURES.items():
        if only and name not in only:
            continue
        if not (source == "multiturn" and multiturn) and not results_dir.is_dir():
            raise FileNotFoundError(f"results directory {results_dir} does not exist")
        path = source_path(results_dir, source, multiturn)
        if path is None:
            where = multiturn if source == "multiturn" and multiturn else results_dir / f"{source}.jsonl"
            print(f"skip {name}: no {where}")
            continue
        t0 = time.perf_counter()
        if path not in cache:
            cache[path] = read_rows(path)
        fig = fn(cache[path])
        written[name] = save_figure(fig, out_dir / name)
        plt.close(fig)
        print(f"{name}: {path} -> {written[name]} ({time.perf_counter() - t0:.1f} s)")
    return written


def main(argv: list[str] | None = None) -> dict[str, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--results-dir", default="docs/figures", help="where the experiments' .jsonl files are")
    p.add_argument("--out-dir", default="docs/figures", help="where the PNGs go")
    p.add_argument("--multiturn", default=None,
                   help="multi-turn JSONL for figure 4 (default: <results-dir>/multiturn.jsonl, else the newest "
                        "<results-dir>/multiturn-*.jsonl)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {list(FIGURES)}")
    args = p.parse_args(argv)
    only = names_from(args.only, FIGURES, "--only") if args.only else None
    return draw(args.results_dir, args.out_dir, args.multiturn, only)


if __name__ == "__main__":
    run_cli(main)
