"""How a request's prefix-cache bookkeeping grows with its prompt length: vLLM v0 against v1 and the radix tree.

``python -m experiments.hash_growth`` times, for each cache (``hash-v0``,
``hash``, ``radix``) and prompt length L (1k, 4k, 16k, 64k tokens by default),
what one request pays the cache:

* a **cold** request: ``match_prefix`` of L fresh tokens in an empty cache (a
  miss), then ``insert`` of the L tokens;
* a **warm** request: ``match_prefix`` of the same L tokens again (a full hit).

Each repeat uses a fresh cache and a fresh random prompt (seeded numpy
generator); slot indices are ``np.arange(L)`` (a cache never frees memory
itself). Times are ``time.perf_counter`` seconds with the cyclic garbage
collector off during the timed calls (as ``timeit`` does), the median over
repeats; after ``--min-repeats`` a case stops once it has used
``--case-budget`` seconds, so v0's 64k case runs a few times, not ``--repeats``.
The growth exponent k of ``time ~ L^k`` is fitted by least squares on
log-log axes, over all lengths and (the tables' last column) over the last
step alone, where fixed per-call costs no longer hide the growth.

v0's ``stats()["hashed_tokens"]`` is recorded per request: block i hashes the
whole prefix up to its end, so an L-token request hashes about L^2 / (2B)
tokens, where v1 chains the parent block's key (L tokens, once) and the tree
walks its edges with memcmp. v1's warm lookup reuses the key chain its insert
remembered (radixkv's memo, the stand-in for the block hashes vLLM keeps on a
request), so it hashes nothing: a memcmp and a dict lookup per block.

Each call's user and kernel CPU seconds and minor page faults are recorded
too. Memory a call touches for the first time costs a page fault per 4 KiB,
microseconds each on a VM: at 64k tokens a call's 512 KiB buffers (the
query's bytes, the matched indices) take ~128 faults each whenever glibc has
handed the space back to the kernel in between, which can be most of a tree
lookup's time; a cache keeping O(L^2 / B) tokens per request (a v0 block
holding its whole prefix: about 2 GB at 64k) would pay more for its faults
than for its hashing.

Writes ``results/hash_growth.json`` (config, environment, results) and the
figure at ``--figure`` (``results/hash_growth.png``), and prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from experiments.common import add_settings, environment, names_from, parser, run_cli, table, with_ext
from radixkv import make_cache

CACHES = ("hash-v0", "hash", "radix")
# What the tables and the figure show: a per-repeat quantity's name -> its title.
MEASURES = {
    "cold_s": "cold request: lookup (miss) + insert, seconds",
    "warm_s": "warm request: lookup (full hit), seconds",
    "lookup_miss_s": "lookup of a cold prompt (miss), seconds",
    "insert_s": "insert of a cold prompt, seconds",
}
# Per repeat, each timed call (its name) gives wall seconds ``<call>_s``, the CPU seconds it spent in user and
# kernel mode (``_user_s``, ``_sys_s``) and the minor page faults it took (``_faults``); ``cold_*`` adds the miss
# and the insert. Kernel time is mostly faults: memory the call commits the first time.
CALLS = ("lookup_miss", "insert", "warm")
COUNTERS = ("s", "user_s", "sys_s", "faults")
# What is summarized and printed besides MEASURES: CPU time and page faults per request, then v0's hashed tokens.
EXTRAS = {
    "cold_user_s": "cold request, user CPU seconds",
    "warm_user_s": "warm request, user CPU seconds",
    "cold_faults": "cold request, minor page faults",
    "warm_faults": "warm request, minor page faults",
    "cold_hashed_tokens": "tokens hashed per cold request",
    "warm_hashed_tokens": "tokens hashed per warm request",
}


def lengths_from(text: str) -> list[int]:
    """The comma-separated prompt lengths in ``text`` (distinct integers >= 1); else ``ValueError``."""
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--lengths: comma-separated integers, got {text!r}") from None
    if min(lengths) < 1 or len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths: distinct lengths >= 1, got {text!r}")
    return lengths


def build_cache(name: str, args: argparse.Namespace) -> Any:
    """A fresh, empty cache ``name`` at the command's granularity (radix: ``--page-size``, hash: ``--block-size``)."""
    return make_cache(name, page_size=args.page_size, block_size=args.block_size)


def _hashed(cache: Any) -> int | None:
    """Tokens the cache has hashed so far (v0 counts them), else None."""
    return cache.stats().get("hashed_tokens")


def _timed(fn: Callable[[], object]) -> tuple[float, float, float, int]:
    """``fn()``'s wall seconds (``perf_counter``), user and kernel CPU seconds and minor page faults.

    The cyclic GC is off meanwhile: a collection landing in one call would
    time the whole heap (v0's caches are reference cycles), not the call.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        if was_enabled:
            gc.enable()
    return wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt


def one_request_pair(cache: Any, tokens: np.ndarray) -> dict[str, Any]:
    """Time a cold request (miss + insert) then a warm one (full hit) of ``tokens`` on an empty ``cache``.

    Returns the counters of every call (see ``CALLS``), their ``cold_*``
    sums, the tokens v0 hashed per request (None for the other caches) and
    the warm lookup's hit length.
    """
    slots = np.arange(len(tokens), dtype=np.int64)
    hits: list[int] = []
    calls = {"lookup_miss": lambda: cache.match_prefix(tokens), "insert": lambda: cache.insert(tokens, slots),
             "warm": lambda: hits.append(cache.match_prefix(tokens).length)}
    row: dict[str, Any] = {}
    hashed: dict[str, int | None] = {}
    for call, fn in calls.items():
        before = _hashed(cache)
        row.update(zip((f"{call}_{c}" for c in COUNTERS), _timed(fn), strict=True))
        hashed[call] = None if before is None else _hashed(cache) - before
    for c in COUNTERS:
        row[f"cold_{c}"] = row[f"lookup_miss_{c}"] + row[f"insert_{c}"]
    row["warm_hit_tokens"] = hits[0]
    row["cold_hashed_tokens"] = None if hashed["insert"] is None else hashed["lookup_miss"] + hashed["insert"]
    row["warm_hashed_tokens"] = hashed["warm"]
    return row


def measure_case(name: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """Up to ``--repeats`` fresh (cache, prompt) pairs of one cache and length; after ``--min-repeats`` a case
    stops once it has used ``--case-budget`` seconds. Medians of every quantity, plus the repeats themselves.

    The prompts come from a generator seeded by (``--seed``, length), so every cache gets the same prompts
    and how many repeats an earlier case ran changes nothing.
    """
    rng = np.random.default_rng([args.seed, length])
    repeats: list[dict[str, Any]] = []
    start = time.perf_counter()
    while len(repeats) < args.repeats and (len(repeats) < args.min_repeats
                                           or time.perf_counter() - start < args.case_budget):
        tokens = rng.integers(0, args.vocab_size, size=length, dtype=np.int64)
        cache = build_cache(name, args)
        repeats.append(one_request_pair(cache, tokens))
        del cache
        gc.collect()  # HashV0Cache is a reference cycle (its root handle names it): free it here, untimed
    keys = [*MEASURES, *(k for k in EXTRAS if "hashed" not in k)]
    medians = {k: float(np.median([r[k] for r in repeats])) for k in keys}
    fixed = {k: repeats[0][k] for k in ("cold_hashed_tokens", "warm_hashed_tokens", "warm_hit_tokens")}
    return {"cache": name, "length": length, **medians, **fixed, "repeats": len(repeats),
            "case_seconds": time.perf_counter() - start, "per_repeat": repeats}


def fit_exponent(lengths: list[int], values: list[float | None]) -> float | None:
    """Least-squares slope of log(value) on log(length): k in value ~ length^k. None with < 2 usable points."""
    pts = [(x, y) for x, y in zip(lengths, values, strict=True) if y is not None and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    xs, ys = zip(*pts, strict=True)
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def local_exponents(lengths: list[int], values: list[float | None]) -> list[float | None]:
    """The slope between each pair of successive lengths (where the growth bends, the fit alone hides it)."""
    return [fit_exponent(list(xs), list(ys)) for xs, ys in zip(pairwise(lengths), pairwise(values), strict=True)]


def summarize(cases: list[dict[str, Any]], caches: list[str], lengths: list[int]) -> dict[str, Any]:
    """Per cache and measure: the medians by length, the fitted exponent and the local slopes; v0's hashed
    tokens by length with their exponent."""
    out: dict[str, Any] = {}
    for name in caches:
        rows = [next(c for c in cases if c["cache"] == name and c["length"] == n) for n in lengths]
        per: dict[str, Any] = {}
        for key in [*MEASURES, *EXTRAS]:
            values = [r[key] for r in rows]
            if all(v is None for v in values):
                continue
            per[key] = {"by_length": dict(zip(map(str, lengths), values, strict=True)),
                        "exponent": fit_exponent(lengths, values), "local_exponents": local_exponents(lengths, values)}
        out[name] = per
    return out


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def print_tables(summary: dict[str, Any], lengths: list[int]) -> None:
    """One table per measure (cache | one column per length | fitted exponent | slope over the last step, the
    growth once fixed per-call costs no longer dominate), then v0's hashed tokens."""
    cols = [_length_label(n) for n in lengths]
    last = f"slope {cols[-2]}-{cols[-1]}" if len(cols) > 1 else "slope"
    for key, title in [*MEASURES.items(), *EXTRAS.items()]:
        rows = []
        for name, per in summary.items():
            if key in per:
                by = per[key]["by_length"]
                rows.append({"cache": name, **{c: by[str(n)] for c, n in zip(cols, lengths, strict=True)},
                             "exponent": per[key]["exponent"], last: (per[key]["local_exponents"] or [None])[-1]})
        if rows:
            fmt = ",.0f" if key.endswith(("tokens", "faults")) else ".3e"
            print(f"\n== {title}")
            print(table(rows, ["cache", *cols, "exponent", last],
                        {**dict.fromkeys(cols, fmt), "exponent": ".2f", last: ".2f"}))


def draw(summary: dict[str, Any], lengths: list[int], path: str | Path) -> Path:
    """Log-log seconds per request against prompt length, cold and warm side by side, one line per cache
    with its fitted exponent in the legend, and dotted L and L^2 guides through the first point."""
    import matplotlib  # here, not at import: the measurement needs no plotting library

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key in zip(axes, ("cold_s", "warm_s"), strict=True):
        for i, (name, per) in enumerate(summary.items()):
            ys = [per[key]["by_length"][str(n)] for n in lengths]
            k = per[key]["exponent"]
            label = name if k is None else f"{name} (exponent {k:.2f})"
            ax.loglog(lengths, ys, "o-", color=f"C{i}", label=label)
        first = min(per[key]["by_length"][str(lengths[0])] for per in summary.values())
        grid = np.array(lengths, dtype=float) / lengths[0]
        for power, style in ((1, ":"), (2, "--")):
            ax.loglog(lengths, first * grid**power, style, color="gray", lw=1, label="∝ L" if power == 1 else "∝ L²")
        ax.set_xlabel("prompt length L (tokens)")
        ax.set_title(MEASURES[key].split(",")[0])
        ax.legend(fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("seconds per request (median)")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none): timings mean little without it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docs); bad values are a ``ValueError`` or argparse's usage error."""
    p = parser(__doc__.splitlines()[0], "results/hash_growth")
    p.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated subset of {list(CACHES)}")
    p.add_argument("--lengths", default="1024,4096,16384,65536", help="prompt lengths in tokens")
    add_settings(p, "page_size", "block_size")
    p.add_argument("--repeats", type=int, default=7, help="fresh (cache, prompt) pairs per case, at most")
    p.add_argument("--min-repeats", type=int, default=3, help="repeats every case runs, whatever its time")
    p.add_argument("--case-budget", type=float, default=10.0,
                   help="seconds after which a case stops repeating, once it has run --min-repeats times")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn from [0, vocab-size)")
    p.add_argument("--figure", default="results/hash_growth.png", help="where the figure goes")
    p.add_argument("--no-plot", action="store_true", help="write the .json only")
    args = p.parse_args(argv)
    if min(args.block_size, args.page_size, args.repeats, args.min_repeats, args.vocab_size) < 1 \
            or args.case_budget < 0:
        p.error("--block-size, --page-size, --repeats, --min-repeats and --vocab-size must be >= 1, "
                "--case-budget >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure every (cache, length), print the tables, write the JSON (and figure); return what was written."""
    args = parse_args(argv)
    caches = names_from(args.caches, CACHES, "--caches")
    lengths = lengths_from(args.lengths)
    warmup = np.random.default_rng([args.seed, 0]).integers(0, args.vocab_size, size=min(lengths), dtype=np.int64)
    t0 = time.perf_counter()
    for name in caches:  # untimed: first calls pay for imports and lazily built state
        one_request_pair(build_cache(name, args), warmup)
    cases = [measure_case(name, n, args) for name in caches for n in lengths]
    summary = summarize(cases, caches, lengths)
    print_tables(summary, lengths)
    runtime = time.perf_counter() - t0
    doc = {"config": {**vars(args), "caches": caches, "lengths": lengths, "cpu": cpu_model(),
                      "timer": "time.perf_counter, cyclic GC off during timed calls, median over repeats"},
           "env": environment(), "runtime_s": runtime, "summary": summary, "results": cases}
    out = with_ext(args.out, ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    written = [out]
    if not args.no_plot:
        written.append(draw(summary, lengths, args.figure))
    print(f"\n{runtime:.1f} s of measurement ({cpu_model()}); wrote", *written)
    return doc


if __name__ == "__main__":
    run_cli(main)
