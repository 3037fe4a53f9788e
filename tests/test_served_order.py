"""Belady on the order the scheduler serves (``radixkv.sim.served``; ``FutureUses(order=...)``): the
clairvoyant ranking follows the order given, and the iteration stops at a replay that serves the order it
was ranked by, or says it did not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from agent_helpers import tool_loops

from radixkv.cache.future import FutureUses
from radixkv.cache.radix import _ITEM
from radixkv.sim.served import belady_on_served_order, served_order
from radixkv.workloads import agentic


def test_the_future_ranks_uses_in_the_order_they_will_be_served():
    a, b = np.array([1, 2, 3]), np.array([7, 8, 9])
    prefixes = [(a, None), (b, None), (a, None)]
    arrival = FutureUses(prefixes)
    key_a = a[:1].astype(np.int64).tobytes()
    assert _ITEM == 8 and arrival.next_use(key_a, None) == 0
    served = FutureUses(prefixes, order=[1, 2, 0])  # b first, then the second a, then the first
    assert served.next_use(key_a, None) == 1  # the second a is served at rank 1
    served.served(2)
    assert served.next_use(key_a, None) == 2
    served.served(0)
    assert served.next_use(key_a, None) == float("inf")
    with pytest.raises(ValueError, match="indices once"):
        FutureUses(prefixes, order=[0, 0, 1])


def test_belady_is_iterated_to_the_order_it_serves_or_says_it_was_not(tmp_path: Path):
    requests = agentic(tool_loops(tmp_path / "b.jsonl", "ABCD", turns=4, apart=10.0, spread=50), concurrency=4)
    for schedule in ("fcfs", "session-oracle"):
        res, info = belady_on_served_order(requests, page_size=64, capacity_tokens=900, schedule_policy=schedule,
                                           rounds=3)
        assert len(res.per_request) == len(requests) and 1 <= info["rounds"] <= 3
        assert info["fixed_point"] or info["rounds"] == 3
        order = served_order(res, len(requests))
        assert sorted(order) == list(range(len(requests)))
    with pytest.raises(ValueError, match="rounds"):
        belady_on_served_order(requests, rounds=0)
