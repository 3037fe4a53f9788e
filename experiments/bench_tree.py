"""Micro-benchmark of the prefix cache's tree operations on a seeded multi-turn chat trace.

Usage: ``python -m experiments.bench_tree [--quick] [--out results/bench_tree.json]``.

The trace: ``--conversations`` chats of ``--turns`` turns each. Every group of
``--group`` chats shares one ``--system-tokens`` system prompt; each turn adds
``--user-tokens`` user tokens (part of its prompt) and ``--gen-tokens``
generated tokens, so turn t's prompt is the system prompt, every earlier
user/answer pair and the new user tokens, and after serving the full sequence
(prompt + answer) is inserted. Chats start at random times and their turns
are spaced by random gaps, so requests of different chats interleave.

Requests are served one at a time, as an engine's scheduler would do it:
match the prompt, lock the match, evict when the allocator is short, allocate
the missing slots, insert the full sequence, free the duplicate slots and (with
pages) the unaligned tail the tree does not keep, unlock. Only the cache calls
are timed (``time.perf_counter_ns``); the allocator work is not. The KV pool
holds ``--capacity-frac`` of the trace's unique tokens, so eviction runs; a
run with a pool large enough never to evict gives the unlimited hit rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import radixkv
from experiments.common import HelpFormatter, run_cli
from radixkv import HashBlockCache, PrefixCache, RadixCache, SlotAllocator

CacheFactory = Callable[[int], PrefixCache]

# Cache name -> factory taking the page size (the block size for hash caches). Add other caches here.
CACHES: dict[str, CacheFactory] = {
    "radix": lambda page: RadixCache(page_size=page),
    "hash": lambda page: HashBlockCache(block_size=page, hash_algo="sha256"),
    "hash-xxhash": lambda page: HashBlockCache(block_size=page, hash_algo="xxhash"),
}
# Hash caches run at block sizes > 1 only (a block of one token is a hash per token) and on the base trace.
BLOCK_CACHES = {"hash", "hash-xxhash"}

VOCAB = 32000
# Chat starts are uniform over [0, START_SPAN_S) seconds whatever the number of chats, so a scaled
# trace is the base trace made denser: ten times the chats at once in a ten times larger pool.
START_SPAN_S = 400.0
MEAN_TURN_GAP_S = 30.0  # exponential gap between two turns of one chat
OPS = ("match", "insert", "evict", "lock", "unlock")
TARGET_US = 10.0  # target mean match / insert cost at page 1
TARGET_EVICT_RATIO = 2.0  # target bound on evict cost, scaled run / base run


@dataclass
class Trace:
    """A request trace. Request prompts and full sequences are prefixes of their chat's tokens."""

    conv_tokens: list[np.ndarray]  # chat c's final sequence (int64)
    requests: list[tuple[int, int, int]]  # (chat, prompt length, full length), in arrival order
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class Job:
    """One benchmark configuration: a cache on a trace with one pool size and token format."""

    name: str
    cache: str
    scale: int
    page_size: int
    as_lists: bool
    capacity: int
    unlimited_capacity: int
    repeats: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    unlimited: dict[str, Any] | None = None


def make_trace(conversations: int, turns: int, group: int, system_tokens: int,
               user_tokens: int, gen_tokens: int, seed: int) -> Trace:
    """Build the seeded multi-turn trace (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n_groups = -(-conversations // group)
    systems = [rng.integers(0, VOCAB, system_tokens, dtype=np.int64) for _ in range(n_groups)]
    turn_len = user_tokens + gen_tokens
    conv_tokens = [
        np.concatenate([systems[c // group], rng.integers(0, VOCAB, turns * turn_len, dtype=np.int64)])
        for c in range(conversations)
    ]
    starts = rng.uniform(0.0, START_SPAN_S, conversations)
    gaps = rng.exponential(MEAN_TURN_GAP_S, (conversations, turns))
    gaps[:, 0] = 0.0
    arrivals = starts[:, None] + np.cumsum(gaps, axis=1)
    events = []
    for c in range(conversations):
        for t in range(turns):
            prompt = system_tokens + t * turn_len + user_tokens
            events.append((float(arrivals[c, t]), c, prompt, prompt + gen_tokens))
    events.sort()  # ties keep a chat's turns in order (same chat, shorter prompt first)
    trace = Trace(conv_tokens, [(c, p, f) for _, c, p, f in events])
    trace.stats = trace_stats(trace, n_groups)
    return trace


def trace_stats(trace: Trace, n_groups: int) -> dict[str, int]:
    """Request count, token totals and unique tokens of a trace."""
    longest = [0] * len(trace.conv_tokens)
    for c, _, full in trace.requests:
        longest[c] = max(longest[c], full)
    return {
        "conversations": len(trace.conv_tokens),
        "system_prompts": n_groups,
        "requests": len(trace.requests),
        "prompt_tokens": sum(p for _, p, _ in trace.requests),
        "full_tokens": sum(f for _, _, f in trace.requests),
        "max_full_len": max(longest, default=0),
        "unique_tokens": unique_tokens([t[:n] for t, n in zip(trace.conv_tokens, longest, strict=True)]),
    }


def unique_tokens(seqs: list[np.ndarray]) -> int:
    """Distinct prefixes among ``seqs`` (the size of a token trie holding all of them).

    Sorted lexicographically (bytes of fixed-width ids compare like the ids
    themselves), the trie size is the total length minus each sequence's
    longest common prefix with its predecessor.
    """
    keys = [s.tobytes() for s in seqs]
    order = sorted(range(len(seqs)), key=keys.__getitem__)
    total = sum(len(s) for s in seqs)
    for prev, cur in zip(order[:-1], order[1:], strict=True):
        a, b = seqs[prev], seqs[cur]
        m = min(len(a), len(b))
        diff = np.flatnonzero(a[:m] != b[:m])
        total -= int(diff[0]) if diff.size else m
    return total


def timed(acc: dict[str, list[int]], op: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` and add its duration (ns) and one call to ``acc[op]``."""
    t0 = time.perf_counter_ns()
    out = fn(*args)
    cell = acc[op]
    cell[0] += time.perf_counter_ns() - t0
    cell[1] += 1
    return out


def serve(cache: PrefixCache, alloc: SlotAllocator, prompt: Any, full: Any, as_lists: bool,
          acc: dict[str, list[int]], counts: dict[str, int]) -> None:
    """Serve one request: match, lock, evict if short, allocate, insert, free duplicates, unlock."""
    ps = alloc.page_size
    m = timed(acc, "match", cache.match_prefix, prompt)
    counts["matched"] += m.length  # counted even if the request is skipped below: the lookup happened
    counts["prompt"] += len(prompt)
    timed(acc, "lock", cache.lock, m.node)
    need = len(full) - m.length  # m.length is page aligned, so the new slots start a page
    need_slots = -(-need // ps) * ps  # whole pages
    if alloc.num_free < need_slots:
        freed = timed(acc, "evict", cache.evict, need_slots - alloc.num_free)
        counts["evicted"] += len(freed)
        alloc.free(freed)
    if alloc.num_free < need_slots:
        counts["skipped"] += 1
        timed(acc, "unlock", cache.unlock, m.node)
        return
    slots = alloc.alloc(need)
    indices = np.concatenate([m.indices, slots])
    n = timed(acc, "insert", cache.insert, full, indices.tolist() if as_lists else indices)
    aligned = len(full) - len(full) % ps  # the tree keeps whole pages only
    alloc.free(np.concatenate([slots[: n - m.length], slots[aligned - m.length:]]))
    timed(acc, "unlock", cache.unlock, m.node)


def check_consistency(cache: PrefixCache, alloc: SlotAllocator) -> None:
    """Cache and allocator invariants, and that every slot is either free or in the tree."""
    cache.check_invariants()
    alloc.check_invariants()
    held = alloc.num_free + cache.evictable_size + cache.protected_size
    if held != alloc.capacity:
        raise RuntimeError(
            f"slot leak: free {alloc.num_free} + evictable {cache.evictable_size} + "
            f"protected {cache.protected_size} = {held} != capacity {alloc.capacity}"
        )


def run_once(trace: Trace, factory: CacheFactory, page_size: int, capacity: int,
             as_lists: bool = False) -> dict[str, Any]:
    """Serve the whole trace with a fresh cache and allocator; per-call costs and hit rate."""
    cache = factory(page_size)
    alloc = SlotAllocator(capacity, page_size)
    seqs = [t.tolist() for t in trace.conv_tokens] if as_lists else trace.conv_tokens
    acc = {op: [0, 0] for op in OPS}
    counts = {"matched": 0, "prompt": 0, "evicted": 0, "skipped": 0}
    gc.collect()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for conv, prompt_len, full_len in trace.requests:
        seq = seqs[conv]
        serve(cache, alloc, seq[:prompt_len], seq[:full_len], as_lists, acc, counts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    check_consistency(cache, alloc)
    out: dict[str, Any] = {f"{op}_us": ns / calls / 1e3 if calls else None for op, (ns, calls) in acc.items()}
    # every cache call of a request together (match, lock, evict, insert, unlock), per request
    out["request_us"] = sum(ns for ns, _ in acc.values()) / max(len(trace.requests), 1) / 1e3
    out.update({f"{op}_calls": calls for op, (_, calls) in acc.items()})
    out.update(
        hit_rate=counts["matched"] / max(counts["prompt"], 1),
        evicted_tokens=counts["evicted"],
        skipped=counts["skipped"],
        final_tree_tokens=cache.total_size,
        pool_slots=alloc.capacity,  # the capacity rounded down to whole pages
        wall_s=wall,
        cpu_s=cpu,  # well below wall_s: the run lost the CPU to other processes
    )
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min / median / max across repeats of every numeric field (fields that are None are left out)."""
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if r[key] is not None]
        if vals:
            out[key] = {"min": min(vals), "median": statistics.median(vals), "max": max(vals)}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--quick`` shrinks the run to a smoke test."""
    p = argparse.ArgumentParser(prog="python -m experiments.bench_tree", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument("--out", default=None,
                   help="JSON output (default results/bench_tree.json; results/bench_tree_quick.json "
                   "with --quick)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs per configuration, fresh cache each")
    p.add_argument("--scale-repeats", type=int, default=None,
                   help="runs per configuration of the scaled trace (default: --repeats)")
    p.add_argument("--conversations", type=int, default=200, help="chats in the base trace")
    p.add_argument("--turns", type=int, default=8, help="turns per chat")
    p.add_argument("--group", type=int, default=20, help="chats sharing one system prompt")
    p.add_argument("--system-tokens", type=int, default=1000, help="system prompt length")
    p.add_argument("--user-tokens", type=int, default=100, help="user tokens per turn")
    p.add_argument("--gen-tokens", type=int, default=100, help="generated tokens per turn")
    p.add_argument("--capacity-frac", type=float, default=0.3,
                   help="KV pool size as a fraction of the trace's unique tokens")
    p.add_argument("--page-sizes", default="1,16", help="comma-separated page sizes")
    p.add_argument("--scale", type=int, default=10,
                   help="also run a trace with this many times the chats")
    p.add_argument("--scale-page-sizes", default="1,16",
                   help="page sizes for the scaled trace")
    p.add_argument("--caches", default="radix,hash,hash-xxhash",
                   help=f"comma-separated caches from {sorted(CACHES)}")
    p.add_argument("--quick", action="store_true", help="smoke test: 20 chats, 1 repeat, no scaled run")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.repeats, args.scale = 20, 1, 0
    args.scale_repeats = args.scale_repeats or args.repeats
    args.out = args.out or ("results/bench_tree_quick.json" if args.quick else "results/bench_tree.json")
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject options the benchmark cannot run with (exits through ``p.error``)."""
    unknown = set(args.caches.split(",")) - set(CACHES)
    if unknown:
        p.error(f"unknown cache(s) {sorted(unknown)}; choose from {sorted(CACHES)}")
    try:
        pages = [int(x) for x in (args.page_sizes + "," + args.scale_page_sizes).split(",")]
    except ValueError:
        p.error("page sizes must be comma-separated integers")
    positive = (args.repeats, args.scale_repeats, args.conversations, args.turns, args.group,
                args.system_tokens, args.user_tokens, args.gen_tokens, *pages)
    if min(positive) < 1 or args.capacity_frac <= 0 or args.scale < 0:
        p.error("counts, sizes and page sizes must be >= 1, --capacity-frac > 0 and --scale >= 0")


def build_jobs(args: argparse.Namespace, traces: dict[int, Trace]) -> list[Job]:
    """Every configuration to run: cache x scale x page size, plus the python-list variant."""
    pages = [int(x) for x in args.page_sizes.split(",")]
    scale_pages = [int(x) for x in args.scale_page_sizes.split(",") if int(x) in pages]
    jobs = []
    for cache in args.caches.split(","):
        for scale, trace in traces.items():
            st = trace.stats
            capacity = int(round(args.capacity_frac * st["unique_tokens"]))
            variants = [(p, False) for p in (pages if scale == 1 else scale_pages)]
            if cache in BLOCK_CACHES:
                if scale != 1:
                    continue
                variants = [(p, False) for p in pages if p > 1]
            elif scale == 1 and 1 in pages:
                variants.append((1, True))
            for page, as_lists in variants:
                name = f"{cache} x{scale} page={page}" + (" [python lists]" if as_lists else "")
                unlimited = st["unique_tokens"] + st["max_full_len"] + 2 * page
                repeats = args.repeats if scale == 1 else args.scale_repeats
                jobs.append(Job(name, cache, scale, page, as_lists, capacity, unlimited, repeats))
    return jobs


def execute(jobs: list[Job], traces: dict[int, Trace]) -> None:
    """Run every job's repeats and its unlimited-capacity run, with one progress bar over runs.

    Repeats are interleaved (repeat r of every job, then repeat r + 1), so a burst of load from
    other processes on a shared machine spreads over the configurations instead of skewing one.
    """
    total = sum(j.repeats + 1 for j in jobs)
    with tqdm(total=total, desc="runs", unit="run", file=sys.stderr) as bar:
        for job in jobs:
            bar.set_postfix_str(job.name + " unlimited")
            job.unlimited = run_once(traces[job.scale], CACHES[job.cache], job.page_size,
                                     job.unlimited_capacity, job.as_lists)
            check_unlimited(job, traces[job.scale])
            bar.update()
        for r in range(max(j.repeats for j in jobs)):
            for job in (j for j in jobs if r < j.repeats):
                bar.set_postfix_str(f"{job.name} #{r + 1}")
                job.runs.append(run_once(traces[job.scale], CACHES[job.cache], job.page_size,
                                         job.capacity, job.as_lists))
                bar.update()


def check_unlimited(job: Job, trace: Trace) -> None:
    """The unlimited run must never evict, and at page 1 its tree must hold exactly the unique tokens."""
    run = job.unlimited
    if run["evict_calls"] or run["skipped"]:
        raise RuntimeError(f"{job.name}: the unlimited-capacity run evicted or skipped requests")
    if job.page_size == 1 and run["final_tree_tokens"] != trace.stats["unique_tokens"]:
        raise RuntimeError(
            f"{job.name}: unlimited tree holds {run['final_tree_tokens']} tokens, "
            f"trace has {trace.stats['unique_tokens']} unique"
        )


def _med(job: Job, key: str) -> float | None:
    """Median over repeats of one field (None when it never had a value)."""
    vals = [r[key] for r in job.runs if r[key] is not None]
    return statistics.median(vals) if vals else None


def ratios(jobs: list[Job]) -> list[dict[str, Any]]:
    """Scaled / base ratio of the median match, insert and evict costs, per cache and page size."""
    base = {(j.cache, j.page_size): j for j in jobs if j.scale == 1 and not j.as_lists}
    out = []
    for j in jobs:
        b = base.get((j.cache, j.page_size))
        if j.scale == 1 or j.as_lists or b is None:
            continue
        row: dict[str, Any] = {"cache": j.cache, "page_size": j.page_size, "scale": j.scale}
        for op in ("match", "insert", "evict"):
            hi, lo = _med(j, f"{op}_us"), _med(b, f"{op}_us")
            row[f"{op}_ratio"] = hi / lo if hi is not None and lo else None
        out.append(row)
    return out


def _fmt(x: float | None, spec: str = "8.2f") -> str:
    """A number for the table, or a dash."""
    return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])


def print_table(jobs: list[Job], traces: dict[int, Trace], ratio_rows: list[dict[str, Any]]) -> None:
    """The readable summary: median over repeats of the mean cost per call, hit rates, ratios."""
    for scale, t in traces.items():
        st = t.stats
        print(f"trace x{scale}: {st['conversations']} chats, {st['system_prompts']} system prompts, "
              f"{st['requests']} requests, {st['prompt_tokens']:,} prompt tokens, "
              f"{st['unique_tokens']:,} unique tokens")
    head = (f"{'configuration':<30} {'capacity':>9} {'reps':>4} {'match us':>8} {'insert us':>9} "
            f"{'evict us':>8} {'evicts':>6} {'lock us':>7} {'unlock us':>9} {'req us':>7} {'hit':>6} "
            f"{'hit(inf)':>8} {'skip':>4}")
    print("\n" + head + "\n" + "-" * len(head))
    for j in jobs:
        print(f"{j.name:<30} {j.capacity:>9,} {j.repeats:>4} {_fmt(_med(j, 'match_us'))} "
              f"{_fmt(_med(j, 'insert_us'), '9.2f')} {_fmt(_med(j, 'evict_us'))} "
              f"{_fmt(_med(j, 'evict_calls'), '6.0f')} {_fmt(_med(j, 'lock_us'), '7.2f')} "
              f"{_fmt(_med(j, 'unlock_us'), '9.2f')} {_fmt(_med(j, 'request_us'), '7.1f')} {_med(j, 'hit_rate'):6.3f} "
              f"{j.unlimited['hit_rate']:8.3f} {_fmt(_med(j, 'skipped'), '4.0f')}")
    print("(us = median over repeats of the mean microseconds per call; evicts = evict calls per run;"
          " req us = all cache calls of one request; hit = matched / prompt tokens;"
          " hit(inf) = same trace, a pool that never evicts)")
    for r in ratio_rows:
        print(f"x{r['scale']}/x1 {r['cache']} page={r['page_size']}: match {_fmt(r['match_ratio'], '.2f')}x, "
              f"insert {_fmt(r['insert_ratio'], '.2f')}x, evict {_fmt(r['evict_ratio'], '.2f')}x "
              f"(target evict <= {TARGET_EVICT_RATIO:g}x)")


def print_contention(jobs: list[Job], threshold: float = 0.9) -> None:
    """Warn about configurations whose runs got less than ``threshold`` of their wall time on a CPU."""
    for j in jobs:
        share = min(r["cpu_s"] / r["wall_s"] for r in j.runs)
        if share < threshold:
            print(f"warning: a run of {j.name} was on the CPU only {share:.0%} of its wall time "
                  "(other processes competing); its costs may be inflated, rerun on a quieter machine")


def environment() -> dict[str, Any]:
    """Versions and platform of this run."""
    return {
        "python": sys.version,
        "numpy": np.__version__,
        "radixkv": radixkv.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "implementation": platform.python_implementation(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def write_json(path: str, args: argparse.Namespace, jobs: list[Job], traces: dict[int, Trace],
               ratio_rows: list[dict[str, Any]], runtime_s: float) -> None:
    """Write the full configuration, per-configuration results and environment to ``path``."""
    config = dict(vars(args), vocab=VOCAB, start_span_s=START_SPAN_S,
                  mean_turn_gap_s=MEAN_TURN_GAP_S, traces={str(s): t.stats for s, t in traces.items()},
                  capacities={j.name: {"capacity": j.capacity, "unlimited_capacity": j.unlimited_capacity}
                              for j in jobs})
    results = [
        {"name": j.name, "cache": j.cache, "scale": j.scale, "page_size": j.page_size,
         "tokens_as": "list" if j.as_lists else "numpy", "capacity": j.capacity,
         "unlimited_capacity": j.unlimited_capacity, "repeats": j.repeats,
         "unlimited_hit_rate": j.unlimited["hit_rate"], "summary": summarize(j.runs),
         "runs": j.runs, "unlimited_run": j.unlimited}
        for j in jobs
    ]
    doc = {"benchmark": "bench_tree", "config": config, "results": results, "ratios": ratio_rows,
           "targets": {"match_us_page1": TARGET_US, "insert_us_page1": TARGET_US,
                       "evict_ratio": TARGET_EVICT_RATIO},
           "environment": environment(), "runtime_s": runtime_s}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Build the traces, run every configuration, print the table and write the JSON."""
    t0 = time.perf_counter()
    args = parse_args(argv)
    scales = [1] + ([args.scale] if args.scale > 1 else [])
    traces = {
        s: make_trace(args.conversations * s, args.turns, args.group, args.system_tokens,
                      args.user_tokens, args.gen_tokens, args.seed)
        for s in scales
    }
    jobs = build_jobs(args, traces)
    execute(jobs, traces)
    ratio_rows = ratios(jobs)
    print_table(jobs, traces, ratio_rows)
    print_contention(jobs)
    runtime = time.perf_counter() - t0
    write_json(args.out, args, jobs, traces, ratio_rows, runtime)
    print(f"\nwrote {args.out} in {runtime:.1f} s")


if __name__ == "__main__":
    run_cli(main)
