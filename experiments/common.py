"""What every experiment shares: its CLI basics, result files and tables.

Each experiment writes ``<out>.jsonl`` (one JSON object per run, each with its
full config), ``<out>.png`` for its figure, and prints a table. Plotting reads
only the rows, so a figure can be redrawn from the file.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def parser(description: str, out: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every experiment has (``--seed``, ``--out``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="seed for workloads and random policies")
    p.add_argument("--out", default=out, help="results path without extension: writes .jsonl and .png")
    return p


def environment() -> dict:
    """Where the numbers came from."""
    return {"python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
            "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_rows(out: str | Path, rows: Iterable[dict]) -> Path:
    """Write one JSON object per line to ``<out>.jsonl``; returns the path."""
    path = Path(out).with_suffix(".jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=_jsonable) + "\n")
    return path


def read_rows(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def table(rows: Sequence[dict], columns: Sequence[str], formats: dict[str, str] | None = None) -> str:
    """A plain-text table of ``rows`` over ``columns``."""
    formats = formats or {}
    cells = [[format(r.get(c, ""), formats.get(c, "")) if r.get(c) is not None else "" for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, "-" * len(line), *body])


def save_figure(fig, out: str | Path) -> Path:
    path = Path(out).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
