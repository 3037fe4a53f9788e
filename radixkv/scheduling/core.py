"""The scheduler core the engine and the simulator share: which requests run in a step, with how many tokens,
and the cache and memory steps around it.

One step (``Scheduler.schedule``): running requests first, in admission order, each its next prompt chunk
(at most ``chunked_prefill_size`` tokens) or one decode token, under the step's ``max_batch_tokens``;
then waiting requests in the policy's order (``admission_order``; arrival order for plain ``fcfs``), while
tokens, ``max_running`` and KV memory last. Admission matches with the at-least-one-token rule
(``match_for_prefill``) and locks the match; memory comes from the allocator, evicting unlocked cache
entries when short. After the model (or the cost model) ran the step, ``commit`` advances every request
and inserts each finished prefill chunk into the cache (``commit_prefix``: the request moves onto the
cache's slots and lock), and also each block filled while decoding for a cache that ``caches_during_decode``
(hash-v0); ``finish`` caches a finished request's sequence and unlocks it
(``release_sequence``). Every one of those cache calls carries the request's ``CacheHints``
(``RequestState.hints``: its priority and hold time, for the eviction policy).

Sharing within a step: a request the policy held back because a prefill is computing the prefix it shares
(in-batch prefix sharing) is admitted in the same step when a prefill chunk of that step computes the whole
shared prefix (``_admit_each``): it reads the lender's KV slots for it in the same forward, as the model stores
a layer's K/V for every row before any row attends (vLLM v1 gets the same from caching blocks when they
are allocated). The borrowed slots count as its cached prefix (``RequestState.cached``; its hit), and its
commit, after the lender's in the same ``commit``, finds them in the cache.

Memory comes in one of two ways:

* grown as needed (``whole_kv=None``, the engine's): a chunk's or a decode token's slots are allocated
  when it is scheduled; a running request that cannot get them preempts the newest running request not
  yet in the step (its KV freed, its cached prefix kept, back to the front of the queue to be recomputed),
  or itself when there is none;
* reserved whole at admission (``whole_kv`` gives a request's total KV tokens, which the simulator knows
  from its output length): nothing is ever preempted.

With a ``prefetcher`` (``radixkv.scheduling.prefetch``, the ``prefetch`` setting), the owner calls ``prefetch``
before each step: contexts of agent sessions due back soon are loaded from the lower tiers into free device
slots while no request waits (the simulator charges the copies, the engine's mover runs them).

The owner keeps what only it knows in a subclass of ``RequestState`` (the engine: sampling state and
tokens; the simulator: the clock), and ``RequestState.reset`` is where a preempted request forgets it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixkv.cache.base import NO_HINTS, CacheHints, MatchResult, PrefixCache, match_for_prefill
from radixkv.cache.lifecycle import commit_prefix, release_sequence
from radixkv.cache.tiers import DEVICE
from radixkv.memory import SlotAllocator
from radixkv.scheduling.policies import Candidate, SchedulePolicy, admission_order
from radixkv.scheduling.prefetch import Prefetcher
from radixkv.sessions import Sessions


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def causal_pairs(new_tokens: int, prefix_len: int) -> float:
    """(query, key) pairs a chunk of ``new_tokens`` after ``prefix_len`` cached tokens attends:
    query i sees ``prefix_len + i + 1`` keys, so ``n * (p + (n + 1) / 2)`` in all.

    The simulator's cost model and the engine's step records both count attention work with it.
    """
    return new_tokens * (prefix_len + (new_tokens + 1) / 2)


@dataclass(eq=False)
class RequestState:
    """One request as the scheduler sees it.

    ``slots`` hold the KV of its leading tokens: the first ``cached`` are the cache's own (locked through
    ``node``), the rest its own. ``computed`` leading tokens have their KV in the pool. ``hit`` is how many
    prompt tokens the cache held at its first admission (-1 before). ``hints`` (its priority and hold time,
    ``CacheHints``, with ``request`` its ``rid`` unless given) go with every cache call made for it: matches,
    inserts, the commits and the release.
    """

    rid: int
    prompt: Sequence[int]
    namespace: Hashable = None
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    node: Any = None
    cached: int = 0
    computed: int = 0
    hit: int = -1
    hit_by_tier: dict[str, int] = field(default_factory=dict)  # ``hit`` by the tier it came from
    finished: bool = False  # its output is out: ``recover`` drops it instead of queueing it again
    hints: CacheHints = NO_HINTS

    def __post_init__(self) -> None:
        if self.hints.request is None:  # the policies count reuse per request: this one is ``rid``
            self.hints = self.hints._replace(request=self.rid)

    @property
    def tokens(self) -> Sequence[int]:
        """The tokens known so far: the prompt here; the engine's record adds what it generated."""
        return self.prompt

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    def reset(self) -> None:
        """Back to not admitted (after a preemption or a failed admission); subclasses forget their own state."""
        self.node, self.slots, self.cached, self.computed = None, np.zeros(0, dtype=np.int64), 0, 0


Batch = list[tuple[RequestState, int]]  # each scheduled request and its new tokens this step


class Scheduler:
    """Waiting and running requests over one cache and one allocator; see the module docstring.

    ``max_batch_tokens`` and ``chunked_prefill_size`` may be ``math.inf`` (no limit: a prompt is prefilled
    whole when admitted). ``stats`` counts admissions (``prompt_tokens``, ``cached_tokens`` at a request's
    first admission), ``evicted_tokens`` and ``evictions`` (times memory pressure evicted), ``preemptions``,
    and the tokens ``commit`` advanced (``prefill_tokens``, ``decode_tokens``). ``on_first_admit`` (None, or
    settable later) is called with each request at its first admission, once ``hit`` and ``hit_by_tier``
    are set and counted in ``stats`` (the engine adds up the prefill time its hits saved there).
    """

    def __init__(self, cache: PrefixCache, allocator: SlotAllocator, policy: SchedulePolicy, *, max_running: int,
                 max_batch_tokens: float = math.inf, chunked_prefill_size: float = math.inf,
                 whole_kv: Callable[[RequestState], int] | None = None):
        self.cache, self.allocator, self.policy = cache, allocator, policy
        self.max_running, self.max_batch_tokens, self.chunk = max_running, max_batch_tokens, chunked_prefill_size
        self.whole_kv = whole_kv
        self.waiting: list[RequestState] = []
        self.running: list[RequestState] = []
        self.newly_admitted: list[RequestState] = []  # by the last ``schedule``
        self.stats = dict.fromkeys(("prompt_tokens", "cached_tokens", "prefill_tokens", "decode_tokens",
                                    "evicted_tokens", "evictions", "preemptions"), 0)
        self.hit_by_tier: dict[str, int] = {}  # ``cached_tokens`` by tier (a ``TieredCache``'s lower tiers)
        self.on_first_admit: Callable[[RequestState], None] | None = None
        self.clock: Callable[[], float] = time.monotonic  # seconds, for a policy that follows sessions
        # the sessions' book (radixkv.sessions): told of each request queued and finished, read by the session
        # policies, the eviction policy's too where it follows sessions (``build_stack`` hands it over)
        self.sessions = Sessions()
        # a policy that follows sessions is told of each request queued and finished (one written before
        # sessions existed lacks the attribute: it follows none)
        self.follows_sessions = bool(getattr(policy, "follows_sessions", False))
        if self.follows_sessions:
            policy.attach(self)
        self.prefetcher: Prefetcher | None = None  # loads sessions' contexts back before they return (``prefetch``)

    def add(self, state: RequestState) -> None:
        """Queue a request (it waits behind the others)."""
        self.waiting.append(state)
        self.sessions.returned(state.hints, self.clock())  # its stream's pause is learned here, at its arrival
        if self.follows_sessions:
            self.policy.added(state)

    # ---------------------------------------------------------------- prefetch
    def prefetch(self) -> int:
        """Load the contexts the ``prefetcher`` says are due back to the device from the cache's lower tiers,
        while no request waits, each whole into free device slots or not at all (a prefetch evicts nothing and
        takes no memory a waiting request could use; what it loads is unlocked and evictable): the tokens
        loaded. Due contexts wait while requests do. O(context) each."""
        if self.prefetcher is None or self.waiting:
            return 0
        due = self.prefetcher.due(self.clock())  # handed out even where nothing can load (no tier): never again
        return sum(self._prefetch(tokens, namespace, hints) for tokens, namespace, hints in due) \
            if self.cache.tiers else 0

    def next_prefetch(self) -> float:
        """When a context is next due back (this scheduler's clock; ``math.inf``: none, or no prefetcher)."""
        return math.inf if self.prefetcher is None else self.prefetcher.next_due()

    def _prefetch(self, tokens: np.ndarray, namespace: Hashable, hints: CacheHints) -> int:
        """Load what the lower tiers hold of ``tokens`` past the device's match into free slots: the tokens
        loaded. Nothing is looked up (so nothing is refreshed) unless the device lacks some of ``tokens`` and
        has the free slots for all it lacks. The lookups are the finished request's (``hints.request``) and
        carry nothing else: no policy takes them for a reuse of what that request left, or for the
        session's return."""
        missing = len(tokens) - self.cache.held_length(tokens, namespace)  # touches nothing
        if missing <= 0 or self.allocator.num_free < missing:
            return 0
        own = CacheHints(request=hints.request)
        m = self.cache.match_prefix(tokens, namespace, own)
        self.cache.lock(m.node)
        try:
            plan = self.cache.plan_load(tokens, m, namespace, own)
            n = plan.length
            if not n or self.allocator.num_free < n:
                self.cache.cancel(plan)
                return 0
            m = self.cache.load(plan, self.allocator.alloc(n))  # the lock moves onto the new match
            return n
        finally:
            self.cache.unlock(m.node)

    # ---------------------------------------------------------------- one step
    def schedule(self) -> Batch:
        """The step's requests and their new tokens, memory allocated; see the module docstring."""
        batch: Batch = []
        budget = self.max_batch_tokens
        self.newly_admitted = []
        for s in list(self.running):
            if s not in self.running:
                continue  # preempted while making room for an earlier one
            n = min(len(s.prompt) - s.computed, self.chunk, budget) if s.prefilling else 1
            if n < 1 or n > budget:
                continue  # the budget is spent: it runs next step
            if self._grow(s, n, batch):
                batch.append((s, n))
                budget -= n
        # Ranked only when something can be admitted: ranking costs a match per waiting request (and a
        # draw of the random policy).
        order, held = self._admission_order() if budget >= 1 and len(self.running) < self.max_running else ((), ())
        budget = self._admit_each(order, batch, budget)
        if budget is not None:
            self._admit_each(held, batch, budget, lend=True)
        return batch

    def _admit_each(self, states: Sequence[RequestState], batch: Batch, budget: float,
                    lend: bool = False) -> float | None:
        """Admit ``states`` in order into ``batch`` while tokens, ``max_running`` and KV memory last: the budget
        left, or None once one could not be admitted. ``lend``: only each held-back request whose whole shared
        prefix a prefill chunk of this step computes, borrowing that chunk's slots for it (see the module
        docstring). O(held x prefills x prompt) then."""
        for s in states:
            if budget < 1 or len(self.running) >= self.max_running:
                return None
            lender = self._lender(s, batch) if lend else None
            if lend and lender is None:
                continue
            n = self._admit(s, budget, lender)
            if not n:
                return None  # out of KV memory until a running request finishes
            batch.append((s, n))
            budget -= n
        return budget

    def _lender(self, s: RequestState, batch: Batch) -> tuple[RequestState, int] | None:
        """The prefill of this step that computes, by its end, all that ``s`` shares with any prompt still being
        prefilled (whole pages, at most all but its last token), and that length; None if none does."""
        prompt, ps = np.asarray(s.prompt), self.allocator.page_size
        done = {id(r): r.computed + n for r, n in batch if r.prefilling}  # computed once this step has run
        shared = {id(r): _common_prefix(prompt[:-1], np.asarray(r.prompt)) // ps * ps for r in self.running
                  if r is not s and r.prefilling and r.namespace == s.namespace}
        want = max(shared.values(), default=0)
        lender = next((r for r in self.running if shared.get(id(r)) == want and done.get(id(r), 0) >= want), None)
        return (lender, want) if lender is not None and want > 0 else None

    def commit(self, batch: Batch, decode_tokens: int = 1) -> None:
        """After the step ran: every request advances by its tokens (a decode by ``decode_tokens``, for a
        stride of decode-only steps), and each prefill chunk's KV joins the cache."""
        for s, n in batch:
            if s.prefilling:
                s.computed += n
                self.stats["prefill_tokens"] += n
                s.node, s.cached, s.slots = commit_prefix(self.cache, self.allocator, s.prompt[: s.computed],
                                                          s.slots, s.cached, s.node, s.namespace, s.hints)
            else:
                s.computed += decode_tokens
                self.stats["decode_tokens"] += decode_tokens
                if self.cache.caches_during_decode:
                    self._cache_decoded(s)

    def _cache_decoded(self, s: RequestState) -> None:
        """Cache a decoding request's computed tokens once they fill another block (vLLM v0's promotion);
        its own copy of a block the cache already holds is freed. A record that knows no generated tokens
        (the simulator's, which draws them at finish) caches them at finish instead, with the same result."""
        if len(s.tokens) >= s.computed and self.cache.cacheable_length(s.computed) > s.cached:
            s.node, s.cached, s.slots = commit_prefix(self.cache, self.allocator, s.tokens[: s.computed], s.slots,
                                                      s.cached, s.node, s.namespace, s.hints)

    def extend_decodes(self, states: Sequence[RequestState], tokens: int) -> bool:
        """``tokens`` more KV slots for each decoding request, all or none, without evicting (a stride of
        decode steps; reserved requests need none). Whether they were allocated."""
        if self.whole_kv is not None or tokens < 1:
            return True
        ps = self.allocator.page_size
        pages = sum(-(-max(0, tokens - self._room(s)) // ps) for s in states)
        if pages * ps > self.allocator.num_free:
            return False
        for s in states:
            self._extend(s, tokens)
        return True

    def finish(self, state: RequestState, sequence: Sequence[int]) -> None:
        """A finished request: cache ``sequence`` (its tokens whose KV was computed), free the rest, unlock."""
        # the book and the policy first: what they decide of the finish (a pin's TTL) is there when the cache
        # tells its eviction policy of the sequence
        awaited = self.sessions.finished(state.hints, self.clock(), len(sequence))
        if self.follows_sessions:
            self.policy.finished(state, len(sequence))
        release_sequence(self.cache, self.allocator, sequence, state.slots[: len(sequence)], state.cached,
                         state.node, state.namespace, state.hints)
        self.running.remove(state)
        if self.prefetcher is not None and awaited is not None:
            cached = np.asarray(sequence)[: self.cache.cacheable_length(len(sequence))]
            self.prefetcher.finished(awaited, cached, state.namespace)

    def abort(self, s: RequestState) -> None:
        """Drop a waiting or running request: what it computed (its leading tokens with KV) is cached as
        at finish, the rest of its slots freed, its lock released."""
        if s in self.running:
            n = min(s.computed, len(s.tokens))  # the simulator's records know their prompt only
            self.finish(s, s.tokens[:n])
            self.allocator.free(s.slots[max(n, s.cached) :])
        if s in self.waiting:
            self.waiting.remove(s)
        s.reset()

    def recover(self, done: set[int] = frozenset()) -> None:
        """Rebuild the books after a failure anywhere in a step (any exception, between any two lines of
        ``schedule``, ``commit`` or ``finish``): keep every cache entry and drop every lock, free every slot
        the cache does not hold, and queue every unfinished request again, the running ones first in their
        order, to be recomputed from what the cache holds; ``done`` names requests whose output is out
        (dropped). Every lock is dropped, also one taken outside the scheduler. Nothing is lost or held
        twice, whatever the records said. O(capacity + cache size)."""
        queue = list(dict.fromkeys(s for s in self.running + self.waiting if not s.finished and s.rid not in done))
        for s in queue:
            s.reset()
        self.waiting, self.running, self.newly_admitted = queue, [], []
        self.cache.unlock_all()
        self.allocator.retain(self.cache.held_slots())

    def flush(self) -> int:
        """Evict every cache entry no request holds, in every tier, writing nothing down (SGLang's
        ``flush_cache``): the device slots freed. A fault part way leaves the cache's invariants whole and
        slots unreturned: the caller ``recover``s. O(cache)."""
        return self.cache.flush(self.allocator)

    def withdraw(self, rids: set[int]) -> None:
        """Drop the unfinished requests with these ids, freeing what they hold (their cached prefixes stay)."""
        for s in [s for s in self.running if s.rid in rids]:
            self._release(s)
            self.running.remove(s)
        self.waiting = [s for s in self.waiting if s.rid not in rids]

    # ------------------------------------------------------------- admission
    def _admission_order(self) -> tuple[list[RequestState], list[RequestState]]:
        """The waiting requests in policy order, ranked once per step (each is matched again when admitted), and
        those a policy that sees prefills in flight held back, in arrival order (``_admit_each`` may lend to them)."""
        if not self.waiting:
            return [], []
        if self.policy.name == "fcfs":  # arrival order: the queue's own (a preempted request at its front)
            return list(self.waiting), []
        cands = [Candidate(s, np.asarray(s.prompt), match_for_prefill(self.cache, s.prompt, s.namespace, s.hints)
                           if self.policy.needs_match else None, s.rid, s.namespace) for s in self.waiting]
        # the running prefills, whose chunks will cache what they share with waiting requests
        in_flight = [Candidate(s, np.asarray(s.prompt), None, s.rid, s.namespace) for s in self.running
                     if s.prefilling] if self.policy.sees_in_flight else []
        offered = [c.request for c in admission_order(self.policy, cands, in_flight)]
        if not self.policy.sees_in_flight:
            return offered, []
        chosen = {id(r) for r in offered}
        # what the inner policy left out (a session policy's gate) is not held back but not offered at all
        inner = getattr(self.policy, "inner_offered", None)
        return offered, [s for s in self.waiting if id(s) not in chosen and (inner is None or id(s) in inner)]

    def _admit(self, s: RequestState, budget: float, lend: tuple[RequestState, int] | None = None) -> int:
        """Match, lock and allocate ``s``'s first chunk (or its whole KV); its chunk's tokens, or 0 when memory
        is short (nothing changed then but the eviction). ``lend``: a prefill of this step and how many leading
        tokens of ``s`` it computes, whose slots ``s`` takes as its cached prefix where they reach past the
        cache's match."""
        # matched again (earlier admissions may have evicted); ``device`` stays the device tier's match
        m = device = match_for_prefill(self.cache, s.prompt, s.namespace, s.hints)
        self.cache.lock(m.node)
        m, tiers = self._load(s, m, budget)
        s.node, s.slots, s.cached, s.computed = m.node, m.indices, m.length, m.length
        if lend is not None and lend[1] > m.length:
            lender, length = lend
            s.slots = np.concatenate([m.indices, lender.slots[m.length : length]])
            s.cached = s.computed = length
        n, need = self._first_slots(s, s.cached, budget)
        if not self._allocate(s, need):
            self.cache.unlock(m.node)
            s.reset()
            return 0
        self.running.append(s)  # in both lists for a moment, never in neither (see recover)
        self.waiting.remove(s)
        self.newly_admitted.append(s)
        if s.hit < 0:  # a preempted request re-admitted is not a new lookup: it would count its own KV
            s.hit = s.cached
            lent = s.cached - sum(tiers.values())  # tokens read from a lender of this step count as the device's
            s.hit_by_tier = {**tiers, DEVICE: tiers[DEVICE] + lent}
            self.stats["prompt_tokens"] += len(s.prompt)
            self.stats["cached_tokens"] += s.cached
            for tier, n_hit in s.hit_by_tier.items():
                self.hit_by_tier[tier] = self.hit_by_tier.get(tier, 0) + n_hit
            # a reuse, once per request (write_through_selective counts them), never per retry
            self.cache.admitted(s.prompt, device, s.namespace, s.hints)
            if self.on_first_admit is not None:
                self.on_first_admit(s)
        return n

    def _first_slots(self, s: RequestState, cached: int, budget: float) -> tuple[int, int]:
        """After ``cached`` prompt tokens: the first chunk's tokens, and the slots admission allocates (that
        chunk's, or the whole KV's where it is reserved at admission)."""
        n = int(min(len(s.prompt) - cached, self.chunk, budget))
        return n, n if self.whole_kv is None else self.whole_kv(s) - cached

    def _load(self, s: RequestState, m: MatchResult, budget: float) -> tuple[MatchResult, dict[str, int]]:
        """Extend ``m`` (locked) from the cache's lower tiers (if it has any) into fresh device slots, evicting
        as usual: the match to use and its tokens per tier. Only when the admission's own slots (its first
        chunk, or its whole KV) fit too: a request that is not admitted loads nothing (``m`` alone is returned)."""
        if self.cache.tiers:  # else nothing below the device to load from (a plan would be empty)
            plan = self.cache.plan_load(s.prompt[: max(len(s.prompt) - 1, 0)], m, s.namespace, s.hints)
            if plan.length:
                _, rest = self._first_slots(s, m.length + plan.length, budget)
                page = self.allocator.page_size
                need = plan.length + math.ceil(rest / page) * page  # the chunk starts on a fresh page after the load
                if self._make_room(need):
                    by_tier = plan.by_tier()
                    return self.cache.load(plan, self.allocator.alloc(plan.length)), by_tier
                self.cache.cancel(plan)
        return m, {DEVICE: m.length}

    # ---------------------------------------------------------------- memory
    def _room(self, s: RequestState) -> int:
        """Free slots left in the request's own last page (none on the cache's pages, which are whole)."""
        return 0 if len(s.slots) <= s.cached else -len(s.slots) % self.allocator.page_size

    def _extend(self, s: RequestState, n: int) -> None:
        last = int(s.slots[-1]) if len(s.slots) > s.cached else None  # the cache's pages are whole: a fresh page
        s.slots = np.concatenate([s.slots, self.allocator.extend(last, n)])

    def _allocate(self, s: RequestState, n: int) -> bool:
        """Give ``s`` n more slots, evicting unlocked cache when short; False if that is not enough.

        The slots continue the request's last page, so its slots fill pages in order.
        """
        if not self._make_room(n - min(self._room(s), n)):
            return False
        self._extend(s, n)
        return True

    def _make_room(self, need: int) -> bool:
        """Whether ``need`` slots are free, after evicting unlocked cache where fewer were."""
        if self.allocator.num_free < need:
            freed = self.cache.evict(need - self.allocator.num_free)
            self.allocator.free(freed)
            self.stats["evicted_tokens"] += len(freed)
            self.stats["evictions"] += bool(len(freed))
        return self.allocator.num_free >= need

    def _grow(self, s: RequestState, n: int, batch: Batch) -> bool:
        """``n`` more slots for a running request (none when reserved whole), preempting the newest others
        not in the batch if needed; False when ``s`` itself had to go."""
        if self.whole_kv is not None:
            return True
        scheduled = {id(b[0]) for b in batch}
        while not self._allocate(s, n):
            victims = [v for v in self.running if v is not s and id(v) not in scheduled]
            self.preempt(victims[-1] if victims else s)
            if not victims:
                return False
        return True

    def preempt(self, s: RequestState) -> None:
        """Free a running request's own KV, keep its cached prefix, and queue it first to be recomputed."""
        self._release(s)
        self.waiting.insert(0, s)
        self.running.remove(s)
        self.stats["preemptions"] += 1

    def _release(self, s: RequestState) -> None:
        self.allocator.free(s.slots[s.cached :])
        self.cache.unlock(s.node)
        s.reset()
