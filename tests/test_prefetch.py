"""KVFlow's prefetch for agent sessions (``radixkv.scheduling.prefetch``): the pause predicted from the pauses
seen, a context loaded back from the host tier before its session returns, and the prefetch staying soft
(never while a request waits, never evicting, never counted as the session's return)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from radixkv import LLM, SamplingParams
from radixkv.cache.base import CacheHints
from radixkv.cache.radix import RadixCache
from radixkv.cache.tiered import Tier, TieredCache
from radixkv.memory import SlotAllocator
from radixkv.scheduling import RequestState, Scheduler, make_policy
from radixkv.scheduling.prefetch import Prefetcher
from radixkv.sessions import Finish
from radixkv.sim import simulate, simulate_cluster
from radixkv.stack import StackConfig, check_idle
from radixkv.workloads.request import Request

TOOL = CacheHints(session="A", stream=0, stop="tool_use")


def _finished(p: Prefetcher, tokens: np.ndarray, hints: CacheHints, now: float) -> None:
    """What the scheduler does at a finish: tell the sessions' book, then the prefetcher of the stream awaited."""
    awaited = p.sessions.finished(hints, now, len(tokens))
    if awaited is not None:
        p.finished(awaited, tokens, None)


MAIN_TOOL, SUB_TOOL, MAIN_TURN = ((sub, finish, None) for sub, finish in (
    (False, Finish.TOOL_CALL), (True, Finish.TOOL_CALL), (False, Finish.END_TURN)))


def test_the_predicted_pause_is_the_geometric_mean_of_those_seen_per_kind_of_finish():
    p = Prefetcher(lead=lambda tokens: tokens / 100)
    tokens = np.arange(50)
    _finished(p, tokens, TOOL, now=0.0)
    assert p.predicted_pause(MAIN_TOOL) is None and p.next_due() == math.inf  # nothing seen: no guess
    p.sessions.returned(TOOL._replace(stop=None), now=1.0)  # back after 1 s
    _finished(p, tokens, TOOL, now=2.0)
    p.sessions.returned(TOOL._replace(stop=None), now=102.0)  # back after 100 s
    assert p.predicted_pause(MAIN_TOOL) == pytest.approx(10.0)
    assert p.predicted_pause(SUB_TOOL) is None and p.predicted_pause(MAIN_TURN) is None
    _finished(p, tokens, TOOL, now=200.0)
    assert p.next_due() == pytest.approx(200.0 + 10.0 - 0.5)  # the load's lead: 50 tokens at 100 a second
    assert p.due(209.0) == [] and [hints.session for _, _, hints in p.due(209.5)] == ["A"]
    assert p.due(1e9) == [] and p.next_due() == math.inf  # handed out once


def test_only_sessions_that_end_in_a_tool_call_or_a_turn_are_expected_back():
    p = Prefetcher()
    _finished(p, np.arange(5), CacheHints(stop="tool_use"), now=0.0)  # no session: nothing to wait for
    _finished(p, np.arange(5), CacheHints(session="B", stop="length"), now=0.0)
    assert p.sessions.awaited == {}
    _finished(p, np.arange(5), CacheHints(session="B", stream=1, stop="end_turn"), now=0.0)
    _finished(p, np.arange(5), CacheHints(session="B", stream=1, stop="stop_sequence"), now=1.0)  # no return
    assert p.sessions.awaited == {}


# ------------------------------------------------------------------ the scheduler's prefetch
def _stack(device: int, host: int, clock: list[float]) -> Scheduler:
    cache = TieredCache(RadixCache(page_size=1), [Tier("host", RadixCache(page_size=1), SlotAllocator(host))],
                        "write_back")
    sched = Scheduler(cache, SlotAllocator(device), make_policy("fcfs"), max_running=8)
    sched.clock = lambda: clock[0]
    sched.prefetcher = Prefetcher(sessions=sched.sessions)
    return sched


def _serve(sched: Scheduler, state: RequestState, stop: str) -> None:
    sched.add(state)
    batch = sched.schedule()
    sched.commit(batch)
    state.hints = state.hints._replace(stop=stop)
    sched.finish(state, state.prompt)


def _context(n: int) -> list[int]:
    return list(range(1000, 1000 + n))


def _looped(clock: list[float]) -> Scheduler:
    """A scheduler (100 device, 200 host slots) after session A's two tool calls, 4 s apart: its 60-token
    context is due back 4 s after the second finish (at about 8 s), and worth loading until about 12 s."""
    sched = _stack(100, 200, clock)
    _serve(sched, RequestState(1, _context(40), hints=TOOL), "tool_use")
    clock[0] = 4.0
    _serve(sched, RequestState(2, _context(60), hints=TOOL), "tool_use")
    return sched


def test_a_context_written_back_is_loaded_back_before_its_session_returns():
    clock = [0.0]
    sched = _looped(clock)
    sched.allocator.free(sched.cache.evict(100))  # pressure: the whole context goes to the host tier
    assert sched.cache.device.total_size == 0 and sched.cache.tiers[0].cache.total_size == 60
    clock[0] = 7.0
    assert sched.prefetch() == 0  # due 4 s after its finish, not yet
    clock[0] = 8.0
    other = RequestState(3, list(range(5000, 5010)))
    sched.add(other)
    assert sched.prefetch() == 0  # a request waits: no prefetch takes its memory
    sched.withdraw({3})
    assert sched.prefetch() == 60  # the context, back on the device before its session
    assert sched.cache.device.match_prefix(_context(60)).length == 60
    check_idle(sched.cache, sched.allocator)
    clock[0] = 9.0
    back = RequestState(4, _context(70), hints=TOOL._replace(stop=None))
    sched.add(back)
    sched.schedule()
    assert back.hit_by_tier == {"device": 60}  # all of it found on the device, nothing loaded at admission


def test_a_prefetch_never_evicts_and_is_not_taken_for_the_session_s_return():
    clock = [0.0]
    sched = _looped(clock)
    sched.allocator.free(sched.cache.evict(100))
    filler = sched.allocator.alloc(50)  # 50 slots left free: fewer than the 60 to load
    sched.cache.insert(np.arange(50), filler)
    clock[0] = 9.0
    assert sched.prefetch() == 0 and sched.cache.device.total_size == 50  # nothing evicted for it
    assert sched.prefetcher.prefetched == 1 and sched.prefetcher.due(1e9) == []  # handed out once, not loaded
    assert sched.sessions.awaited[("A", 0)].back is None  # still waiting for the session's own return to learn from
    sched.cache.check_invariants()


def test_a_prefetch_of_a_context_the_device_holds_looks_nothing_up():
    """Nothing to load: the cache is not touched (no lookup counted, no recency or hit count moved)."""
    clock = [0.0]
    sched = _looped(clock)
    before = (sched.cache.stats(), sched.cache.device.to_dict())
    clock[0] = 9.0
    assert sched.prefetch() == 0 and sched.prefetcher.prefetched == 1  # due, handed out, nothing to do
    assert (sched.cache.stats(), sched.cache.device.to_dict()) == before


# ------------------------------------------------------------------ the simulator and the engine
def _loop_and_crowd(pauses=(28.0, 28.0, 28.0), c_prompt: int = 1500, c_output: int = 16) -> list[Request]:
    """Session A in a tool loop (28 s pauses); B's long prompt pushes A's context down to the host tier while
    A waits for its tool, and C's evicts B's (a turn's end goes first), leaving room before A returns."""
    reqs, prompt = [], np.arange(1000, 1768)
    for i, pause in enumerate((0.0, *pauses)):
        out = np.arange(-100 * (i + 1), -100 * (i + 1) - 16, -1)
        reqs.append(Request(0.0, "A", prompt, 16, output=out, parent=i - 1 if i else None, think_time=pause,
                            meta={"stream": 0, "stop": "tool_use"}))
        prompt = np.concatenate([prompt, out, np.arange(5000 + 64 * i, 5064 + 64 * i)])
    reqs.append(Request(35.0, "B", np.arange(20000, 22300), 16, meta={"stream": 0, "stop": "end_turn"}))
    reqs.append(Request(45.0, "C", np.arange(30000, 30000 + c_prompt), c_output,
                        meta={"stream": 0, "stop": "end_turn"}))
    return reqs


TIERED = dict(capacity_tokens=3072, host_capacity_tokens=8192, page_size=64, write_policy="write_back",
              schedule_policy="session", eviction_policy="session")


def test_the_simulator_prefetches_a_context_the_host_took_before_its_session_returns():
    plain, fetched = (simulate(_loop_and_crowd(), prefetch=p, **TIERED) for p in (False, True))
    assert plain.prefetched_tokens == 0 and plain.summary()["prefetch_seconds"] == 0.0
    assert plain.per_request[2]["hit_by_tier"] == {"device": 0, "host": 832}  # A's third request loads
    assert fetched.per_request[2]["hit_by_tier"] == {"device": 832}  # prefetched while the replica was idle
    assert fetched.prefetched_tokens == 832 and fetched.prefetch_seconds > 0
    assert fetched.per_request[2]["ttft"] < plain.per_request[2]["ttft"]  # its load was off its path
    assert fetched.hit_rate == plain.hit_rate and fetched.config["prefetch"] is True
    assert fetched.config["prefetcher"]["pause_tool_use_main"] == pytest.approx(28.0, rel=0.05)


def test_a_prefetch_during_a_decode_stride_loads_when_due_and_costs_its_copy_once():
    """C decodes 1,500 tokens alone (one stride of steps) while A's context falls due: the stride stops there,
    the copy is charged to that one step (not to every step of the stride), and A comes back to a device hit."""
    reqs = _loop_and_crowd(pauses=(28.0, 100.0, 28.0), c_prompt=100, c_output=1500)
    plain, fetched = (simulate(reqs, prefetch=p, **TIERED) for p in (False, True))
    assert fetched.prefetched_tokens == 832 and fetched.per_request[2]["hit_by_tier"] == {"device": 832}
    c_plain, c_fetched = plain.per_request[5], fetched.per_request[5]
    assert c_fetched["finish"] - c_plain["finish"] == pytest.approx(fetched.prefetch_seconds, rel=1e-6)


def test_a_context_long_overdue_is_dropped_and_no_tokens_are_kept_before_a_pause_is_known():
    p = Prefetcher()
    _finished(p, np.arange(50), TOOL, now=0.0)
    assert p.sessions.awaited[("A", 0)].tokens is None  # nothing will prefetch it: nothing held
    p.sessions.returned(TOOL._replace(stop=None), now=10.0)
    _finished(p, np.arange(50), TOOL, now=20.0)  # due at 30, worth it until 40
    assert p.due(41.0) == [] and p.next_due() == math.inf and p.prefetched == 0


def test_a_cluster_prefetches_and_its_pooled_references_run_without_tiers():
    """``simulate_cluster(prefetch=True)`` prefetches as ``simulate`` does, and its pooled references (one tier,
    nothing below it) run without the prefetch (regression: they refused the setting)."""
    res = simulate_cluster(_loop_and_crowd(), replicas=1, **TIERED, prefetch=True)
    assert res.replicas[0].prefetched_tokens == 832
    assert res.hit_rate <= res.references["pooled_lru"] <= res.references["upper_bound"] + 1e-12


def test_prefetch_needs_a_lower_tier():
    with pytest.raises(ValueError, match="prefetch loads from a host"):
        StackConfig(prefetch=True)
    with pytest.raises(ValueError, match="prefetch loads from a host"):
        LLM("tiny-random", kv_cache_tokens=512, prefetch=True)


def test_the_engine_prefetches_the_kv_back_exactly():
    """The engine's step runs a due prefetch through its mover: the context it copied back from the host
    tier is the device's again, and the next request reading it generates what a fresh engine does. The
    prefetch comes from the engine's own finishes (the requests say how their answers end), nothing by hand."""
    llm = LLM("tiny-random", kv_cache_tokens=512, host_kv_cache_tokens=1024, write_policy="write_back",
              prefetch=True)
    clock = [0.0]
    llm.scheduler.clock = lambda: clock[0]
    tool = SamplingParams(4, session="s", stream=0, finish=Finish.TOOL_CALL)
    prompt = list(range(1, 201))
    first = llm.generate([prompt], tool)[0]  # a tool call at 0 s ...
    clock[0] = 10.0  # ... back 10 s later: the pause learned, and another tool call
    prompt = prompt + first.token_ids + [5, 6]
    second = llm.generate([prompt], tool)[0]
    context = np.array(prompt + second.token_ids[:-1])
    llm.allocator.free(llm.cache.evict(llm.cache.evictable_size))  # the device drops it: the host keeps it
    assert llm.cache.device.total_size == 0 and llm.cache.tiers[0].cache.total_size >= len(context)
    clock[0] = 20.0  # due now (its load's lead before the predicted return)
    assert llm.step() == [] and llm.cache.device.held_length(context) == len(context)
    assert llm.scheduler.prefetcher.prefetched == 1
    check_idle(llm.cache, llm.allocator)
    follow = list(context) + [7, 8, 9]
    got = llm.generate([follow], SamplingParams(4, session="s"))[0]
    want = LLM("tiny-random", kv_cache_tokens=512).generate([follow], SamplingParams(4))[0]
    assert got.num_cached_tokens == len(context) and got.token_ids == want.token_ids
