"""Agent sessions, in one place: how an answer ended, which streams are awaited, and when they come back.

An agent session is a main agent (stream 0) and its sub-agents (streams 1, 2, ..., each with a parent
stream). A request of a stream finishes one way (``Finish``); after a tool call or the end of a turn its
stream is *awaited*: its next request is expected after a pause (a tool runs for seconds, a human answers
in minutes). ``Sessions`` keeps that book per (session, stream), learns the pauses online (``Pauses``)
and, for a router, where each session was sent (``Homes``). The ``session`` schedule policy, the ``session``
eviction policy and the ``Prefetcher`` read their scheduler's ``Sessions`` (one per replica: the scheduler
tells it of each request queued and finished), the ``affinity`` router its own (one per cluster); no other
module keeps session books. Later session policies (Continuum's per-tool TTL, KVFlow's prefetch) read
``Pauses.quantile`` and ``Pauses.geometric_mean``.

The pause model is keyed by (sub-agent?, finish, tool): a main agent's tool pause is not a sub-agent's, a
``Bash`` call's is not a ``Read``'s. A key with no pause seen yet answers from its (sub-agent?, finish)
aggregate (every tool), and None before any pause of that kind was seen. Means are over every pause seen
(online, O(1)); quantiles over the last ``WINDOW`` of each key (O(log WINDOW) per pause and per query).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from sortedcontainers import SortedList


class Finish(str, Enum):
    """How an answer ended. The values are the agent trace's (``tool_use``, ``end_turn``) and Anthropic's
    ``stop_reason`` names, so a ``Finish`` compares equal to the string a trace or a client writes."""

    TOOL_CALL = "tool_use"  # the answer called a tool: the stream comes back with its result, in seconds
    END_TURN = "end_turn"  # the answer ended the turn (EOS): a human answers, if anyone, minutes later
    LENGTH = "length"  # max_new_tokens ran out
    STOP_SEQUENCE = "stop_sequence"  # a stop string or stop token the request named
    ABORT = "abort"  # the client went away, or the engine dropped it

    def __str__(self) -> str:
        return self.value


class CacheHints(Protocol):
    """What this module reads of a request's hints (``radixkv.cache.base.CacheHints``, which the cache package
    defines: this module, below it, imports nothing of it)."""

    session: Hashable
    stream: Hashable
    parent: Hashable
    stop: str | None
    tool: str | None

    def _replace(self, **fields: Any) -> CacheHints: ...


AWAITED = (Finish.TOOL_CALL, Finish.END_TURN)  # the finishes after which a stream is expected back
MAIN_STREAM = 0


def finish_of(value: object) -> Finish | None:
    """A ``Finish`` from its value (``"tool_use"``, ...); None for None or "" (not recorded); ``ValueError``
    for anything else."""
    if value is None or value == "":
        return None
    try:
        return Finish(value)
    except ValueError:
        raise ValueError(f"unknown finish {value!r}: one of {', '.join(f.value for f in Finish)}") from None


def finish_kind(reason: str, declared: Finish | None, called: bool, stop_token: bool) -> Finish | None:
    """How an engine's answer ended: what the caller ``declared`` (a trace replay), else a tool call where
    its parser found one (``called``), else from the engine's ``reason``: ``stop`` at a stop token the
    request named (``stop_token``) is a stop sequence and at EOS the end of the turn, ``length``, ``abort``;
    None for ``error``."""
    if reason == "error":
        return None
    if declared is not None:
        return declared
    if called:
        return Finish.TOOL_CALL
    if reason == "stop":
        return Finish.STOP_SEQUENCE if stop_token else Finish.END_TURN
    return Finish.LENGTH if reason == "length" else Finish.ABORT


def is_sub_agent(stream: object) -> bool:
    """Whether a stream is a sub-agent's (any stream but the main agent's 0; None, unknown, is the main)."""
    return stream is not None and stream != MAIN_STREAM


def session_hints(hints: CacheHints, session: Hashable, stream: Hashable = None, parent: Hashable = None,
                  finish: object = None, tool: str | None = None) -> CacheHints:
    """``hints`` with a request's session hints: its session, stream, parent stream, and how its answer
    ended where known (``finish``, as ``stop``) with the tool it called. The one way the engine
    (``SamplingParams.cache_hints``, then the finish) and the simulator (a trace's ``meta``) build them."""
    return hints._replace(session=session, stream=stream, parent=parent, stop=finish_of(finish), tool=tool)


AWAITED_MAX = 4096  # streams awaited at once, at most: past it the older half (those that never came back) goes
WINDOW = 1024  # the pauses of each key a quantile is read from (the latest)
PauseKey = tuple[bool, Finish, "str | None"]  # (sub-agent?, finish, tool)


def stream_key(hints: CacheHints) -> tuple[Hashable, Hashable] | None:
    """The book's key of a request: (session, stream); None for a request of no session."""
    return None if hints.session is None else (hints.session, hints.stream)


def pause_key(hints: CacheHints) -> PauseKey:
    """The kind of pause that follows a finish with these hints: (sub-agent?, finish, tool)."""
    return is_sub_agent(hints.stream), finish_of(hints.stop), hints.tool if hints.stop == Finish.TOOL_CALL else None


class _Seen:
    """The pauses of one key: every one's sum and sum of logs (the means), the latest ``WINDOW`` sorted."""

    __slots__ = ("n", "total", "logs", "latest", "ordered")

    def __init__(self):
        self.n, self.total, self.logs = 0, 0.0, 0.0
        self.latest: deque[float] = deque()
        self.ordered = SortedList()

    def add(self, seconds: float) -> None:
        self.n += 1
        self.total += seconds
        self.logs += math.log(max(seconds, 1e-3))  # a return at once counts as a millisecond
        self.latest.append(seconds)
        self.ordered.add(seconds)
        if len(self.latest) > WINDOW:
            self.ordered.remove(self.latest.popleft())


class Pauses:
    """The online pause model: seconds from a stream's finish to its next request, per (sub-agent?, finish,
    tool). See the module doc."""

    def __init__(self):
        self._seen: dict[PauseKey, _Seen] = {}

    def observe(self, key: PauseKey, seconds: float) -> None:
        """One pause of this kind. O(log WINDOW)."""
        sub, finish, tool = key
        for k in {key, (sub, finish, None)}:  # the tool's own, and its kind's over every tool
            self._seen.setdefault(k, _Seen()).add(seconds)

    def _of(self, key: PauseKey) -> _Seen | None:
        seen = self._seen.get(key)
        return seen if seen is not None else self._seen.get((key[0], key[1], None))

    def count(self, key: PauseKey) -> int:
        """Pauses seen of this kind (its aggregate's where the tool's has none)."""
        seen = self._of(key)
        return 0 if seen is None else seen.n

    def mean(self, key: PauseKey) -> float | None:
        """The arithmetic mean pause, seconds (None: none seen)."""
        seen = self._of(key)
        return None if seen is None else seen.total / seen.n

    def geometric_mean(self, key: PauseKey) -> float | None:
        """The geometric mean pause, seconds (None: none seen): near the median of pauses that spread over
        orders of magnitude, where the arithmetic mean sits near the longest."""
        seen = self._of(key)
        return None if seen is None else math.exp(seen.logs / seen.n)

    def expected(self, key: PauseKey) -> float | None:
        """The expected return, seconds after the finish: the geometric mean (see it)."""
        return self.geometric_mean(key)

    def quantile(self, key: PauseKey, q: float) -> float | None:
        """The ``q`` quantile (0..1) of the latest pauses, seconds (None: none seen): a TTL that covers
        that share of returns (Continuum sets its TTL per tool from the pause distribution)."""
        if not 0 <= q <= 1:
            raise ValueError(f"a quantile is in [0, 1], got {q!r}")
        seen = self._of(key)
        if seen is None:
            return None
        ordered = seen.ordered
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    def window(self, key: PauseKey) -> list[float]:
        """The latest pauses of this kind (its aggregate's where the tool's has none), sorted; [] before any."""
        seen = self._of(key)
        return [] if seen is None else list(seen.ordered)

    def kinds(self) -> Iterable[PauseKey]:
        return self._seen.keys()


@dataclass
class Awaited:
    """A stream's last finish after which it is awaited: when it finished, how (``hints``: its stop and
    tool), the context it left (``length`` tokens; ``tokens`` and ``namespace`` where a prefetch keeps them),
    the kind of pause that follows (``kind``), when its next request came (``back``; None: still awaited),
    and the prefetch's bookkeeping (``tie``: its item in the due heap, 0 none; ``stale``: when a prefetch
    stops being worth it)."""

    finished: float
    hints: CacheHints
    kind: PauseKey
    length: int = 0
    back: float | None = None
    tokens: Any = None
    namespace: Hashable = None
    tie: int = 0
    stale: float = math.inf
    pin: float | None = None  # what a schedule policy decided of the path left (radixkv.cache.eviction.pins)


class Homes:
    """Where a router sent each session last: (replica, its context's tokens, last seen); a session idle
    ``window`` seconds leaves. Each replica's ``active`` tokens sum its sessions' contexts. O(log n) per
    placement, amortized."""

    def __init__(self, window: float):
        self.window = window
        self._homes: dict[Hashable, tuple[int, int, float]] = {}
        self._seen: list[tuple[float, int, Hashable]] = []  # (last seen, order, session): a heap, to expire the idle
        self._order = 0
        self.active: list[int] = []  # per replica

    def home(self, session: Hashable, now: float) -> int | None:
        """The replica the session was last sent to (None: a new one, or one gone idle)."""
        while self._seen and self._seen[0][0] < now - self.window:  # sessions gone idle leave
            seen, _, idle = heapq.heappop(self._seen)
            home = self._homes.get(idle)
            if home is not None and home[2] == seen:
                self.active[home[0]] -= home[1]
                del self._homes[idle]
        home = self._homes.get(session) if session is not None else None
        return None if home is None else home[0]

    @property
    def placed(self) -> set[Hashable]:
        """The sessions with a home (those not yet gone idle when last asked)."""
        return set(self._homes)

    def place(self, session: Hashable, replica: int, tokens: int, now: float) -> None:
        """The session's request of ``tokens`` went to ``replica``."""
        self.active += [0] * (replica + 1 - len(self.active))
        old = self._homes.get(session)
        if old is not None:
            self.active[old[0]] -= old[1]
        self._homes[session] = (replica, tokens, now)
        self.active[replica] += tokens
        self._order += 1
        heapq.heappush(self._seen, (now, self._order, session))


class Sessions:
    """The book of one scheduler's (or one router's) sessions; see the module doc.

    ``finished`` and ``returned`` are told of each finish and arrival (the scheduler does). ``awaited``
    holds, by (session, stream), each stream's last finish after a tool call or a turn's end until its next
    finish (``Awaited.back`` set once its next request came), ``after(finish)`` those of one kind of finish.
    ``homes``: a router's (``Homes``, with ``homes_window``). O(1) per finish and arrival (O(log WINDOW) per
    pause learned), O(n log n) once per n/2 finishes past ``AWAITED_MAX``."""

    def __init__(self, homes_window: float | None = None):
        self.pauses = Pauses()
        self.awaited: dict[tuple[Hashable, Hashable], Awaited] = {}
        self._after: dict[Finish, dict[tuple[Hashable, Hashable], Awaited]] = {f: {} for f in AWAITED}
        self.homes = None if homes_window is None else Homes(homes_window)

    def after(self, finish: Finish) -> dict[tuple[Hashable, Hashable], Awaited]:
        """The streams awaited after this kind of finish (``TOOL_CALL`` or ``END_TURN``), by (session, stream)."""
        return self._after[finish]

    def finished(self, hints: CacheHints, now: float, length: int = 0) -> Awaited | None:
        """A request with these hints finished at ``now`` leaving ``length`` tokens of context: its stream is
        awaited after a tool call or a turn's end (the entry, to add to), and no longer otherwise."""
        key = stream_key(hints)
        if key is None:
            return None
        self._drop(key)
        if hints.stop not in AWAITED:
            return None
        if len(self.awaited) >= AWAITED_MAX:
            for old in sorted(self.awaited, key=lambda k: self.awaited[k].finished)[: AWAITED_MAX // 2]:
                self._drop(old)
        entry = self.awaited[key] = Awaited(now, hints, pause_key(hints), length)
        self._after[finish_of(hints.stop)][key] = entry
        return entry

    def returned(self, hints: CacheHints, now: float) -> Awaited | None:
        """A request with these hints arrived at ``now``: the pause since its stream's finish is learned
        (once), and the stream is back (its entry, or None). O(log WINDOW)."""
        key = stream_key(hints)
        entry = self.awaited.get(key) if key is not None else None
        if entry is not None and entry.back is None:
            entry.back = now
            entry.tokens = None  # no prefetch for it now
            self.pauses.observe(entry.kind, now - entry.finished)
        return entry

    def _drop(self, key: tuple[Hashable, Hashable]) -> Awaited | None:
        entry = self.awaited.pop(key, None)
        if entry is not None:
            self._after[entry.kind[1]].pop(key, None)
        return entry

    def describe(self) -> dict[str, Any]:
        """What was learned: per kind of pause, how many and their geometric mean, seconds."""
        return {"awaited": sum(a.back is None for a in self.awaited.values()), "pauses": {
            f"{'sub' if sub else 'main'}/{finish.value}" + (f"/{tool}" if tool else ""):
                {"n": self.pauses.count((sub, finish, tool)),
                 "geometric_mean_s": self.pauses.geometric_mean((sub, finish, tool))}
            for sub, finish, tool in self.pauses.kinds()}}
