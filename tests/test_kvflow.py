"""KVFlow as itself (``radixkv.cache.eviction.kvflow``): the path next due latest goes first, a shared prefix is
due with the nearest of its streams, what says nothing of a return goes before all; beside the prefetch in the
simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from agent_helpers import tool_loops

from radixkv.cache.base import CacheHints
from radixkv.cache.radix import RadixCache
from radixkv.sim import simulate
from radixkv.workloads import agentic


def _cache(clock: list[float]) -> RadixCache:
    cache = RadixCache(page_size=1, eviction_policy="kvflow")
    cache.clock = lambda: clock[0]
    book = cache.policy.sessions
    for session, stop, pause in (("x", "tool_use", 2.0), ("y", "end_turn", 300.0)):  # pauses seen of each kind
        hints = CacheHints(session=session, stream=0, stop=stop)
        book.finished(hints, 0.0)
        book.returned(hints._replace(stop=None), pause)
    return cache


def test_the_path_next_due_latest_goes_first_and_the_never_due_before_all():
    clock = [0.0]
    cache = _cache(clock)
    tool = CacheHints(request=1, session="A", stream=0, stop="tool_use")  # back in about 2 s
    human = CacheHints(request=2, session="B", stream=0, stop="end_turn")  # back in about 5 minutes
    cache.insert(np.arange(10), np.arange(10), hints=tool)
    cache.insert(np.arange(100, 110), np.arange(10, 20), hints=human)
    cache.insert(np.arange(200, 210), np.arange(20, 30), hints=CacheHints(request=3, stop="length"))
    assert sorted(cache.evict(10).tolist()) == list(range(20, 30))  # no sign of a return
    assert sorted(cache.evict(10).tolist()) == list(range(10, 20))  # the human's turn: due latest
    assert sorted(cache.evict(10).tolist()) == list(range(10))
    cache.check_invariants()


def test_a_shared_prefix_is_due_with_the_nearest_of_its_streams():
    clock = [0.0]
    cache = _cache(clock)
    shared = np.arange(10)
    cache.insert(np.concatenate([shared, [50, 51]]), np.arange(12),
                 hints=CacheHints(request=1, session="B", stream=0, stop="end_turn"))
    cache.insert(np.concatenate([shared, [60, 61]]), np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13]),
                 hints=CacheHints(request=2, session="A", stream=0, stop="tool_use"))
    node = cache.match_prefix(shared).node
    assert node.state <= clock[0] + 2.0 + 1e-9  # the shared part is due with A, the nearer
    assert sorted(cache.evict(2).tolist()) == [10, 11]  # B's own tail first (due latest)
    cache.check_invariants()


def test_kvflow_with_its_prefetch_serves_every_request_in_the_simulator(tmp_path: Path):
    requests = agentic(tool_loops(tmp_path / "k.jsonl"), concurrency=3)
    for host in (None, 1200):
        res = simulate(requests, capacity_tokens=1200, page_size=64, eviction_policy="kvflow",
                       host_capacity_tokens=host, prefetch=host is not None)
        assert res.rejected == 0 and len(res.per_request) == len(requests)
