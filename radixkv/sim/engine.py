"""Trace-driven simulation of prefix caching: the real caches and policies, a modelled clock.

``simulate`` replays a workload on a virtual clock through the very objects the
engine uses (``RadixCache`` / ``HashBlockCache`` / ``NoPrefixCache``, a
``SlotAllocator`` of the given KV budget, the policies of
``radixkv.scheduling``); only the model's forward is replaced by a
``CostModel``. One step schedules as ``LLM.step`` does: running requests
first (a decode token each, or their prompt's next chunk), then waiting ones
in policy order (under the KV budget and ``max_running``), each chunk at most
``chunked_prefill_size`` tokens and the step at most ``max_batch_tokens``;
without those limits an admitted request is prefilled whole in one step.
Each finished chunk joins the cache, as in the engine. Consecutive steps with
nothing but decodes are taken in one stride. Unlike the engine, a request
reserves its whole KV (uncached prompt + output - 1 tokens, the last
generated token's KV is never computed) when admitted, so nothing is ever
preempted; on finishing it inserts prompt + output[:-1] into the cache and
unlocks its prefix. So with KV to spare the simulator's steps are the
engine's, token for token; under memory pressure it evicts earlier than the
engine, and hits can differ (``preemption=True`` allocates as the engine
does). A request is sent at its arrival, or ``think_time`` after its
``parent`` and every request of its ``after`` have finished.

``upper_bound`` gives the best hit rate any capacity and order could reach;
``eviction_policy="belady"`` gives the clairvoyant eviction reference at a
given capacity: it evicts the leaf whose next use, in arrival order, lies
farthest ahead. It knows the arrivals, not the order a reordering policy
serves them in: with ``lpm`` and large batches an online policy can beat it
by a few percent (docs/experiments.md).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from radixkv.bounds import upper_bound  # noqa: F401  (the simulator's reference, kept importable here)
from radixkv.cache.base import PrefixCache
from radixkv.cache.belady import BeladyRadixCache, FutureUses
from radixkv.cache.factory import make_cache
from radixkv.cache.none import NoPrefixCache
from radixkv.checks import is_int, is_real
from radixkv.memory import SlotAllocator
from radixkv.scheduling import RequestState, Scheduler, causal_pairs, make_policy
from radixkv.workloads.request import Request


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step, from a few named constants.

    Defaults are a 135M-parameter Llama (SmolLM2) in bfloat16 on 2 CPU cores
    (the engine's calibration replaces them with measured values):

    Attributes:
        prefill_per_token: seconds per computed prompt token (the linear layers).
        attention_per_pair: seconds per (new token, attended token) pair, the
            quadratic attention term of prefill: a chunk of n new tokens after
            a prefix of p costs ``n * (p + (n + 1) / 2)`` pairs.
        decode_step: fixed seconds per decode step (weights streamed once).
        decode_per_seq: extra seconds per sequence in the decode batch.
        step_overhead: fixed seconds per engine step (scheduling, launch).
    """

    prefill_per_token: float = 3.5e-4
    attention_per_pair: float = 2.0e-8
    decode_step: float = 0.013
    decode_per_seq: float = 0.002
    step_overhead: float = 0.0005

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if not (is_real(v) and v >= 0)}
        if bad:
            raise ValueError(f"CostModel constants must be finite numbers >= 0 (seconds), got {bad}")

    @classmethod
    def from_dict(cls, values: object) -> CostModel:
        """A cost model from a dict of its constants (as ``--calibrate`` writes them); ``ValueError`` otherwise."""
        names = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - names:
            raise ValueError(f"a cost model is a JSON object with keys among {sorted(names)}, got {values!r}")
        return cls(**values)

    def prefill_time(self, new_tokens: int, prefix_len: int) -> float:
        return self.prefill_per_token * new_tokens + self.attention_per_pair * causal_pairs(new_tokens, prefix_len)

    def decode_time(self, batch: int) -> float:
        return self.decode_step + self.decode_per_seq * batch if batch else 0.0

    def step_time(self, prefill_tokens: int, attention_pairs: float, decodes: int) -> float:
        """One step's seconds: its prefill chunks' tokens and pairs, its decode batch, the fixed overhead."""
        return (self.step_overhead + self.prefill_per_token * prefill_tokens
                + self.attention_per_pair * attention_pairs + self.decode_time(decodes))

    @classmethod
    def fit(cls, records: Sequence[Any]) -> CostModel:
        """Least-squares fit to measured steps (``LLM.step_log`` with ``record_steps=True``).

        Each record has ``prefill_tokens``, ``attention_pairs``, ``decodes`` and
        ``seconds``. It minimizes squared *relative* errors (so the many short
        decode steps count as much as the few long prefill ones), with every
        constant non-negative: exact non-negative least squares, by trying every
        subset of the five constants (the others fixed at zero) and keeping
        the best feasible one.
        """
        if len(records) < 5:
            raise ValueError(f"need at least 5 measured steps to fit 5 constants, got {len(records)}")
        x = np.array([[r.prefill_tokens, r.attention_pairs, r.decodes > 0, r.decodes, 1.0] for r in records],
                     dtype=np.float64)
        y = np.array([r.seconds for r in records], dtype=np.float64)
        # Relative errors: a few long prefill steps would otherwise outweigh a hundred decode steps.
        weight = 1.0 / np.maximum(y, 1e-9)
        x, y = x * weight[:, None], y * weight
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns differ by 10^6: solve on normalized ones
        best, coef = np.inf, np.zeros(x.shape[1])
        for mask in range(1, 2 ** x.shape[1]):  # every subset of free constants, the rest fixed at 0: exact NNLS
            cols = [c for c in range(x.shape[1]) if mask >> c & 1]
            sol, *_ = np.linalg.lstsq(x[:, cols] / scale[cols], y, rcond=None)
            if (sol < 0).any():
                continue
            err = float(np.sum((x[:, cols] @ (sol / scale[cols]) - y) ** 2))
            if err < best:
                best, coef = err, np.zeros(x.shape[1])
                coef[cols] = sol / scale[cols]
        c = [float(v) for v in coef]
        return cls(prefill_per_token=c[0], attention_per_pair=c[1], decode_step=c[2], decode_per_seq=c[3],
                   step_overhead=c[4])


@dataclass
class SimResult:
    """Totals (token counts are real tokens), one row per request, and the steps.

    ``steps`` holds one ``(prefill_tokens, attention_pairs, decodes, repeats)``
    per scheduled step, in the terms of ``StepRecord`` (``repeats`` > 1 for a
    stride of identical decode-only steps).
    """

    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    evicted_tokens: int = 0
    preemptions: int = 0
    rejected: int = 0
    makespan: float = 0.0
    config: dict = field(default_factory=dict)
    per_request: list[dict] = field(default_factory=list)
    steps: list[tuple[int, float, int, int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens of the served requests."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttfts(self) -> np.ndarray:
        return np.array([r["ttft"] for r in self.per_request if not r["rejected"]])

    def summary(self) -> dict[str, Any]:
        """The totals and TTFT statistics as a flat dict (what experiments store)."""
        t = self.ttfts()
        stats = {f"ttft_{k}": float(f(t)) if len(t) else 0.0
                 for k, f in {"mean": np.mean, "p50": np.median, "p99": lambda x: np.percentile(x, 99)}.items()}
        return {
            "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate,
            "computed_tokens": self.computed_tokens, "evicted_tokens": self.evicted_tokens,
            "preemptions": self.preemptions, "rejected": self.rejected, "makespan": self.makespan, **stats,
        }


@dataclass(eq=False)
class _Running(RequestState):
    """A request in the simulator: the scheduler's record plus its clock."""

    req: Request | None = None
    ready: float = 0.0  # when it was sent (arrival, or parent finish + think time)
    admitted: float = 0.0
    first_token: float = -1.0
    generated: int = 0

    def reset(self) -> None:
        super().reset()
        self.first_token, self.generated = -1.0, 0


def _output_tokens(req: Request, fresh: list[int]) -> np.ndarray:
    if req.output is not None:
        return req.output
    # Fresh negative ids: what no prompt will ever contain.
    start = fresh[0]
    fresh[0] -= req.output_len
    return np.arange(start, start - req.output_len, -1, dtype=np.int64)


def _make_cache(cache: str | PrefixCache, page_size: int, block_size: int, eviction_policy: str,
                requests: Sequence[Request]) -> PrefixCache:
    """``cache`` itself if it is a cache object, else ``make_cache`` (with the requests' future uses for Belady)."""
    if not isinstance(cache, str):
        return cache
    future = None
    if eviction_policy == "belady":
        future = FutureUses([(_cacheable_prompt(r.prompt), r.namespace) for r in requests], page_size)
    options = {} if future is None else {"future": future}
    return make_cache(cache, page_size=page_size, block_size=block_size, eviction_policy=eviction_policy, **options)


def _whole_kv(run: _Running) -> int:
    """A request's KV tokens from admission to finish: prompt + output, but the last token's (never computed)."""
    return len(run.prompt) + run.req.output_len - 1


def _cacheable_prompt(prompt: np.ndarray) -> np.ndarray:
    return prompt[: max(len(prompt) - 1, 0)]  # the at-least-one-token rule


class _Feed:
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


class _Replica:
    """One simulated engine: a scheduler over its cache and KV budget, a clock, and its results.

    ``on_finish(run, replica, tokens)`` is called as each request finishes, with the tokens it left in the
    cache (none for a rejected one): the cluster tells its router.
    """

    def __init__(self, feed: _Feed, scheduler: Scheduler, cost: CostModel, index: int = 0,
                 on_finish: Callable[[_Running, int, np.ndarray], None] | None = None):
        self.feed, self.scheduler, self.cost, self.index = feed, scheduler, cost, index
        self.cache, self.alloc = scheduler.cache, scheduler.allocator
        self.on_finish = on_finish
        self.result = SimResult()
        self.now = 0.0
        self.future = self.cache.future if isinstance(self.cache, BeladyRadixCache) else None

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def add(self, req: Request) -> None:
        """Take a request sent now (rejected at once when its KV can never fit)."""
        if len(req.prompt) + req.output_len - 1 > self.alloc.capacity:
            self._reject(req)
        else:
            self.scheduler.add(_Running(req.rid, req.prompt, req.namespace, req=req, ready=self.feed.ready_at[req.rid]))

    def _reject(self, req: Request) -> None:
        self.result.rejected += 1
        self.result.per_request.append({"rid": req.rid, "session": req.session, "rejected": True,
                                        "prompt_len": len(req.prompt), "hit": 0, "ttft": math.nan, **req.meta})
        if self.future is not None:
            self.future.served(req.rid)
        self.feed.release(req.rid, self.now)
        if self.on_finish is not None:
            self.on_finish(_Running(req.rid, req.prompt, req.namespace, req=req), self.index, req.prompt[:0])

    def _finish(self, run: _Running) -> None:
        req = run.req
        seq = np.concatenate([req.prompt, _output_tokens(req, self.feed.fresh)[:-1]])
        self.scheduler.finish(run, seq)
        n = len(req.prompt)
        self.result.per_request.append({
            "rid": req.rid, "session": req.session, "rejected": False, "prompt_len": n, "hit": run.hit,
            "computed": n - run.hit, "output_len": req.output_len, "ready": run.ready, "admitted": run.admitted,
            "first_token": run.first_token, "finish": self.now, "ttft": run.first_token - run.ready,
            "latency": self.now - run.ready, **req.meta,
        })
        self.result.prompt_tokens += n
        self.result.hit_tokens += run.hit
        self.result.computed_tokens += n - run.hit
        self.feed.release(req.rid, self.now)
        if self.on_finish is not None:
            self.on_finish(run, self.index, seq)

    def _strides(self, decoding: list[_Running], dt: float) -> int:
        """How many decode-only steps to take at once: until one finishes or the next request arrives,
        with the KV for all of them allocated now (one step when that would need an eviction)."""
        strides = min(s.req.output_len - s.generated for s in decoding)
        if self.feed.pending and dt > 0:
            strides = max(1, min(strides, math.ceil((self.feed.next_time() - self.now) / dt)))
        return strides if strides == 1 or self.scheduler.extend_decodes(decoding, strides - 1) else 1

    def step(self) -> None:
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
        dt = self.cost.step_time(tokens, pairs, len(decoding))
        strides = 1
        if not chunks and len(decoding) == len(self.scheduler.running):  # decodes only
            strides = self._strides(decoding, dt)
        self.now += dt * strides
        self.result.steps.append((tokens, pairs, len(decoding), strides))
        self.scheduler.commit(batch, decode_tokens=strides)
        for s in decoding:
            s.generated += strides
        for s, _ in chunks:
            if not s.prefilling:  # the last chunk's logits give the first token
                s.first_token, s.generated = self.now, 1
        for s in [s for s in self.scheduler.running if s.generated >= s.req.output_len]:
            self._finish(s)

    def close(self) -> SimResult:
        """The replica's totals, once every request is done."""
        self.result.makespan = self.now
        self.result.evicted_tokens = self.scheduler.stats["evicted_tokens"]
        self.result.preemptions = self.scheduler.stats["preemptions"]
        self.result.per_request.sort(key=lambda row: row["rid"])
        return self.result


def _run(feed: _Feed, replica: _Replica) -> SimResult:
    """One engine's event loop: send what has arrived, step, until nothing is left."""
    while feed.pending or replica.busy:
        if not replica.busy:
            replica.now = max(replica.now, feed.next_time())
        while feed.pending and feed.next_time() <= replica.now:
            replica.add(feed.pop())
        if replica.busy:
            replica.step()
    feed.check_all_sent(row["rid"] for row in replica.result.per_request)
    return replica.close()


def simulate(
    requests: Sequence[Request],
    cache: str | PrefixCache = "radix",
    capacity_tokens: int | None = None,
    page_size: int = 1,
    block_size: int = 16,
    eviction_policy: str = "lru",
    schedule_policy: str = "fcfs",
    max_running: int = 64,
    cost_model: CostModel | None = None,
    seed: int = 0,
    in_batch_sharing: int | None = None,
    max_batch_tokens: int | None = None,
    chunked_prefill_size: int | None = None,
    preemption: bool = False,
) -> SimResult:
    """Replay ``requests`` through one cache under one KV budget; see the module doc.

    Args:
        cache: ``radix``, ``hash``, ``hash-v0``, ``none`` or a ready ``PrefixCache`` object.
        capacity_tokens: the KV budget in tokens; None means unlimited.
        page_size / block_size: granularity of the radix tree / hash blocks (the allocator takes the cache's).
        eviction_policy: as the caches take it, or ``belady`` (radix only).
        schedule_policy: ``fcfs``, ``lpm``, ``dfs-weight`` or ``random`` (seeded by ``seed``).
        in_batch_sharing: a token threshold enabling in-batch prefix sharing (not applied with
            ``cache="none"``, as in the engine; the config records None then).
        max_batch_tokens / chunked_prefill_size: the engine's token budgets per step and per prefill chunk;
            None: unlimited, so every admitted prompt is prefilled whole in one step.
        preemption: False: a request reserves its whole KV (uncached prompt + output - 1) when admitted and
            nothing is preempted. True: KV grows as in the engine, a chunk or a token at a time, and a request
            short of memory preempts the newest running one (``SimResult.preemptions``).
    """
    requests = _numbered(_request_list(requests))
    limits = {"max_batch_tokens": max_batch_tokens, "chunked_prefill_size": chunked_prefill_size}
    _check_settings(max_running, limits, preemption, capacity_tokens=capacity_tokens, page_size=page_size,
                    block_size=block_size, seed=seed)
    scheduler, config = _scheduler(requests, cache, capacity_tokens, page_size=page_size, block_size=block_size,
                                   eviction_policy=eviction_policy, schedule_policy=schedule_policy,
                                   max_running=max_running, seed=seed, in_batch_sharing=in_batch_sharing,
                                   limits=limits, preemption=preemption)
    result = _run(feed := _Feed(requests), _Replica(feed, scheduler, cost_model or CostModel()))
    _check_idle(scheduler.cache, scheduler.allocator)
    result.config = {**config, "cost_model": asdict(cost_model or CostModel()), "requests": len(requests)}
    return result


def _scheduler(requests: Sequence[Request], cache: str | PrefixCache, capacity_tokens: int | None, *,
               page_size: int, block_size: int, eviction_policy: str, schedule_policy: str, max_running: int,
               seed: int, in_batch_sharing: int | None, limits: dict, preemption: bool) -> tuple[Scheduler, dict]:
    """One simulated engine's scheduler (its cache, allocator and policy) and the config that names it."""
    prefix_cache = _make_cache(cache, page_size, block_size, eviction_policy, requests)
    granularity = getattr(prefix_cache, "page_size", 1)
    if isinstance(prefix_cache, NoPrefixCache):
        in_batch_sharing = None  # as in the engine: holding requests back for a cache that never hits only delays them
    policy = make_policy(schedule_policy, seed=seed, in_batch_sharing=in_batch_sharing, page_size=granularity)
    slots = capacity_tokens
    if slots is None:  # room for every token of every request: nothing is ever evicted
        slots = sum(len(r.prompt) + r.output_len for r in requests) + granularity * (len(requests) + 1)
    allocator = SlotAllocator(slots, page_size=granularity)
    budget, chunk = (math.inf if v is None else int(v) for v in limits.values())
    scheduler = Scheduler(prefix_cache, allocator, policy, max_running=max_running, max_batch_tokens=budget,
                          chunked_prefill_size=chunk, whole_kv=None if preemption else _whole_kv)
    config = {
        "cache": cache if isinstance(cache, str) else type(cache).__name__, "capacity_tokens": capacity_tokens,
        "kv_slots": allocator.capacity, "allocator_page": granularity,  # the hash cache allocates whole blocks
        "page_size": page_size, "block_size": block_size, "eviction_policy": eviction_policy,
        "schedule_policy": schedule_policy, "max_running": max_running, "seed": seed,
        "in_batch_sharing": in_batch_sharing, **limits, "preemption": preemption,
    }
    return scheduler, config


def _check_settings(max_running: object, limits: dict, preemption: object, **ints: object) -> None:
    if not isinstance(preemption, bool):
        raise ValueError(f"preemption must be a bool, got {preemption!r}")
    bad = {k: v for k, v in ints.items() if not (v is None and k == "capacity_tokens")
           and not (is_int(v) and (v >= 1 or k == "seed"))}
    if bad:
        raise ValueError(f"want capacity_tokens None or int >= 1, page_size, block_size (replicas) ints >= 1, "
                         f"seed int: {bad}")
    if not is_int(max_running) or max_running < 1:
        raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
    bad = {k: v for k, v in limits.items() if v is not None and not (is_int(v) and v >= 1)}
    if bad:
        raise ValueError(f"token budgets must be None or ints >= 1, got {bad}")


def _check_idle(cache: PrefixCache, allocator: SlotAllocator) -> None:
    """After a run: both structures' invariants hold, nothing is locked and no slot leaked."""
    cache.check_invariants()
    allocator.check_invariants()
    held = allocator.num_free + cache.evictable_size + cache.protected_size
    if held != allocator.capacity or cache.protected_size:
        raise AssertionError(f"slots leaked: free + evictable + protected = {held} != capacity {allocator.capacity}")


def _request_list(requests: object) -> list[Request]:
    if isinstance(requests, str | bytes | dict) or not isinstance(requests, Iterable):
        raise ValueError(f"requests must be a list of Request, got {type(requests).__name__}")
    out = list(requests)
    if not all(isinstance(r, Request) for r in out):
        raise ValueError(f"requests must be Request objects, got {sorted({type(r).__name__ for r in out})}")
    return out


def _numbered(requests: list[Request]) -> list[Request]:
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
