"""One simulated engine: a scheduler over its cache and KV budget on a modelled clock (``Replica``), the
record of a request in it (``Running``), when each request is sent (``Feed``), and what a run gives
(``SimResult``). ``radixkv.sim.cluster`` runs N replicas behind a router; ``simulate`` is one replica.

A request reserves its whole KV (uncached prompt + output - 1 tokens: the last generated token's KV is
never computed) when admitted unless the scheduler grows it as the engine does (``preemption=True``);
consecutive steps with nothing but decodes are taken in one stride. With the ``prefetch`` setting, contexts
due back (``radixkv.scheduling.prefetch``) load at the start of a step, their copies charged with the step's
loads, or on an idle replica when due, the replica busy copying meanwhile (``SimResult.prefetched_tokens``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from radixkv.cache.base import CacheHints
from radixkv.cache.future import FutureUses
from radixkv.cache.tiers import DEVICE
from radixkv.cost import CostModel
from radixkv.scheduling import RequestState, Scheduler, causal_pairs
from radixkv.sessions import MAIN_STREAM, session_hints
from radixkv.workloads.request import Request


@dataclass
class SimResult:
    """Totals (token counts are real tokens), one row per request, and the steps.

    ``steps`` holds one ``(prefill_tokens, attention_pairs, decodes, repeats)``
    per scheduled step, in the terms of ``StepRecord`` (``repeats`` > 1 for a
    stride of identical decode-only steps).

    ``saved_prefill_s``: the prefill seconds the cache saved under the cost model, summed over the served
    requests: for a prompt of n tokens whose admission hit h (from every tier),
    ``cost.prefill_time(n, 0) - cost.prefill_time(n - h, h)`` (``CostModel.saved_prefill_time``); each
    request's row holds its own.
    """

    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    evicted_tokens: int = 0
    preemptions: int = 0
    rejected: int = 0
    makespan: float = 0.0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    load_seconds: float = 0.0
    loaded_tokens: int = 0  # from lower tiers into the device
    written_tokens: int = 0  # from the device into lower tiers
    saved_prefill_s: float = 0.0  # prefill seconds the hits saved (``CostModel.saved_prefill_time``)
    prefetched_tokens: int = 0  # loaded before their session came back (``radixkv.scheduling.prefetch``)
    prefetch_seconds: float = 0.0  # those loads' time (apart from ``load_seconds``, the admissions')
    config: dict = field(default_factory=dict)
    per_request: list[dict] = field(default_factory=list)
    steps: list[tuple[int, float, int, int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens of the served requests."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_by_tier(self) -> dict[str, float]:
        """``hit_rate`` split by the tier each hit token came from (device, host, storage); sums to it."""
        n = self.prompt_tokens
        return {tier: hits / n if n else 0.0 for tier, hits in self.hit_tokens_by_tier.items()}

    def ttfts(self) -> np.ndarray:
        return np.array([r["ttft"] for r in self.per_request if not r["rejected"]])

    def summary(self) -> dict[str, Any]:
        """The totals and TTFT statistics as a flat dict (what experiments store)."""
        t = self.ttfts()
        stats = {f"ttft_{k}": float(f(t)) if len(t) else 0.0
                 for k, f in {"mean": np.mean, "p50": np.median, "p99": lambda x: np.percentile(x, 99)}.items()}
        totals = ("prompt_tokens", "hit_tokens", "hit_rate", "computed_tokens", "evicted_tokens", "preemptions",
                  "rejected", "makespan")
        tiers = ("hit_rate_by_tier", "load_seconds", "loaded_tokens", "written_tokens", "saved_prefill_s",
                 "prefetched_tokens", "prefetch_seconds")
        return {**{k: getattr(self, k) for k in totals}, **stats, **{k: getattr(self, k) for k in tiers}}


@dataclass(eq=False)
class Running(RequestState):
    """A request in the simulator: the scheduler's record plus its clock."""

    req: Request | None = None
    ready: float = 0.0  # when it was sent (arrival, or parent finish + think time)
    admitted: float = 0.0
    first_token: float = -1.0  # kept across a preemption: the engine's ``ttft`` is the token's first time too
    generated: int = 0

    def reset(self) -> None:
        super().reset()
        self.generated = 0


def output_tokens(req: Request, fresh: list[int]) -> np.ndarray:
    if req.output is not None:
        return req.output
    # Fresh negative ids: what no prompt will ever contain.
    start = fresh[0]
    fresh[0] -= req.output_len
    return np.arange(start, start - req.output_len, -1, dtype=np.int64)


def whole_kv(run: Running) -> int:
    """A request's KV tokens from admission to finish: prompt + output, but the last token's (never computed)."""
    return len(run.prompt) + run.req.output_len - 1


def cacheable_prompt(prompt: np.ndarray) -> np.ndarray:
    return prompt[: max(len(prompt) - 1, 0)]  # the at-least-one-token rule


class Feed:
    """When each request is sent: at its arrival, or ``think_time`` after its ``parent`` and every request
    of its ``after`` have finished. Shared by the replicas of a cluster (``radixkv.sim.cluster``)."""

    def __init__(self, requests: Sequence[Request]):
        self.requests = requests
        self.ready_at = {r.rid: r.arrival for r in requests}
        self.blockers: dict[int, int] = {}  # rid -> requests it waits for that have not finished
        self.dependents: dict[int, list[int]] = {}
        for r in requests:
            deps = set(r.after) | ({r.parent} if r.parent is not None else set())
            self.blockers[r.rid] = len(deps)
            for d in deps:
                self.dependents.setdefault(d, []).append(r.rid)
        self.pending = sorted((r.arrival, r.rid) for r in requests if not self.blockers[r.rid])  # (ready, rid)
        self.fresh = [-1]  # the next fresh (negative) output token id, shared so no two requests' outputs meet

    def release(self, rid: int, t: float) -> None:
        """``rid`` finished (or was rejected) at ``t``: send whatever no longer waits for anything."""
        for child in self.dependents.get(rid, ()):
            self.ready_at[child] = max(self.ready_at[child], t + self.requests[child].think_time)
            self.blockers[child] -= 1
            if not self.blockers[child]:
                bisect.insort(self.pending, (self.ready_at[child], child))

    def next_time(self) -> float:
        return self.pending[0][0] if self.pending else math.inf

    def pop(self) -> Request:
        return self.requests[self.pending.pop(0)[1]]

    def check_all_sent(self, served: Iterable[int]) -> None:
        done = set(served)
        if len(done) < len(self.requests):
            stuck = [r.rid for r in self.requests if r.rid not in done]
            raise ValueError(f"requests {stuck[:5]} were never sent: their parent / after links form a cycle")


class Replica:
    """One simulated engine: a scheduler over its cache and KV budget, a clock, and its results.

    ``on_finish(run, replica, tokens)`` is called as each request finishes, with the tokens it left in the
    cache (none for a rejected one): the cluster tells its router.
    """

    def __init__(self, feed: Feed, scheduler: Scheduler, cost: CostModel, index: int = 0,
                 on_finish: Callable[[Running, int, np.ndarray], None] | None = None, future: FutureUses | None = None):
        self.feed, self.scheduler, self.cost, self.index = feed, scheduler, cost, index
        self.cache, self.alloc = scheduler.cache, scheduler.allocator
        self.on_finish = on_finish
        self.result = SimResult()
        self.now = 0.0
        self.future = future  # a clairvoyant policy's: told of each request once it is served
        self.scheduler.clock = self.clock
        self.cache.clock = self.clock  # time-aware eviction reads the simulated seconds, built or handed in alike

    def clock(self) -> float:
        """The replica's simulated seconds: what its cache's ``clock`` reads."""
        return self.now

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def add(self, req: Request, tokens: np.ndarray | None = None) -> None:
        """Take a request sent now (rejected at once when its KV can never fit). ``tokens``: its prompt's ids
        where the caller built them already (``Request.tokens``); the record holds them until it finishes."""
        if req.prompt_len + req.output_len - 1 > self.alloc.capacity:
            self._reject(req)
        else:
            hints = CacheHints(req.priority, req.ttl)
            if "stream" in req.meta:  # a session of streams (an agent trace): who it is (how it ends: at its finish)
                hints = session_hints(hints, req.session, req.meta["stream"], _parent(req.meta["stream"]))
            self.scheduler.add(Running(req.rid, req.tokens() if tokens is None else tokens, req.namespace,
                                       hints=hints, req=req, ready=self.feed.ready_at[req.rid]))

    def _reject(self, req: Request) -> None:
        self.result.rejected += 1
        self.result.per_request.append({"rid": req.rid, "session": req.session, "rejected": True,
                                        "prompt_len": req.prompt_len, "hit": 0, "saved_prefill_s": 0.0,
                                        "ttft": math.nan, **req.meta})
        if self.future is not None:
            self.future.served(req.rid)
        self.feed.release(req.rid, self.now)
        if self.on_finish is not None:
            nothing = np.zeros(0, dtype=np.int64)
            self.on_finish(Running(req.rid, nothing, req.namespace, req=req), self.index, nothing)

    def _finish(self, run: Running) -> None:
        req = run.req
        seq = np.concatenate([run.prompt, output_tokens(req, self.feed.fresh)[:-1]])
        if "stop" in req.meta:  # how its answer ended is known now, as an engine knows it when it stops
            run.hints = session_hints(run.hints, run.hints.session, run.hints.stream, run.hints.parent,
                                      req.meta["stop"])
        self.scheduler.finish(run, seq)
        n = len(run.prompt)
        saved = self.cost.saved_prefill_time(n, run.hit)  # every tier's hits: none of them was computed
        self.result.per_request.append({
            "rid": req.rid, "session": req.session, "rejected": False, "prompt_len": n, "hit": run.hit,
            "hit_by_tier": dict(run.hit_by_tier), "saved_prefill_s": saved,
            "computed": n - run.hit, "output_len": req.output_len, "ready": run.ready, "admitted": run.admitted,
            "first_token": run.first_token, "finish": self.now, "ttft": run.first_token - run.ready,
            "latency": self.now - run.ready, **req.meta,
        })
        self.result.prompt_tokens += n
        self.result.hit_tokens += run.hit
        self.result.saved_prefill_s += saved
        for tier, hits in run.hit_by_tier.items():
            self.result.hit_tokens_by_tier[tier] = self.result.hit_tokens_by_tier.get(tier, 0) + hits
        self.result.computed_tokens += n - run.hit
        self.feed.release(req.rid, self.now)
        if self.on_finish is not None:
            self.on_finish(run, self.index, seq)

    def _strides(self, decoding: list[Running], dt: float) -> int:
        """How many decode-only steps to take at once: until one finishes, the next request arrives or the next
        context is due back, with the KV for all of them allocated now (one step when that would need an
        eviction)."""
        strides = min(s.req.output_len - s.generated for s in decoding)
        until = min(self.feed.next_time() if self.feed.pending else math.inf, self.next_prefetch())
        if until < math.inf and dt > 0:  # the next arrival, or the next context due back (``prefetch``)
            strides = max(1, min(strides, math.ceil((until - self.now) / dt)))
        return strides if strides == 1 or self.scheduler.extend_decodes(decoding, strides - 1) else 1

    def next_prefetch(self) -> float:
        """When the scheduler's prefetcher has a context due next (``math.inf``: none, or no prefetcher)."""
        prefetcher = self.scheduler.prefetcher
        return math.inf if prefetcher is None else prefetcher.next_due()

    def prefetch_idle(self) -> None:
        """Idle (nothing waits or runs) when a context is due: the clock moves to then, the prefetch loads,
        and the replica is busy copying for the loads' time (a request arriving meanwhile waits for it)."""
        self.now = max(self.now, self.next_prefetch())
        self.now += self._prefetch()

    def _prefetch(self) -> float:
        """The scheduler's due prefetches: their loads' seconds, counted apart from the admissions' loads."""
        tokens = self.scheduler.prefetch()
        if not tokens:
            return 0.0
        seconds = self._load_seconds()
        self.result.prefetched_tokens += tokens
        self.result.prefetch_seconds += seconds
        return seconds

    def _load_seconds(self) -> float:
        """The seconds of the loads into the device since the last call (the copies down are not charged)."""
        return sum(self.cost.load_time(c.src, len(c)) for c in self.cache.take_copies() if c.dst == DEVICE)

    def step(self) -> None:
        prefetch = self._prefetch()  # loads beside this step's, charged alike (only while nothing waits)
        batch = self.scheduler.schedule()
        for s in self.scheduler.newly_admitted:
            s.admitted = self.now
            if self.future is not None:
                self.future.served(s.rid)
        if not batch:
            raise RuntimeError("simulator stalled: a step with nothing to run")  # budget >= 1 and an empty pool admits
        chunks = [(s, n) for s, n in batch if s.prefilling]
        decoding = [s for s, _ in batch if not s.prefilling]
        tokens = sum(n for _, n in chunks)
        pairs = float(sum(causal_pairs(n, s.computed) for s, n in chunks))
        dt = self.cost.step_time(tokens, pairs, len(decoding), len(chunks))
        if self.cache.tiers:  # this step's loads from the lower tiers (writes run beside the forward)
            loads = self._load_seconds()
            self.result.load_seconds += loads
            dt = self.cost.with_loads(dt, loads + prefetch)
        # a stride of steps where every running request decodes
        # (not when a prefetch's copy is in the step: its time is the first step's alone)
        stride = not chunks and not prefetch and len(decoding) == len(self.scheduler.running)
        strides = self._strides(decoding, dt) if stride else 1
        self.now += dt * strides
        self.result.steps.append((tokens, pairs, len(decoding), strides))
        self.scheduler.commit(batch, decode_tokens=strides)
        for s in decoding:
            s.generated += strides
        for s, _ in chunks:
            if not s.prefilling:  # the last chunk's logits give the first token (again, after a preemption)
                s.first_token, s.generated = self.now if s.first_token < 0 else s.first_token, 1
        for s in [s for s in self.scheduler.running if s.generated >= s.req.output_len]:
            self._finish(s)

    def close(self) -> SimResult:
        """The replica's totals, once every request is done."""
        self.result.makespan = self.now
        self.result.evicted_tokens = self.scheduler.stats["evicted_tokens"]
        self.result.preemptions = self.scheduler.stats["preemptions"]
        self.result.loaded_tokens = sum(self.cache.loaded_tokens.values())
        self.result.written_tokens = sum(self.cache.written_tokens.values())
        self.result.per_request.sort(key=lambda row: row["rid"])
        return self.result


def request_list(requests: object) -> list[Request]:
    if isinstance(requests, str | bytes | dict) or not isinstance(requests, Iterable):
        raise ValueError(f"requests must be a list of Request, got {type(requests).__name__}")
    out = list(requests)
    if not all(isinstance(r, Request) for r in out):
        raise ValueError(f"requests must be Request objects, got {sorted({type(r).__name__ for r in out})}")
    return out


def numbered(requests: list[Request]) -> list[Request]:
    """The requests with ``rid`` = rank in arrival order (copies, only where that is not so already).

    ``parent`` and ``after`` name requests by ``rid`` where every request has
    a distinct one (a workload's, or part of one, e.g. filtered by session);
    otherwise (hand-made lists, rid -1) they name positions in the given list.
    A link to no request of the list, or to itself, is a ``ValueError``.
    """
    rids = [r.rid for r in requests]
    by_rid = all(rid >= 0 for rid in rids) and len(set(rids)) == len(rids)
    position = {rid: i for i, rid in enumerate(rids)} if by_rid else {i: i for i in range(len(requests))}
    for i, r in enumerate(requests):
        links = (*(() if r.parent is None else (r.parent,)), *r.after)
        if any(position.get(d, i) == i for d in links):
            raise ValueError(f"request {i} links to {links}: parent / after must name other requests of the list "
                             f"(by {'rid' if by_rid else 'position'})")
    if all(rid == i for i, rid in enumerate(rids)) and all(
            a.arrival <= b.arrival for a, b in zip(requests, requests[1:], strict=False)):
        return requests
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    rank = {old: new for new, old in enumerate(order)}
    new_id = {d: rank[i] for d, i in position.items()}
    return [replace(requests[old], rid=new, parent=None if requests[old].parent is None
                    else new_id[requests[old].parent], after=tuple(new_id[d] for d in requests[old].after))
            for new, old in enumerate(order)]


def _parent(stream: int) -> int | None:
    """A trace's sub-agent hangs from its session's main agent (``radixkv.workloads.agentic``)."""
    return None if stream == MAIN_STREAM else MAIN_STREAM
