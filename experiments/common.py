"""What every experiment shares: its CLI basics, result files and tables.

Each experiment writes ``<out>.jsonl`` (one JSON object per run, each with its
full config), ``<out>.png`` for its figure, and prints a table. Plotting reads
only the rows, so a figure can be redrawn from the file.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default (unless its help already says what the default is) and the
    description's own line breaks: every experiment's command uses it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def parser(description: str, out: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every experiment has (``--seed``, ``--out``); its namespace answers
    a setting's alias as the setting (``args.kv_cache_tokens`` is ``args.capacity_tokens``), and
    ``add_settings`` adds the settings' flags (``radixkv.settings``)."""
    from radixkv.settings import SettingsParser  # here: the figures-only notebook reads common without radixkv
    from radixkv.stack import StackConfig

    p = SettingsParser(description=description, formatter_class=HelpFormatter, classes=(StackConfig,))
    p.add_argument("--seed", type=int, default=0, help="seed for workloads and random policies")
    p.add_argument("--out", default=out, help="results path without extension: writes .jsonl and .png")
    return p


def add_settings(p: argparse.ArgumentParser, *names: str, **defaults) -> None:
    """The flags of these ``StackConfig`` settings, generated from their fields (help, choices, aliases), with
    this experiment's ``defaults`` where they differ from the engine's."""
    from radixkv.settings import add_flags
    from radixkv.stack import StackConfig

    add_flags(p, StackConfig, names, defaults=defaults)


def add_budget_flags(p: argparse.ArgumentParser) -> None:
    """``--max-batch-tokens`` and ``--chunked-prefill-size`` for a simulator experiment: without them every
    admitted prompt is prefilled whole in one step; with them each step is scheduled as the engine schedules
    it (its defaults are 4,096 and 1,024). ``budgets`` reads them back, ``check_budgets`` checks them."""
    from radixkv.settings import add_flags
    from radixkv.stack import StackConfig

    add_flags(p, StackConfig, ("max_batch_tokens", "chunked_prefill_size"),
              defaults={"max_batch_tokens": None, "chunked_prefill_size": None},
              helps={"max_batch_tokens": "tokens per step, as the engine's (4,096 there); unlimited when omitted",
                     "chunked_prefill_size": "tokens per prefill chunk, as the engine's (1,024 there); whole "
                                             "prompts when omitted"})


def budgets(args: argparse.Namespace) -> dict:
    """The ``simulate()`` keywords of ``add_budget_flags``'s flags."""
    return {"max_batch_tokens": args.max_batch_tokens, "chunked_prefill_size": args.chunked_prefill_size}


def check_budgets(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A budget below 1 is a usage error of ``p`` (checked before any work)."""
    if any(v is not None and v < 1 for v in budgets(args).values()):
        p.error("--max-batch-tokens and --chunked-prefill-size must be >= 1")


def names_from(text: str, allowed: Iterable[str], flag: str) -> list[str]:
    """The comma-separated names in ``text``; a ``ValueError`` listing the choices if one is not ``allowed``."""
    names, allowed = text.split(","), list(allowed)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"{flag}: unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def fractions_from(text: str, flag: str) -> list[float]:
    """The comma-separated numbers >= 0 in ``text`` (capacities, as fractions or tokens); else ``ValueError``."""
    try:
        fracs = [float(f) for f in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(f) and f >= 0 for f in fracs):
        raise ValueError(f"{flag}: values must be finite and >= 0, got {text!r}")
    return fracs


def run_cli(main: Callable[[], object]) -> None:
    """Run an experiment's ``main()`` as a command: bad input (a ``ValueError``, a missing file) is one line on
    stderr and exit status 2, as argparse reports a bad flag, not a traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def environment() -> dict:
    """Where the numbers came from: versions, the code's git commit (and whether it had local changes), the command."""
    return {"python": platform.python_version(), "numpy": np.__version__, "torch": _version("torch"),
            "radixkv": _version("radixkv"), **_git_state(), "platform": platform.platform(), "argv": sys.argv,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


@functools.cache  # environment() is called per result row; the answer does not change within a run
def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _git_state() -> dict:
    """``git_commit`` and ``git_dirty`` of the checkout these experiments run from (None outside a checkout)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    if commit.returncode != 0:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def with_ext(out: str | Path, ext: str) -> Path:
    """``out`` with extension ``ext``. Unlike ``Path.with_suffix`` it keeps dots in the name
    (``results/cap0.5`` -> ``results/cap0.5.jsonl``), replacing only an extension the experiments write."""
    path = Path(out)
    if path.suffix in _OUR_EXTS:
        path = path.with_suffix("")
    return path.with_name(path.name + ext)


_OUR_EXTS = (".jsonl", ".png", ".json")


def write_rows(out: str | Path, rows: Iterable[dict]) -> Path:
    """Write one JSON object per line to ``<out>.jsonl``; returns the path. NaN and infinities become
    null, so every line is valid JSON."""
    path = with_ext(out, ".jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(_finite(row), default=_jsonable, allow_nan=False) + "\n")
    return path


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def read_rows(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _jsonable(x):
    if isinstance(x, np.generic):
        return _finite(x.item())
    if isinstance(x, np.ndarray):
        return _finite(x.tolist())
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


def log_capacity_axis(ax, millions: Iterable[float], label: str) -> None:
    """A log x axis ticked at each capacity (in millions of tokens, as plain numbers), labelled ``label``."""
    caps = sorted(set(millions))
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel(label)


def save_figure(fig, out: str | Path) -> Path:
    """Write ``fig`` as PNG next to ``out`` (its extension replaced) and close it; the path written."""
    path = with_ext(out, ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)  # pyplot keeps every figure until closed: a long session (the tests) would hold them all
    return path
