"""The load of ``experiments.serve_bench``: its workloads as sessions of turns (multi-turn closed loops,
shared-prefix groups, a Mooncake trace replay) with their start times, the closed loop that sends each
session's turns, and one run against one server: warm-up and flush, the load, its records and summary."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from experiments.serve_client import (
    ServerError,
    import_httpx,
    make_client,
    metrics_delta,
    prefix_metrics,
    timed_request,
)
from radixkv.workloads import Request, TokenSource
from radixkv.workloads.mooncake import TRACE_BLOCK, block_tokens, read_trace
from radixkv.workloads.synthetic import multi_turn, shared_prefix

WORKLOADS = ("multi-turn", "shared-prefix", "trace")
STATS = ("mean", "p50", "p90", "p99")
WARMUP_PROMPT_TOKENS, WARMUP_MAX_TOKENS = 32, 4


# ---------------------------------------------------------------- workloads


@dataclass
class Turn:
    """One request of a session: its new tokens go after the session's history (earlier prompts and answers)."""

    rid: int
    new_tokens: np.ndarray
    output_len: int
    answer: np.ndarray | None  # the workload's answer: the stand-in when the server returns no token ids
    think_time: float
    meta: dict


@dataclass
class Session:
    """Turns sent one after another, each when the previous one's answer has arrived."""

    sid: int
    arrival: float
    turns: list[Turn]


def sessions_from(requests: list[Request]) -> list[Session]:
    """Requests as sessions: one without a ``parent`` opens a session, one with a parent continues its
    parent's (its prompt must extend the parent's prompt and answer); requests must be numbered."""
    by_rid = {r.rid: r for r in requests}
    sessions: dict[int, Session] = {}  # root rid -> session
    root: dict[int, int] = {}
    for r in requests:
        if r.parent is None:
            root[r.rid] = r.rid
            sessions[r.rid] = Session(sid=len(sessions), arrival=r.arrival, turns=[])
            new = r.prompt
        else:
            p = by_rid[r.parent]
            if sessions[root[p.rid]].turns[-1].rid != p.rid:
                raise ValueError(f"request {r.rid}: sessions must be chains (request {p.rid} has two children)")
            root[r.rid] = root[p.rid]
            new = r.prompt[len(p.prompt) + p.output_len:]
        sessions[root[r.rid]].turns.append(Turn(rid=r.rid, new_tokens=new, output_len=r.output_len,
                                                answer=r.output, think_time=r.think_time, meta=dict(r.meta)))
    return list(sessions.values())


def poisson_starts(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` start times of a Poisson process at ``rate`` per second, the first at 0 (all 0 at an infinite rate)."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, size=n - 1))])


def hashed_ids(ids: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids mapped into ``[0, vocab)`` by a 64-bit mix (splitmix64), so distinct blocks stay distinct
    (``ids % vocab`` would make trace blocks ``vocab / 512`` apart identical)."""
    x = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.int64)


def trace_workload(args: argparse.Namespace) -> list[Request]:
    """The first ``--num-requests`` records of a Mooncake trace, every block ``--trace-block-tokens`` long."""
    rows = read_trace(args.trace, limit=args.num_requests)
    scale, t0 = args.trace_block_tokens, rows[0]["timestamp"]
    requests = []
    for i, row in enumerate(rows):
        n = -(-row["input_length"] * scale // TRACE_BLOCK)  # ceil: the same number of blocks as the record
        prompt = hashed_ids(block_tokens(row["hash_ids"], n, block=scale), args.vocab_size)
        out = max(1, -(-row["output_length"] * scale // TRACE_BLOCK))
        requests.append(Request(arrival=max(0.0, (row["timestamp"] - t0) / 1000.0 * args.time_scale), session=i,
                                prompt=prompt, output_len=out, rid=i, meta={"trace_blocks": len(row["hash_ids"])}))
    return requests


def build_sessions(args: argparse.Namespace) -> list[Session]:
    """The workload of ``args`` as sessions, start times set by ``--request-rate`` (or the trace)."""
    rng = np.random.default_rng(args.seed + 1)
    if args.workload == "multi-turn":
        requests = multi_turn(seed=args.seed, sessions=args.sessions, turns=args.turns,
                              system_tokens=args.system_tokens, session_prefix_tokens=0,
                              user_tokens=args.user_tokens, output_tokens=args.max_new_tokens,
                              think_time=args.think_time, vocab_size=args.vocab_size)
    elif args.workload == "shared-prefix":
        requests = shared_prefix(seed=args.seed, groups=args.gsp_num_groups,
                                 prompts_per_group=args.gsp_prompts_per_group,
                                 system_tokens=args.gsp_system_prompt_len, question_tokens=args.gsp_question_len,
                                 output_tokens=args.gsp_output_len, vocab_size=args.vocab_size)
        for r in requests:
            r.meta["group"] = r.session
    else:
        requests = trace_workload(args)
    sessions = sessions_from(requests)
    if args.workload != "trace" or args.request_rate is not None:
        rate = math.inf if args.request_rate is None else args.request_rate
        for s, t in zip(sessions, poisson_starts(len(sessions), rate, rng), strict=True):
            s.arrival = float(t)
    return sessions


def warmup_prompts(args: argparse.Namespace) -> list[list[int]]:
    """Short prompts from a seed no workload uses, for ``--warmup-requests``."""
    src = TokenSource(args.seed + 1_000_003, vocab_size=args.vocab_size)
    return [src.span(WARMUP_PROMPT_TOKENS).tolist() for _ in range(args.warmup_requests)]


# ---------------------------------------------------------------- one run


def answer_of(rec: dict, turn: Turn) -> tuple[np.ndarray, str]:
    """The answer the next turn's prompt contains: the server's token ids where it returned all of them,
    else the workload's answer cut to the length the server generated."""
    ids, n = rec.pop("token_ids"), rec["completion_tokens"] or 0
    if ids is not None and len(ids) == n:
        return np.asarray(ids, dtype=np.int64), "server"
    stand_in = turn.answer if turn.answer is not None else np.empty(0, dtype=np.int64)
    return stand_in[:n], "workload"


def clip(prompt: np.ndarray, max_tokens: int, max_context: int | None) -> np.ndarray:
    """The prompt cut from the end so prompt + output fit ``max_context`` (the shared front is kept)."""
    if max_context is None:
        return prompt
    return prompt[:max(1, max_context - max_tokens)]


@dataclass
class Run:
    """What one run's sessions share: the client, the cap on requests in flight, the clock, the records."""

    client: Any
    args: argparse.Namespace
    label: str
    limit: asyncio.Semaphore
    t0: float
    bar: Any
    records: list[dict]


async def run_session(run: Run, session: Session) -> None:
    """Send the session's turns in order, each when the previous answer has arrived; a failed turn ends it."""
    await asyncio.sleep(max(0.0, run.t0 + session.arrival - time.perf_counter()))
    history = np.empty(0, dtype=np.int64)
    failed = None
    for k, turn in enumerate(session.turns):
        base = {"kind": "request", "run": run.label, "rid": turn.rid, "session": session.sid, "turn": k,
                "arrival": session.arrival, **turn.meta}
        if failed is not None:
            run.records.append({**base, "ok": False, "error": f"turn {failed} of the session failed"})
            run.bar.update()
            continue
        if k and turn.think_time:
            await asyncio.sleep(turn.think_time)
        prompt = np.concatenate([history, turn.new_tokens])
        sent = clip(prompt, turn.output_len, run.args.max_context)
        async with run.limit:
            base["sent"] = time.perf_counter() - run.t0
            rec = await timed_request(run.client, sent.tolist(), turn.output_len, run.args)
        answer, source = answer_of(rec, turn)
        run.records.append({**base, "prompt_len": len(sent), "clipped": len(prompt) - len(sent),
                            "max_tokens": turn.output_len, "answer_source": source, **rec})
        run.bar.update()
        if not rec["ok"]:
            failed = k
        history = np.concatenate([prompt, answer])


async def prepare(client: Any, args: argparse.Namespace) -> None:
    """The warm-up requests, then the flush, as asked; a failure is a ``ServerError``."""
    for prompt in warmup_prompts(args):
        rec = await timed_request(client, prompt, WARMUP_MAX_TOKENS, args)
        if not rec["ok"]:
            raise ServerError(f"warm-up request to {client.base_url} failed: {rec['error']}")
    if args.flush_cache:
        try:
            resp = await client.post(args.flush_endpoint)
        except import_httpx().HTTPError as e:
            raise ServerError(f"POST {args.flush_endpoint} failed: {e}") from None
        if resp.status_code != 200:
            raise ServerError(f"POST {args.flush_endpoint} answered {resp.status_code}: {resp.text[:200]} "
                              "(--flush-endpoint names another; --no-flush-cache skips it)")


async def bench(args: argparse.Namespace, base_url: str, label: str, sessions: list[Session]) -> tuple[list, dict]:
    """One run: warm-up and flush as asked, the load, the server's counters before and after; the per-request
    records and the run's summary."""
    async with make_client(base_url, args, args.timeout) as client:
        await prepare(client, args)
        before = await prefix_metrics(client)
        total = sum(len(s.turns) for s in sessions)
        limit = asyncio.Semaphore(args.max_concurrency or total)
        with tqdm(total=total, desc=label, unit="req", disable=not args.progress) as bar:
            run = Run(client, args, label, limit, time.perf_counter(), bar, [])
            await asyncio.gather(*(run_session(run, s) for s in sessions))
            duration = time.perf_counter() - run.t0
        after = await prefix_metrics(client)
    run.records.sort(key=lambda r: r["rid"])
    summary = summarize(run.records, duration, label) | metrics_delta(before, after)
    return run.records, {**summary, "base_url": base_url}


# ---------------------------------------------------------------- a run's summary


def percentiles(name: str, values: list[float]) -> dict:
    """``<name>_mean``, ``_p50``, ``_p90``, ``_p99`` of ``values`` (None when empty)."""
    if not values:
        return {f"{name}_{s}": None for s in STATS}
    arr = np.asarray(values, dtype=float)
    return {f"{name}_mean": float(arr.mean()),
            **{f"{name}_p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}}


def summarize(records: list[dict], duration: float, label: str) -> dict:
    """A run's throughputs, latency percentiles and hit rate from its per-request records."""
    ok = [r for r in records if r["ok"]]
    prompt = sum(r["prompt_tokens"] or r["prompt_len"] for r in ok)
    completion = sum(r["completion_tokens"] or 0 for r in ok)
    cached = [r["cached_tokens"] for r in ok]
    known = bool(ok) and all(c is not None for c in cached) and all(r["prompt_tokens"] is not None for r in ok)
    out = {"run": label, "requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
           "duration_s": duration, "request_throughput": len(ok) / duration, "input_tok_s": prompt / duration,
           "output_tok_s": completion / duration, "total_tok_s": (prompt + completion) / duration,
           "prompt_tokens": prompt, "completion_tokens": completion,
           "cached_tokens": sum(cached) if known else None,
           "hit_rate_usage": sum(cached) / prompt if known and prompt else None,
           "clipped_requests": sum(1 for r in records if r.get("clipped")),
           "answers_from_server": sum(1 for r in ok if r.get("answer_source") == "server"),
           "first_error": next((r["error"] for r in records if r["error"]), None)}
    out |= percentiles("ttft", [r["ttft"] for r in ok])
    out |= percentiles("itl", [g for r in ok for g in r["itl"]])
    out |= percentiles("e2e", [r["e2e"] for r in ok])
    out |= percentiles("tpot", [(r["e2e"] - r["ttft"]) / (r["completion_tokens"] - 1) for r in ok
                                if r["ttft"] is not None and (r["completion_tokens"] or 0) > 1])
    return out
