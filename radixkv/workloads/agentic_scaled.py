"""Agent sessions scaled down in tokens and time, for a small model on a real server (``agentic_scaled``).

The sessions, their order and their split are ``agentic``'s (the same ``path``, ``sessions``, ``seed`` and
``split`` give the same sessions). Then:

* **Tokens.** Each prompt becomes *units*, one per scaled token: with ``token_scale`` s, a 64-token block is
  ``64 s`` units when that is a whole number (1/32: two units a block, ``block id * 2 + j``) and else one unit
  for every ``1 / (64 s)`` blocks (1/128: the id of every second block; ids name their whole prefix, so two
  prompts share exactly the units of the blocks they share). One more unit, unique to the request, stands for
  the partial last block (and keeps every prompt one unit longer than its predecessor). Output lengths scale
  by ``s`` (at least 1).
* **Time.** Every pause and every arrival is multiplied by ``time_scale``.
* **Turns.** ``turns`` keeps each session's first K requests by their recorded send time ``t``, and the
  session starts are drawn again so that ``concurrency`` sessions are active on average over what is kept
  (Little's law on the kept requests' recorded durations).
* **Context.** A request whose prompt is over ``max_context`` units is dropped with everything that waits
  on it (its stream's later requests, sub-agents started after it).

The result is ``Request``s whose ``prompt`` holds unit ids (int64), linked by ``parent`` with the scaled
``think_time``; ``meta`` adds ``real_prompt`` and ``real_pause`` (the trace's own tokens and seconds) to
``agentic``'s keys. ``experiments.agentic_online`` renders units as words and replays them on a server, or
simulates the same requests.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np

from radixkv.checks import is_int, is_real
from radixkv.workloads.agentic import AGENTIC_BLOCK, agentic, session_duration
from radixkv.workloads.request import Request, number

UNIT_TAIL = 1 << 60  # first id of the per-request tail units (a unit id of a block is far below it)


def units_per_block(token_scale: float) -> Fraction:
    """Units a 64-token block becomes at ``token_scale``: a whole number, or 1 / a whole number.

    >>> units_per_block(1 / 32), units_per_block(1 / 128)
    (Fraction(2, 1), Fraction(1, 2))
    """
    if not (is_real(token_scale) and 0 < token_scale <= 1):
        raise ValueError(f"token_scale must be a number in (0, 1], got {token_scale!r}")
    per = Fraction(token_scale).limit_denominator(1 << 20) * AGENTIC_BLOCK
    if per.numerator != 1 and per.denominator != 1:
        raise ValueError(f"token_scale {token_scale} makes {float(per):g} units of a {AGENTIC_BLOCK}-token block; "
                         f"it must be a whole number or one over one (1/32, 1/64, 1/128, ...)")
    return per


def units_of(block_ids: np.ndarray, per_block: Fraction) -> np.ndarray:
    """A prompt's full blocks as unit ids (int64), see the module doc. O(blocks)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if per_block.denominator == 1:
        k = per_block.numerator
        return (ids[:, None] * k + np.arange(k, dtype=np.int64)).ravel()
    g = per_block.denominator
    return ids[g - 1::g].copy()


def agentic_scaled(path: str | Path, *, sessions: int | None = None, seed: int = 0, split: str | None = None,
                   concurrency: float = 4, token_scale: float = 1 / 32, time_scale: float = 1.0,
                   turns: int | None = None, max_context: int | None = None,
                   wait_for_sub_agents: bool = False) -> list[Request]:
    """The sessions of ``path`` scaled in tokens and time; see the module doc. ``wait_for_sub_agents``: a main
    agent's request also waits for the sub-agents the trace shows it waited for (``agentic``'s; ``after``:
    those kept). ``ValueError`` for a bad file, a bad scale, ``turns`` or ``max_context`` below 1, or
    ``agentic``'s own bad arguments."""
    per_block = units_per_block(token_scale)
    if not (is_real(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a number > 0, got {time_scale!r}")
    for name, value in (("turns", turns), ("max_context", max_context)):
        if value is not None and not (is_int(value) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
    real = agentic(path, concurrency=concurrency, seed=seed, sessions=sessions, split=split,
                   wait_for_sub_agents=wait_for_sub_agents)
    kept = _kept(real, turns)
    by_session: dict[object, list[dict]] = {}
    for r in kept:
        by_session.setdefault(r.session, []).append({"t": r.meta["t"], "api_time": r.meta["api_time"]})
    mean = float(np.mean([session_duration(rows) for rows in by_session.values()]))
    rate = concurrency / max(mean, 1e-9)  # sessions per real second over what is kept
    real = agentic(path, rate=rate, seed=seed, sessions=sessions, split=split,  # same order, new starts
                   wait_for_sub_agents=wait_for_sub_agents)
    kept = _kept(real, turns)
    return time_scaled(_scaled(kept, per_block, float(token_scale), max_context), float(time_scale))


def time_scaled(requests: list[Request], time_scale: float) -> list[Request]:
    """Copies of ``requests`` with every arrival and pause times ``time_scale`` (``agentic_scaled``'s time
    scale applied to requests already built, without reading the trace again). O(n)."""
    return [replace(r, arrival=r.arrival * time_scale, think_time=r.think_time * time_scale, meta=dict(r.meta))
            for r in requests]


def _kept(requests: list[Request], turns: int | None) -> list[Request]:
    """Each session's first ``turns`` requests by recorded send time (a parent is always sent earlier)."""
    if turns is None:
        return requests
    by_session: dict[object, list[Request]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    keep = {r.rid for rows in by_session.values() for r in sorted(rows, key=lambda r: r.meta["t"])[:turns]}
    return [r for r in requests if r.rid in keep]


def _scaled(requests: list[Request], per_block: Fraction, token_scale: float,
            max_context: int | None) -> list[Request]:
    """The kept requests in units (their times as recorded), renumbered; an over-long prompt drops its
    dependants."""
    index: dict[int, int] = {}  # rid -> position in ``out``
    out: list[Request] = []
    for r in requests:  # rid order: a parent comes before its children
        if r.parent is not None and r.parent not in index:
            continue  # its parent was dropped (over the context, or past ``turns``)
        units = np.append(units_of(r.prompt.block_ids(), per_block), UNIT_TAIL + r.rid)
        if max_context is not None and len(units) > max_context:
            continue
        index[r.rid] = len(out)
        meta = {**r.meta, "real_prompt": len(r.prompt), "real_pause": r.think_time}
        out.append(Request(arrival=r.arrival, session=r.session, prompt=units,
                           output_len=max(1, round(r.output_len * token_scale)),
                           parent=None if r.parent is None else index[r.parent],
                           after=tuple(index[d] for d in r.after if d in index),  # those kept
                           think_time=r.think_time, meta=meta))
    return number(out)


def reordered(requests: list[Request], order: int) -> list[Request]:
    """The same sessions in another arrival order: the session start times the replay drew, dealt to the
    sessions in a seeded shuffle (``order`` 0: the requests as given), every request of a session moved with
    its start; renumbered. The requests are copies. O(n log n)."""
    if not is_int(order) or order < 0:
        raise ValueError(f"order must be an integer >= 0, got {order!r}")
    starts: dict[object, float] = {}
    for r in requests:
        starts[r.session] = min(starts.get(r.session, np.inf), r.arrival)
    names = list(starts)
    dealt = np.random.default_rng(order).permutation(len(names)) if order else np.arange(len(names))
    shift = {s: starts[names[j]] - starts[s] for s, j in zip(names, dealt, strict=True)}
    return number([Request(arrival=r.arrival + shift[r.session], session=r.session, prompt=r.prompt,
                           output_len=r.output_len, parent=r.parent, after=r.after, think_time=r.think_time,
                           meta=dict(r.meta)) for r in requests])
