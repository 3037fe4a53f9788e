"""Continuum as itself (``radixkv.scheduling.continuum``, ``radixkv.cache.eviction.continuum``): the
cost-benefit TTL over the tool's durations, program-level FCFS, the pin the eviction policy holds for the
TTL the schedule policy chose, in the simulator and the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from agent_helpers import learn_tool_pauses, ran, session_request, tool_loops

from radixkv import LLM, SamplingParams
from radixkv.cache.base import CacheHints
from radixkv.cache.radix import RadixCache
from radixkv.memory import SlotAllocator
from radixkv.scheduling import RequestState, Scheduler
from radixkv.scheduling import make_policy as make_schedule
from radixkv.scheduling.continuum import Continuum, continuum_ttl
from radixkv.scheduling.policies import Candidate
from radixkv.sim import simulate
from radixkv.stack import check_idle
from radixkv.workloads import agentic


def test_the_ttl_covers_the_returns_whose_saving_outweighs_the_memory_they_hold():
    durations = [1.0, 2.0, 3.0, 50.0, 60.0]
    assert continuum_ttl(durations, benefit=5.0, memory=0.0) == 60.0  # nobody waits: cover every return
    assert continuum_ttl([], benefit=5.0, memory=0.0) == 0.0 and continuum_ttl(durations, 0.0, 0.0) == 0.0
    ttls = [continuum_ttl(durations, benefit=5.0, memory=m) for m in (0.0, 0.01, 0.1, 1.0, 10.0)]
    assert ttls == sorted(ttls, reverse=True) and ttls[-1] == 0.0  # dearer memory, shorter pins, then none
    assert continuum_ttl(durations, benefit=5.0, memory=0.1) == 3.0  # the three short calls, not the long two
    # by brute force over every candidate: F(t) * benefit - memory * E[min(D, t)]
    d = np.array(durations)
    best = max((float(np.mean(d <= t)) * 5.0 - 0.1 * float(np.mean(np.minimum(d, t))), t) for t in d)
    assert continuum_ttl(durations, 5.0, 0.1) == best[1]


def _setup(capacity: int, clock: list[float]) -> tuple[Scheduler, Continuum]:
    policy = Continuum(reload_per_token=0.01, hold=5.0)
    cache = RadixCache(page_size=1, eviction_policy="continuum")
    sched = Scheduler(cache, SlotAllocator(capacity), policy, max_running=8)
    sched.clock = lambda: clock[0]
    cache.policy.sessions = sched.sessions  # as build_stack hands it over
    cache.clock = lambda: clock[0]
    return sched, policy


def _cand(state: RequestState) -> Candidate:
    return Candidate(state, np.asarray(state.prompt), None, state.rid)


def test_requests_are_ordered_by_their_programs_first_arrival():
    clock = [0.0]
    sched, policy = _setup(10_000, clock)
    a1, b1 = session_request(1, "A", 10), session_request(2, "B", 10)
    sched.add(a1)
    clock[0] = 1.0
    sched.add(b1)
    clock[0] = 2.0
    a2 = session_request(3, "A", 10)  # A's later request keeps A's place, ahead of B's earlier one
    sched.add(a2)
    assert [c.request.rid for c in policy.order([_cand(s) for s in (b1, a2)])] == [3, 2]


def test_a_tool_call_pins_its_context_for_the_chosen_ttl_then_lets_it_go():
    clock = [0.0]
    sched, policy = _setup(100, clock)
    cache = sched.cache
    learn_tool_pauses(sched, (1.0, 2.0, 3.0), first=100)  # the book learns three pauses after this kind of tool call
    a = session_request(1, "A", 40, stop="tool_use")
    ran(sched, a)
    entry = sched.sessions.awaited[("A", 0)]
    assert entry.pin == 3.0  # nobody waits: every return seen is covered
    assert cache.evictable_size == 40
    other = np.arange(5000, 5040)
    cache.insert(other, sched.allocator.alloc(40), hints=CacheHints(request=2))  # an unpinned path
    assert sorted(cache.evict(40).tolist()) != sorted(a.slots.tolist())  # the unpinned one goes first
    clock[0] = 3.5  # past the TTL: A's context is ranked with the rest again
    assert len(cache.evict(40)) == 40 and cache.evictable_size == 0
    cache.check_invariants()


def test_a_finish_with_requests_waiting_gets_a_shorter_pin():
    clock = [0.0]
    sched, policy = _setup(100, clock)
    learn_tool_pauses(sched, (1.0, 2.0, 30.0), first=100)
    a = session_request(1, "A", 40, stop="tool_use")
    calm = sched.sessions.finished(a.hints, 0.0, 40)
    assert policy.ttl(calm, 40) == 30.0
    for k in range(8):  # eight requests queued for memory
        sched.add(session_request(10 + k, f"w{k}", 50))
    assert policy.ttl(calm, 40) < 30.0


def test_continuum_serves_every_request_in_the_simulator_and_leaves_nothing_locked(tmp_path: Path):
    requests = agentic(tool_loops(tmp_path / "c.jsonl"), concurrency=3)
    res = simulate(requests, capacity_tokens=1200, page_size=64, schedule_policy="continuum",
                   eviction_policy="continuum")
    assert res.rejected == 0 and len(res.per_request) == len(requests)
    assert all(r["ttft"] >= 0 for r in res.per_request)


def test_continuum_runs_in_the_engine_with_the_same_greedy_tokens():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]]
    want = LLM("tiny-random", kv_cache_tokens=512, schedule_policy="fcfs").generate(prompts, SamplingParams(4))
    llm = LLM("tiny-random", kv_cache_tokens=512, schedule_policy="continuum", eviction_policy="continuum")
    got = llm.generate(prompts, [SamplingParams(4, session=s) for s in ("a", "a", "b")])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    check_idle(llm.cache, llm.allocator)


@pytest.mark.parametrize("bad", [0, -1.0, "x"])
def test_continuum_refuses_bad_parameters(bad):
    with pytest.raises(ValueError, match="reload_per_token"):
        Continuum(reload_per_token=bad)
    assert make_schedule("continuum").name == "continuum"
