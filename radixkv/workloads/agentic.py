"""Replay of real coding-agent sessions (Claude Code; ``shared/traces/agentic``, its README gives the format).

Each line is one request of a session: its stream (0 the main agent, 1, 2, ... its sub-agents), the
recorded send time ``t`` (seconds from the session's start), the model's answer time ``api_time``, how
the answer ended (``stop``: ``tool_use``, ``end_turn`` or unrecorded), and the prompt as runs of 64-token
block ids (an id names its whole prefix; ids are local to a session).

How the sessions are laid out (``agentic``):

* **Session starts** are Poisson arrivals, seeded, in a seeded order. The rate keeps ``concurrency``
  sessions active on average by Little's law: ``concurrency / mean session duration``, a session's
  duration being its last answer's recorded end; ``rate`` (sessions per second) replaces it.
* **Streams are closed loops.** The main agent's first request is sent at its session's start; every
  later one ``think_time`` after the previous request of its stream finished in the simulation
  (``parent``), the recorded pause: the ``t`` difference less the previous ``api_time`` where recorded,
  else the record's ``think_time``. A sub-agent's first request hangs from the main agent's latest request
  sent before it (by the recorded ``t``), after the recorded gap from that request's answer. With
  ``wait_for_sub_agents`` a main agent's request also waits (``after``) for each sub-agent whose final answer
  ended within the main agent's pause before it, and is sent the recorded gap after the last of them: the
  trace shows the main agent resumed when its Task tool's sub-agent had answered.
  ``max_pause`` caps every pause (off by default: human turns of an hour stay an hour). A request's
  ``arrival`` is the session's start plus the pauses along its chain: a lower bound of when it is sent
  (it never delays it), which orders the requests (``rid``) near the order they are sent in, as the
  clairvoyant references rank them.
* **Prompts are ``BlockPrompt``s**: block ``b`` of a session becomes the 64 token ids of a global block id
  (sessions share nothing), the partial last block tokens no other prompt holds, built into token ids only
  when the simulator sends the request. The whole file is 4.3 billion prompt tokens; held as runs it is a
  few megabytes. ``share_prefix=True`` maps the first ``(tool_tokens + system_tokens) // 64`` blocks of
  every stream with the same tool and system sizes (one client version's definitions) onto shared ids.
* **What each request carries**: ``session`` (its id), ``meta`` (in the simulator's per-request rows):
  ``stream``, ``agent``, ``stop`` (its answer's), ``turn`` (its place in its stream), ``after`` (the stop
  of the request it waits for: ``tool_use`` after a tool call, ``end_turn`` after a human turn, None for a
  stream's first), ``reusable`` (tokens an unlimited cache would hit: leading blocks an earlier prompt
  held), and the recorded ``t`` and ``api_time``. ``session``, ``stream`` and ``stop`` reach the caches'
  ``CacheHints``.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np

from radixkv.checks import is_int, is_real
from radixkv.sessions import AWAITED, is_sub_agent
from radixkv.workloads.jsonl import integer, read_records
from radixkv.workloads.request import BlockPrompt, Request, number
from radixkv.workloads.split import check_split, split_of

AGENTIC_BLOCK = 64
STOPS = (*(f.value for f in AWAITED), "")  # the trace records these finishes ("": not recorded)
MAX_BLOCK_ID = 1 << 40  # a session's local ids; global ids stay far below the tails' range
TAIL_BASE = 1 << 58  # first token id of the partial last blocks (each request its own 64 ids past it)
_FIELDS = ("session", "stream", "t", "input_length", "output_length", "block_runs")


def read_sessions(path: str | Path) -> list[dict]:
    """The file's records, each checked as it is read (as strictly as ``read_trace`` reads Mooncake's).

    A missing file is a ``FileNotFoundError``; a file with no records and any line that is not a valid record
    are ``ValueError``s naming the file and line: not UTF-8 or not a JSON object, a required field missing
    (``session``, ``stream``, ``t``, ``input_length``, ``output_length``, ``block_runs``), a negative or
    non-finite time (``t``, ``think_time``, ``api_time``), lengths or token counts that are not integers >= 0
    (``input_length`` >= 1), ``block_runs`` that are not ``[first id, count]`` pairs of integers
    (``0 <= first < 2^40``, ``count >= 1``) adding up to ``input_length // 64``, an unknown ``stop``, or a
    stream whose times go backwards. Nothing is skipped.
    """
    last_t: dict[tuple[str, int], float] = {}

    def parse(row: dict, where: str) -> dict:
        row = _record(row, where)
        key = (row["session"], row["stream"])
        if row["t"] < last_t.get(key, 0.0):
            raise ValueError(f"{where}: t {row['t']} is before the previous request of session "
                             f"{row['session']!r} stream {row['stream']} ({last_t[key]})")
        last_t[key] = row["t"]
        return row

    return read_records(path, parse, what="agentic trace", readme="shared/traces/agentic/README.md", required=_FIELDS)


def _record(row: dict, where: str) -> dict:
    """One line's object as a checked record; ``where`` (file:line) goes into every error."""
    if not isinstance(row["session"], str) or not row["session"]:
        raise ValueError(f"{where}: session must be a non-empty string, got {row['session']!r}")
    ints = {k: integer(row.get(k, 0)) for k in ("stream", "input_length", "output_length", "tool_tokens",
                                             "system_tokens")}
    for k, v in ints.items():
        low = 1 if k == "input_length" else 0
        if v is None or v < low:
            raise ValueError(f"{where}: {k} must be an integer >= {low}, got {row.get(k)!r}")
    for k in ("t", "think_time", "api_time"):
        v = row.get(k)
        if (k == "t" or v is not None) and not (is_real(v) and v >= 0):
            raise ValueError(f"{where}: {k} must be a finite number >= 0{'' if k == 't' else ' or null'}, got {v!r}")
    stop = row.get("stop", "")
    if stop not in STOPS:
        raise ValueError(f"{where}: stop must be one of {STOPS}, got {stop!r}")
    agent = row.get("agent")
    if agent is not None and not isinstance(agent, str):
        raise ValueError(f"{where}: agent must be a string or null, got {agent!r}")
    runs = row["block_runs"]
    if not isinstance(runs, list) or not all(
            isinstance(r, list) and len(r) == 2 and integer(r[0]) is not None and integer(r[1]) is not None
            and 0 <= r[0] < MAX_BLOCK_ID and r[1] >= 1 for r in runs):
        raise ValueError(f"{where}: block_runs must be [first id, count] pairs of integers (0 <= id < 2^40, "
                         f"count >= 1)")
    blocks = sum(int(r[1]) for r in runs)
    if blocks != ints["input_length"] // AGENTIC_BLOCK:
        raise ValueError(f"{where}: block_runs hold {blocks} blocks, input_length {ints['input_length']} has "
                         f"{ints['input_length'] // AGENTIC_BLOCK} full blocks of {AGENTIC_BLOCK}")
    return {**row, **ints, "t": float(row["t"]), "stop": stop, "agent": agent,
            "block_runs": np.asarray(runs, dtype=np.int64).reshape(-1, 2)}


def session_duration(rows: list[dict]) -> float:
    """A session's recorded length: the latest end of an answer (``t`` + ``api_time``, 0 where unrecorded)."""
    return max(r["t"] + (r.get("api_time") or 0.0) for r in rows)


def agentic(path: str | Path, *, concurrency: float = 16, seed: int = 0, rate: float | None = None,
            max_pause: float | None = None, share_prefix: bool = False, sessions: int | None = None,
            split: str | None = None, wait_for_sub_agents: bool = False) -> list[Request]:
    """The sessions of ``path`` as requests for ``simulate`` and ``simulate_cluster``; see the module doc.

    Args:
        concurrency: sessions active on average (Little's law over the mean recorded session duration).
        seed: the sessions' order and their Poisson start times.
        rate: sessions started per second, in place of ``concurrency``'s.
        max_pause: the longest pause between a request's parent finishing and its being sent (None: none).
        share_prefix: streams with equal ``(tool_tokens, system_tokens)`` share their first blocks.
        sessions: only the first N sessions of the seeded order (a slice; None: all).
        split: only the sessions on this side of the project's split (``radixkv.workloads.split``: ``"tune"``
            or ``"test"``), taken before the order and the slice; None: every session.
        wait_for_sub_agents: a main agent's request also waits for the sub-agents the trace shows it waited
            for (``_Layout.waits``): it is sent its recorded gap after the last of them finishes.

    ``ValueError`` for a bad file (``read_sessions``), a ``concurrency`` or ``rate`` that is not a number > 0, a
    negative ``max_pause``, ``sessions`` < 1, or an unknown ``split``; nothing is built then.
    """
    for name, value in (("concurrency", concurrency), ("rate", rate)):
        if (value is not None or name == "concurrency") and not (is_real(value) and value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if max_pause is not None and not (is_real(max_pause) and max_pause >= 0):
        raise ValueError(f"max_pause must be a number >= 0 or None, got {max_pause!r}")
    if sessions is not None and not (is_int(sessions) and sessions >= 1):
        raise ValueError(f"sessions must be an integer >= 1 or None, got {sessions!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    check_split(split)
    by_session: dict[str, list[dict]] = {}
    for row in read_sessions(path):
        if split is None or split_of(row["session"]) == split:
            by_session.setdefault(row["session"], []).append(row)
    rng = np.random.default_rng(seed)
    keys = list(by_session)
    names = [keys[i] for i in rng.permutation(len(keys))][:sessions]
    mean = float(np.mean([session_duration(by_session[n]) for n in names]))
    per_second = rate if rate is not None else concurrency / max(mean, 1e-9)
    starts = np.cumsum(rng.exponential(1.0 / per_second, size=len(names)))
    layout = _Layout(share_prefix, max_pause, wait_for_sub_agents)
    requests: list[Request] = []
    for name, start in zip(names, starts, strict=True):
        layout.session(by_session[name], float(start), requests)
    return number(requests)


class _Layout:
    """Builds each session's requests: global block ids, tails, parents and pauses."""

    def __init__(self, share_prefix: bool, max_pause: float | None, wait_for_sub_agents: bool = False):
        self.share_prefix, self.max_pause = share_prefix, np.inf if max_pause is None else max_pause
        self.wait_for_sub_agents = wait_for_sub_agents
        self.next_id = 1  # the next unused global block id
        self.shared: dict[tuple[int, int], int] = {}  # (tool, system tokens) -> first of its shared block ids
        self.seen: set[int] = set()  # every block id a prompt laid out so far held

    def session(self, rows: list[dict], start: float, out: list[Request]) -> None:
        base = self.next_id
        self.next_id += max((int((r["block_runs"][:, 0] + r["block_runs"][:, 1]).max()) for r in rows
                             if len(r["block_runs"])), default=0)
        last: dict[int, int] = {}  # stream -> index in ``out`` of its latest request
        main: list[int] = []  # indices of the main agent's requests, in order
        turns: dict[int, int] = {}
        # stream -> its last request's t (times never go back); only sub-agent waits read it
        final = {row["stream"]: row["t"] for row in rows} if self.wait_for_sub_agents else {}
        for row in sorted(rows, key=lambda r: r["t"]):  # stable: a stream's own order stays
            stream = row["stream"]
            parent, pause = self._parent(row, out, last, main)
            after: tuple[int, ...] = ()
            if self.wait_for_sub_agents and parent is not None and not is_sub_agent(stream):
                after, pause = self.waits(row, parent, pause, out, last, final)
            turns[stream] = turns.get(stream, -1) + 1
            tail = row["input_length"] % AGENTIC_BLOCK
            prompt = BlockPrompt(self._ids(row, base), AGENTIC_BLOCK, tail, TAIL_BASE + AGENTIC_BLOCK * len(out))
            meta = {"stream": stream, "agent": row["agent"], "stop": row["stop"], "turn": turns[stream],
                    "after": None if parent is None else out[parent].meta["stop"],
                    "reusable": self._reusable(prompt), "t": row["t"], "api_time": row.get("api_time")}
            # a lower bound of its send time: the pause after the latest of what it waits for
            arrival = start if parent is None else max(out[i].arrival for i in (parent, *after)) + pause
            out.append(Request(arrival=arrival, session=row["session"], prompt=prompt, after=after,
                               output_len=max(row["output_length"], 1), parent=parent, think_time=pause, meta=meta))
            last[stream] = len(out) - 1
            if not is_sub_agent(stream):
                main.append(len(out) - 1)

    def waits(self, row: dict, parent: int, pause: float, out: list[Request], last: dict[int, int],
              final: dict[int, float]) -> tuple[tuple[int, ...], float]:
        """The sub-agents a main agent's request waited for, by the trace's times, and its pause after them: each
        sub-agent stream whose final request ended (its ``t`` plus ``api_time``) after the main agent's previous
        request was sent and before this one was (the main agent's pause covered its last answer, and it never
        ran again: a Task tool's result). None of them: ``((), pause)`` unchanged. O(streams)."""
        sent = out[parent].meta["t"]
        waited = [i for s, i in last.items() if is_sub_agent(s) and out[i].meta["t"] == final[s]
                  and sent < _end(out[i]) <= row["t"]]
        if not waited:
            return (), pause
        gap = row["t"] - max(_end(out[i]) for i in waited)
        return tuple(waited), min(max(gap, 0.0), self.max_pause)

    def _reusable(self, prompt: BlockPrompt) -> int:
        """Tokens of the prompt's leading blocks that an earlier prompt held (recorded order), within its
        cacheable prefix (all but its last token, whole blocks): what an unlimited cache would hit. Block ids
        name their whole prefix, so the seen blocks lead the prompt: a binary search finds where they end."""
        ids = prompt.block_ids()
        lo = bisect.bisect_left(range(len(ids)), True, key=lambda i: int(ids[i]) not in self.seen)  # first unseen
        self.seen.update(ids[lo:].tolist())
        return min(lo * AGENTIC_BLOCK, (len(prompt) - 1) // AGENTIC_BLOCK * AGENTIC_BLOCK)

    def _parent(self, row: dict, out: list[Request], last: dict[int, int], main: list[int]
                ) -> tuple[int | None, float]:
        """The request this one waits for (None: sent at the session's start) and the pause after it."""
        stream = row["stream"]
        if stream in last:
            parent = last[stream]
        else:  # a sub-agent's first request, or the session's first: the main agent's latest sent before it
            before = [i for i in main if out[i].meta["t"] <= row["t"]] if is_sub_agent(stream) else []
            if not before:
                return None, 0.0
            parent = before[-1]
        prev = out[parent].meta
        if prev["api_time"] is not None or row.get("think_time") is None:
            pause = row["t"] - prev["t"] - (prev["api_time"] or 0.0)
        else:
            pause = row["think_time"]
        return parent, min(max(pause, 0.0), self.max_pause)

    def _ids(self, row: dict, base: int) -> np.ndarray:
        """The prompt's block runs in global ids: the session's offset, and shared ids for its first blocks
        where ``share_prefix`` maps them."""
        runs = row["block_runs"].copy()
        runs[:, 0] += base
        per_key = (row["tool_tokens"] + row["system_tokens"]) // AGENTIC_BLOCK
        k = min(per_key, int(runs[:, 1].sum()))
        if not (self.share_prefix and k):
            return runs
        key = (row["tool_tokens"], row["system_tokens"])
        if key not in self.shared:  # the first stream of this client version reserves its ids
            self.shared[key] = self.next_id
            self.next_id += per_key
        ids = BlockPrompt(runs, 1, 0, 0).block_ids()
        ids[:k] = np.arange(self.shared[key], self.shared[key] + k)
        return _runs_of(ids)


def _end(request: Request) -> float:
    """When a request's answer ended by the trace: its ``t`` plus its ``api_time`` (its ``t`` where unrecorded)."""
    return request.meta["t"] + (request.meta["api_time"] or 0.0)


def _runs_of(ids: np.ndarray) -> np.ndarray:
    """Block ids (at least one) as ``[k, 2]`` runs of consecutive ids. O(blocks)."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(ids) != 1) + 1])
    counts = np.diff(np.concatenate([starts, [len(ids)]]))
    return np.stack([ids[starts], counts], axis=1).astype(np.int64)

