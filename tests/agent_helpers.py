"""Helpers the agent-anchor tests share: a request of one session, one that ran and finished, a file of tool loops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_agentic import rec, write

from radixkv.cache.base import CacheHints
from radixkv.scheduling import RequestState, Scheduler


def session_request(rid: int, session: str, n: int, stop: str | None = None) -> RequestState:
    """A request of ``n`` tokens of its own, stream 0 of ``session``, its answer ending as ``stop``."""
    return RequestState(rid, list(range(rid * 1000, rid * 1000 + n)),
                        hints=CacheHints(request=rid, session=session, stream=0, stop=stop))


def learn_tool_pauses(sched: Scheduler, pauses: tuple[float, ...], first: int = 100) -> None:
    """The scheduler's book sees these pauses after a main agent's tool call (of sessions of their own)."""
    for k, pause in enumerate(pauses):
        hints = CacheHints(request=first + k, session=f"seen{first + k}", stream=0, stop="tool_use")
        sched.sessions.finished(hints, 0.0, 10)
        sched.sessions.returned(hints._replace(stop=None), pause)


def ran(sched: Scheduler, state: RequestState) -> None:
    """As if ``state`` was queued, admitted with nothing cached, computed its prompt and finished."""
    sched.add(state)
    sched.waiting.remove(state)
    match = sched.cache.match_prefix(np.asarray(state.prompt))
    sched.cache.lock(match.node)
    state.node, state.slots = match.node, sched.allocator.alloc(len(state.prompt))
    sched.running.append(state)
    sched.finish(state, state.prompt)


def tool_loops(path: Path, sessions: str = "ABC", turns: int = 5, apart: float = 15.0, spread: int = 0) -> Path:
    """An agentic file: each session a main agent calling tools ``turns - 1`` times, then ending its turn;
    ``spread``: block ids apart between sessions (0: they share their first blocks)."""
    rows = [rec(name, apart * i + k, [[1 + spread * k, 4 + 2 * i]], stop="tool_use" if i < turns - 1 else "end_turn")
            for k, name in enumerate(sessions) for i in range(turns)]
    return write(path, rows)
