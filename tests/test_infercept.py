"""InferCept as itself (``radixkv.scheduling.infercept``, ``radixkv.cache.eviction.infercept``): at each tool
call the action of least waste (preserve, discard, swap over a host tier), the path held or sent first as
decided, in the simulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from agent_helpers import learn_tool_pauses, ran, session_request, tool_loops

from radixkv.cache.base import CacheHints
from radixkv.cache.radix import RadixCache
from radixkv.memory import SlotAllocator
from radixkv.scheduling import Scheduler
from radixkv.scheduling.infercept import InferCept, min_waste
from radixkv.sim import simulate
from radixkv.workloads import agentic


def test_the_action_of_least_waste_is_chosen_and_swap_only_over_a_host_tier():
    action, waste = min_waste(1000, 2.0, 3000, reload_per_token=1e-3, swap_per_token=1e-5)
    assert waste == {"preserve": 2000.0, "discard": 4000.0, "swap": pytest.approx(80.0)} and action == "swap"
    assert min_waste(1000, 2.0, 3000, reload_per_token=1e-3, swap_per_token=None)[0] == "preserve"
    # a busier batch makes recomputing dearer, a longer interception makes preserving dearer
    assert min_waste(1000, 30.0, 0, 1e-3, None)[0] == "discard"
    assert min_waste(1000, 30.0, 100_000, 1e-3, None)[0] == "preserve"


def test_a_tool_call_is_preserved_or_sent_first_as_decided():
    clock = [0.0]
    policy = InferCept(reload_per_token=1.0, hold=5.0)  # 40 tokens: 40 s to recompute
    cache = RadixCache(page_size=1, eviction_policy="infercept")
    sched = Scheduler(cache, SlotAllocator(200), policy, max_running=8)
    sched.clock = cache.clock = lambda: clock[0]
    cache.policy.sessions = sched.sessions
    learn_tool_pauses(sched, (0.5, 0.5), first=100)  # short tool calls seen: preserving is cheap
    a = session_request(1, "A", 40, stop="tool_use")
    ran(sched, a)
    assert sched.sessions.awaited[("A", 0)].pin == pytest.approx(0.5) and policy.chosen["preserve"] == 1
    cache.insert(np.arange(5000, 5040), sched.allocator.alloc(40), hints=CacheHints(request=2))
    first = sorted(cache.evict(40).tolist())
    assert first != sorted(a.slots.tolist())  # the preserved context outlasts an unheld one
    learn_tool_pauses(sched, (1e6, 1e6), first=200)  # now the tool's calls take days: recompute beats holding
    b = session_request(3, "B", 40, stop="tool_use")
    ran(sched, b)
    assert sched.sessions.awaited[("B", 0)].pin == -1.0 and policy.chosen["discard"] == 1
    assert sorted(cache.evict(40).tolist()) == sorted(b.slots.tolist())  # discarded: first to go
    cache.check_invariants()


def test_infercept_serves_every_request_in_the_simulator_with_and_without_a_host_tier(tmp_path: Path):
    requests = agentic(tool_loops(tmp_path / "i.jsonl", spread=40), concurrency=3)
    for host in (None, 1200):
        res = simulate(requests, capacity_tokens=1200, page_size=64, schedule_policy="infercept",
                       eviction_policy="infercept", host_capacity_tokens=host)
        assert res.rejected == 0 and len(res.per_request) == len(requests)


@pytest.mark.parametrize("bad", [0, -1.0, "x", True])
def test_infercept_refuses_bad_parameters(bad):
    with pytest.raises(ValueError, match="reload_per_token"):
        InferCept(reload_per_token=bad)
