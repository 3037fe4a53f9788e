"""The request record every workload produces and the simulator and engine consume."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from radixkv.checks import is_int, is_real


class BlockPrompt:
    """A prompt kept as runs of block ids and built into token ids on demand (``tokens``): a replay of a trace
    whose prompts are billions of tokens (``radixkv.workloads.agentic``) holds each prompt in a few numbers.

    Full block ``g`` holds the ``block`` token ids ``g * block + [0, block)``, so two prompts share exactly
    the blocks whose ids they share; the ``tail`` tokens after the last full block are ``tail_start + [0,
    tail)``, ids no other prompt holds (a partial block is never reused). ``runs``: ``[k, 2]`` int64 rows
    ``(first id, count)`` of consecutive ids. ``len`` is the prompt's length in tokens. O(k) memory.
    """

    __slots__ = ("runs", "block", "tail", "tail_start")

    def __init__(self, runs: np.ndarray, block: int, tail: int, tail_start: int):
        self.runs = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        self.block, self.tail, self.tail_start = int(block), int(tail), int(tail_start)

    def __len__(self) -> int:
        return int(self.runs[:, 1].sum()) * self.block + self.tail

    def block_ids(self) -> np.ndarray:
        """The full blocks' ids in order (int64). O(blocks)."""
        first, count = self.runs[:, 0], self.runs[:, 1]
        starts = np.repeat(first - np.cumsum(count) + count, count)  # each run's first id minus its offset
        return starts + np.arange(int(count.sum()), dtype=np.int64)

    def tokens(self) -> np.ndarray:
        """The prompt's token ids (int64), ``[len(self)]``. O(tokens)."""
        full = (self.block_ids()[:, None] * self.block + np.arange(self.block, dtype=np.int64)).ravel()
        return np.concatenate([full, np.arange(self.tail_start, self.tail_start + self.tail, dtype=np.int64)])

    def __repr__(self) -> str:
        return f"BlockPrompt({len(self.runs)} runs, {len(self)} tokens, block {self.block})"


@dataclass(eq=False)
class Request:
    """One request of a workload.

    Attributes:
        arrival: seconds from the start of the workload when it is sent (for a
            request with a ``parent`` or ``after``, the earliest time: it is
            sent ``think_time`` after the last of those finishes, if that is later).
        session: conversation / group id (for reporting and session affinity).
        prompt: int64 token ids, ``[prompt_len]``, or a ``BlockPrompt`` that builds them on demand
            (``tokens()`` gives the ids either way, ``prompt_len`` the length).
        output_len: tokens to generate.
        output: the ``[output_len]`` token ids a simulator treats as generated, so
            that a later turn whose prompt contains them is consistent; None
            where no later prompt depends on them.
        parent: ``rid`` of the request whose prompt + output this one extends
            (the previous turn of a chat, the parent thought of a tree).
        think_time: seconds between the parent (and every request of ``after``)
            finishing and this one being sent.
        namespace: cache namespace (adapter id, cache salt).
        rid: index of the request in its workload list.
        meta: free-form labels carried into the simulator's per-request rows
            (e.g. ``{"turn": 2}``).
        after: ``rid``s of other requests that must also have finished before
            this one is sent: a barrier, as when a client sends the next turn
            of every session together (the engine's ``generate`` per turn).
        priority: the request's priority for the cache (larger is kept longer by
            the ``priority`` eviction policy), an int; ``SamplingParams.priority``'s.
        ttl: seconds the cache should hold the prefix this request leaves once it
            finishes (the ``ttl`` eviction policy; None: the policy's default).
            ``priority`` and ``ttl`` reach the cache as its ``CacheHints``.
    """

    arrival: float
    session: Hashable
    prompt: np.ndarray | BlockPrompt
    output_len: int
    output: np.ndarray | None = None
    parent: int | None = None
    think_time: float = 0.0
    namespace: Hashable = None
    rid: int = -1
    meta: dict = field(default_factory=dict)
    after: tuple[int, ...] = ()
    priority: int = 0
    ttl: float | None = None

    def __post_init__(self) -> None:
        try:
            self.after = tuple(self.after)
        except TypeError:
            raise ValueError(f"after must be a tuple of request ids, got {self.after!r}") from None
        if not all(map(is_int, self.after)):
            raise ValueError(f"after must hold request ids (ints), got {self.after!r}")
        self.after = tuple(int(d) for d in self.after)
        checks = [(is_real(self.arrival) and self.arrival >= 0, "arrival", "a finite number >= 0"),
                  (is_int(self.output_len) and self.output_len >= 1, "output_len", "an integer >= 1"),
                  (is_real(self.think_time) and self.think_time >= 0, "think_time", "a finite number >= 0"),
                  (self.parent is None or is_int(self.parent), "parent", "None or a request id (int)"),
                  (is_int(self.rid), "rid", "an integer"),
                  (is_int(self.priority), "priority", "an integer"),
                  (self.ttl is None or (is_real(self.ttl) and self.ttl >= 0), "ttl", "None or a finite number >= 0")]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"invalid Request: {name} must be {what}, got {getattr(self, name)!r}")
        try:
            hash(self.namespace)
        except TypeError:
            raise ValueError(f"invalid Request: namespace must be hashable, got {self.namespace!r}") from None
        self.priority = int(self.priority)
        self.ttl = None if self.ttl is None else float(self.ttl)
        if not isinstance(self.prompt, BlockPrompt):
            self.prompt = _token_ids(self.prompt, "prompt")
        if self.output is not None:
            self.output = _token_ids(self.output, "output")
            if len(self.output) != self.output_len:
                raise ValueError(f"output has {len(self.output)} tokens but output_len is {self.output_len}")
        if len(self.prompt) == 0:
            raise ValueError("a request needs at least one prompt token")

    @property
    def prompt_len(self) -> int:
        """The prompt's length in tokens, whatever its representation."""
        return len(self.prompt)

    def tokens(self) -> np.ndarray:
        """The prompt's token ids (int64): ``prompt`` itself, or a ``BlockPrompt`` built now (not kept)."""
        return self.prompt.tokens() if isinstance(self.prompt, BlockPrompt) else self.prompt

    def __repr__(self) -> str:
        return (f"Request(rid={self.rid}, arrival={self.arrival:.3f}, session={self.session!r}, "
                f"prompt_len={self.prompt_len}, output_len={self.output_len}, parent={self.parent}"
                + (f", after={self.after})" if self.after else ")"))


def _token_ids(values: object, name: str) -> np.ndarray:
    """``values`` as int64 token ids; strings, bytes, sets, dicts and non-integers are a ``ValueError``."""
    arr = np.asarray(values) if not isinstance(values, str | bytes | set | frozenset | dict) else None
    if arr is None or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"invalid Request: {name} must be integer token ids, got {type(values).__name__}")
    return arr.astype(np.int64).reshape(-1)


class TokenSource:
    """Seeded source of fresh token spans.

    Without ``vocab_size`` ids are drawn from [0, 2**62), so two spans share a
    first token with probability about 2**-62: independent spans never share a
    prefix by accident. With ``vocab_size`` (to feed a real model) ids lie in
    [0, vocab_size) and accidental one-token overlaps happen, as in real text.
    """

    def __init__(self, seed: int, vocab_size: int | None = None):
        self.rng = np.random.default_rng(seed)
        self.high = vocab_size if vocab_size is not None else 2**62

    def span(self, n: int) -> np.ndarray:
        """``n`` fresh token ids (int64)."""
        return self.rng.integers(0, self.high, size=int(n), dtype=np.int64)

    def length(self, bounds: int | tuple[int, int]) -> int:
        """A length drawn uniformly from ``[lo, hi]`` (inclusive), or the fixed int given."""
        if isinstance(bounds, (int, np.integer)):
            return int(bounds)
        lo, hi = bounds
        return int(self.rng.integers(lo, hi + 1))


def number(requests: list[Request]) -> list[Request]:
    """Sort by arrival (stable) and set each request's ``rid`` to its index; ``parent`` and ``after`` are remapped.

    They name positions in ``requests``; one that names no position is a ``ValueError``.
    """
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    new_id = {old: new for new, old in enumerate(order)}
    for i, r in enumerate(requests):
        if any(d not in new_id for d in (*(() if r.parent is None else (r.parent,)), *r.after)):
            raise ValueError(f"request {i} links to parent {r.parent}, after {r.after}: not positions of the list")
    out = [requests[i] for i in order]
    for new, req in enumerate(out):
        req.rid = new
        req.parent = None if req.parent is None else new_id[req.parent]
        req.after = tuple(new_id[d] for d in req.after)
    return out
