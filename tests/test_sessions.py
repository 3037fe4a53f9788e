"""Agent sessions: the session hints (session, stream, and the stop reason known only at finish) in the simulator,
the engine and the server; the ``session`` schedule policy (sessions in service first, no new session past what
the device holds, bounded wait, never a stall); the ``session`` eviction policy (learned tool-call holds, cold
ends of turns); ``affinity`` keeping sessions (in the simulator and through the Ray fleet's call) and being the
default router."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from server_fixture import running_server
from test_agentic import rec, write

from radixkv import LLM, SamplingParams
from radixkv.cache.base import NO_HINTS, CacheHints
from radixkv.cache.radix import RadixCache
from radixkv.memory import SlotAllocator
from radixkv.routing import Affinity, ReplicaView
from radixkv.scheduling import RequestState, Scheduler
from radixkv.scheduling import make_policy as make_schedule
from radixkv.scheduling.policies import Candidate
from radixkv.scheduling.session import SessionAware
from radixkv.serving.protocol import ChatRequest
from radixkv.sessions import Finish, Sessions
from radixkv.sim import simulate, simulate_cluster
from radixkv.stack import check_idle
from radixkv.workloads import agentic


@pytest.fixture
def sessions(tmp_path: Path) -> Path:
    """Three sessions of tool loops, one ending its turn, one with a sub-agent."""
    rows = []
    for k, name in enumerate("ABC"):
        blocks = 4
        for i in range(6):
            stop = "end_turn" if (name == "A" and i == 3) else "tool_use"
            rows.append(rec(name, 20.0 * i + k, [[1, blocks]], stop=stop))
            blocks += 2
    rows.append(rec("C", 41.0, [[100, 3]], stream=1))
    return write(tmp_path / "s.jsonl", rows)


# ------------------------------------------------------------------ hints
def test_the_stop_reason_reaches_the_cache_only_when_the_request_finishes(sessions):
    seen: list[tuple[str, CacheHints]] = []

    class Spy(RadixCache):
        def match_prefix(self, tokens, namespace=None, hints=NO_HINTS):
            seen.append(("match", hints))
            return super().match_prefix(tokens, namespace, hints)

        def insert(self, tokens, indices, namespace=None, hints=NO_HINTS):
            seen.append(("insert", hints))
            return super().insert(tokens, indices, namespace, hints)

    simulate(agentic(sessions), cache=Spy(page_size=64), capacity_tokens=8192)
    assert all(h.stop is None for kind, h in seen if kind == "match")  # online: unknown before the answer
    finishes = {(h.session, h.stream, h.stop) for kind, h in seen if kind == "insert" and h.stop is not None}
    assert ("A", 0, "end_turn") in finishes and ("C", 1, "tool_use") in finishes
    assert all(h.session is not None for _, h in seen)


def test_sampling_params_carry_the_session_and_stream_and_refuse_bad_ones():
    assert SamplingParams(session="s", stream=2).cache_hints == CacheHints(session="s", stream=2)
    for bad in [dict(session=["unhashable"]), dict(stream=-1), dict(stream=1.5), dict(stream="main")]:
        with pytest.raises(ValueError, match="invalid SamplingParams"):
            SamplingParams(**bad)


def test_the_engine_adds_the_finish_reason_to_the_finish_s_hints():
    llm = LLM("tiny-random", kv_cache_tokens=1024, schedule_policy="session")
    stops = []
    insert = llm.cache.insert

    def logged(tokens, indices, namespace=None, hints=NO_HINTS):
        stops.append((hints.session, hints.stop))
        return insert(tokens, indices, namespace, hints)

    llm.cache.insert = logged
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3, ignore_eos=True, session="s1"))
    assert out[0].finish_reason == "length" and ("s1", "length") in stops
    check_idle(llm.cache, llm.allocator)


def test_the_server_takes_prompt_cache_key_and_cache_control_and_refuses_bad_hints_with_400():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    sp = ChatRequest(**body, prompt_cache_key="sess-1", cache_control={"type": "ephemeral", "ttl": "1h"}).sampling(4)
    assert (sp.session, sp.ttl) == ("sess-1", 3600.0)
    assert ChatRequest(**body, cache_control={"type": "ephemeral"}).sampling(4).ttl == 300.0  # Anthropic's 5 minutes
    assert ChatRequest(**body, cache_control={"ttl": 30}).sampling(4).ttl == 30.0
    args = ("tiny-random", "--kv-cache-tokens", "512", "--max-batch-tokens", "128", "--chunked-prefill-size", "64")
    with running_server(*args) as (base, _):
        tokens = {"prompt": [1, 2, 3], "max_tokens": 2}  # tiny-random has no chat template
        ok = httpx.post(f"{base}/v1/completions", json={**tokens, "prompt_cache_key": "a",
                                                         "cache_control": {"type": "ephemeral", "ttl": "5m"}})
        assert ok.status_code == 200, ok.text
        for bad in [{"prompt_cache_key": 7}, {"prompt_cache_key": ""}, {"cache_control": {"ttl": "forever"}},
                    {"cache_control": {"type": "persistent"}}, {"cache_control": {"ttl": -1}},
                    {"cache_control": {"ttl": True}}, {"cache_control": "5m"}, {"cache_control": {"tl": "5m"}},
                    {"cache_control": {"ttl": 10**400}}]:
            r = httpx.post(f"{base}/v1/completions", json={**tokens, **bad})
            assert r.status_code == 400, (bad, r.text)
            assert "error" in r.json() and r.json()["error"]["message"], r.text
        assert httpx.get(f"{base}/health").status_code == 200  # nothing crashed


# ------------------------------------------------------------------ the session schedule policy
class _State(RequestState):
    pass


def _scheduler(capacity: int, clock: list[float]) -> tuple[Scheduler, SessionAware]:
    policy = SessionAware(max_wait=30.0)
    cache = RadixCache(page_size=1)
    sched = Scheduler(cache, SlotAllocator(capacity), policy, max_running=8)
    sched.clock = lambda: clock[0]
    return sched, policy


def _cand(state: RequestState) -> Candidate:
    return Candidate(state, np.asarray(state.prompt), None, state.rid)


def _req(rid: int, session: str, n: int, stop: str | None = None) -> RequestState:
    return RequestState(rid, list(range(rid * 1000, rid * 1000 + n)), hints=CacheHints(session=session, stream=0,
                                                                                       stop=stop))


def test_sessions_in_service_go_first_and_no_new_session_starts_past_the_device():
    clock = [0.0]
    sched, policy = _scheduler(1000, clock)
    a = _req(1, "A", 500)
    sched.add(a)
    sched.running.append(a)  # A runs, holding 500 slots
    a.slots = np.arange(500)
    sched.waiting.remove(a)
    b, c, a2 = _req(2, "B", 400), _req(3, "C", 400), _req(4, "A", 600)
    for s in (b, c, a2):
        sched.add(s)
    order = [x.request.rid for x in policy.order([_cand(s) for s in (b, c, a2)])]
    assert order == [4, 2]  # A's next request first (in service), then B fits beside A; C does not
    # after a tool call A stays in service for its hold; after the end of a turn it leaves
    a.hints = a.hints._replace(stop="tool_use")
    sched.running.remove(a)
    sched.sessions.finished(a.hints, clock[0], 520)  # as the scheduler's finish tells it
    policy.finished(a, 520)
    assert [x.request.rid for x in policy.order([_cand(s) for s in (b, c)])] == [2]
    clock[0] = 31.0  # both waited past max_wait: they go whatever the holds (soft), oldest session first
    assert [x.request.rid for x in policy.order([_cand(s) for s in (b, c)])] == [2, 3]


def test_an_aged_request_goes_before_sessions_in_service_so_none_starves():
    """A session in service that sends call after call never keeps another session's request waiting past
    ``max_wait``: the aged request is then offered alone, ahead of the session's next call."""
    clock = [0.0]
    sched, policy = _scheduler(1000, clock)
    x = _req(1, "X", 500)
    sched.add(x)
    a = _req(2, "A", 600, stop="tool_use")
    sched.add(a)
    sched.waiting.remove(a)
    sched.sessions.finished(a.hints, clock[0], 600)  # as the scheduler's finish tells it
    policy.finished(a, 600)  # A is in a tool call, holding 600 of 1,000: X (500) does not fit beside it
    clock[0] = 20.0
    a2 = _req(3, "A", 610)  # A's next call, after its tool ran
    sched.add(a2)
    assert [c.request.rid for c in policy.order([_cand(x), _cand(a2)])] == [3]
    clock[0] = 30.0  # X has waited max_wait; A's call has not
    assert [c.request.rid for c in policy.order([_cand(x), _cand(a2)])] == [1]


def test_the_session_policy_s_books_stay_the_size_of_its_queue():
    """Requests aborted while waiting leave nothing behind; a request of no session orders by its arrival."""
    clock = [0.0]
    sched, policy = _scheduler(1000, clock)
    for rid in range(50):
        sched.add(RequestState(rid, [1, 2, 3]))
    for s in list(sched.waiting):
        sched.abort(s)
    sched.add(_req(99, "S", 10))
    policy.order([_cand(s) for s in sched.waiting])
    assert set(policy.since) == {99} and set(policy.started) == {"S"}


def test_in_batch_sharing_does_not_admit_what_the_session_policy_left_out():
    """The engine's default wraps the policy in in-batch sharing, which lends a running prefill's slots to
    requests it held back; a request the session policy left out (no room beside the sessions in service)
    is not one of them."""
    llm = LLM("tiny-random", kv_cache_tokens=256, page_size=1, schedule_policy="session", max_batch_tokens=64,
              chunked_prefill_size=64)
    sched = llm.scheduler
    # a session in a tool pause holds 230 of 256; its learned hold (200 s) outlasts the test
    sched.sessions.finished(CacheHints(session="H", stream=0, stop=Finish.TOOL_CALL), sched.clock(), 230)
    sched.sessions.pauses.observe((False, Finish.TOOL_CALL, None), 100.0)
    shared = list(range(1, 41))  # A's prefill computes it all this step: B could borrow its slots
    a = RequestState(1, shared + [200], hints=CacheHints(session="H", stream=0))
    b = RequestState(2, shared + [201], hints=CacheHints(session="B", stream=0))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.rid for s in sched.running] == [1] and [s.rid for s in sched.waiting] == [2], batch


def test_nothing_running_means_the_oldest_waiting_request_is_offered():
    clock = [0.0]
    sched, policy = _scheduler(1000, clock)
    big = _req(1, "B", 900)
    sched.add(big)
    # a session in a tool pause holds the device
    sched.sessions.finished(CacheHints(session="X", stream=0, stop=Finish.TOOL_CALL), 0.0, 900)
    assert [c.request.rid for c in policy.order([_cand(big)])] == [1]  # the queue never stalls for a hold


def test_the_session_policy_serves_every_request_without_a_stall(sessions):
    res = simulate(agentic(sessions, concurrency=3), capacity_tokens=1200, page_size=64, schedule_policy="session")
    assert res.rejected == 0 and len(res.per_request) == len(agentic(sessions))
    assert all(r["ttft"] >= 0 for r in res.per_request)


def test_the_session_oracle_holds_exactly_the_real_pause_and_runs_only_in_the_simulator(sessions):
    """``session-oracle`` keeps a session in service after a tool call for exactly the pause before its next
    request (known from the workload), and nowhere but the simulator, which hands it the future."""
    requests = agentic(sessions, concurrency=3)
    res = simulate(requests, capacity_tokens=1200, page_size=64, schedule_policy="session-oracle")
    assert res.rejected == 0 and len(res.per_request) == len(requests)
    oracle = make_schedule("session-oracle")
    oracle.foresee(requests)
    clock = [0.0]
    oracle.attach(type("S", (), {"clock": lambda self: clock[0], "sessions": Sessions()})())
    first = next(r for r in requests if r.parent is None and any(c.parent == r.rid for c in requests))
    pause = next(c.think_time for c in requests if c.parent == first.rid)
    state = RequestState(first.rid, [1, 2], hints=CacheHints(session=first.session, stream=0, stop="tool_use"))
    held = oracle.sessions.finished(state.hints, 0.0, 2)
    oracle.finished(state, 2)
    assert not oracle._lapsed((first.session, 0), held, pause)
    assert oracle._lapsed((first.session, 0), held, pause + 1e-6)
    with pytest.raises(ValueError, match="session-oracle.*simulator"):
        LLM("tiny-random", kv_cache_tokens=512, schedule_policy="session-oracle")
    with pytest.raises(ValueError, match="future"):
        make_schedule("session-oracle").order([])


def test_the_session_policy_runs_in_the_engine_with_the_same_greedy_tokens():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]]
    want = LLM("tiny-random", kv_cache_tokens=512, schedule_policy="fcfs").generate(prompts, SamplingParams(4))
    llm = LLM("tiny-random", kv_cache_tokens=512, schedule_policy="session")
    got = llm.generate(prompts, [SamplingParams(4, session=s) for s in ("a", "a", "b")])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    check_idle(llm.cache, llm.allocator)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "60", True])
def test_the_session_policy_refuses_bad_parameters(bad):
    with pytest.raises(ValueError, match="max_wait"):
        SessionAware(max_wait=bad)


def test_make_policy_knows_session():
    assert make_schedule("session").name == "session" and make_schedule("session").follows_sessions


# ------------------------------------------------------------------ the session eviction policy
def test_retention_learns_the_tool_pause_and_ranks_cold_turns_first():
    clock = [0.0]
    cache = RadixCache(page_size=1, eviction_policy="session")
    cache.clock = lambda: clock[0]
    policy = cache.policy
    tool = CacheHints(request=1, session="A", stream=0, stop="tool_use")
    cache.insert(np.arange(10), np.arange(10), hints=tool)  # A's answer ended in a tool call: held
    cold = CacheHints(request=2, session="B", stream=0, stop="end_turn")
    cache.insert(np.arange(100, 110), np.arange(10, 20), hints=cold)  # B's turn ended: cold
    cache.insert(np.arange(200, 210), np.arange(20, 30), hints=CacheHints(request=3))  # unheld
    assert sorted(cache.evict(10).tolist()) == list(range(10, 20))  # cold first
    assert sorted(cache.evict(10).tolist()) == list(range(20, 30))  # then unheld
    policy.sessions.finished(tool, 0.0)  # the scheduler tells its book (here the cache's own)
    clock[0] = 4.0
    policy.sessions.returned(CacheHints(request=4, session="A", stream=0), clock[0])  # A came back after 4 s
    cache.match_prefix(np.arange(10), hints=CacheHints(request=4, session="A", stream=0))
    assert policy.hold_for(False) == pytest.approx(2 * 4.0) and policy.hold_for(True) == policy.hold_s
    assert sorted(cache.evict(10).tolist()) == list(range(10))  # a hold yields when nothing else can go
    cache.check_invariants()


def test_held_paths_yield_to_an_admission_in_the_engine_and_nothing_stalls():
    """Holds are soft: a pool full of tool-call holds still admits a prompt that needs all of it (the engine's
    stall detection would raise ``EngineStalledError`` otherwise), and the holds it evicted leave no slot behind."""
    llm = LLM("tiny-random", kv_cache_tokens=256, eviction_policy="session", page_size=1)
    held = CacheHints(request=1, session="A", stream=0, stop="tool_use")
    for k in range(4):  # four sessions in a tool call: 240 of 256 slots held
        tokens = np.arange(1000 * (k + 1), 1000 * (k + 1) + 60)
        llm.cache.insert(tokens, llm.allocator.alloc(60), hints=held._replace(session=k))
    assert llm.cache.evictable_size == 240
    out = llm.generate([list(range(1, 201))], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    check_idle(llm.cache, llm.allocator)


def test_learned_classes_what_a_finish_adds_by_stop_reason_depth_and_length():
    """``learned`` is fed the stop reason: what a request adds at its finish is in a class per stop reason x
    depth x context length; without a stop hint it is the request's tail, as before."""
    from radixkv.cache.eviction.learned import TAIL

    def finish(stop, n=40_000):
        cache = RadixCache(page_size=1, eviction_policy="learned")
        prompt = CacheHints(request=1, session="A", stream=0)
        cache.insert(np.arange(n), np.arange(n), hints=prompt)  # the prefill
        cache.insert(np.arange(n + 10), np.arange(n + 10), hints=prompt._replace(stop=stop))  # + the answer
        cache.check_invariants()
        return cache.match_prefix(np.arange(n + 10)).node.state.cls

    classes = {stop: finish(stop) for stop in ("tool_use", "end_turn", "length", None)}
    assert classes[None] == TAIL and len(set(classes.values())) == 4
    assert finish("tool_use", n=100) != classes["tool_use"]  # a short context is a class of its own


# ------------------------------------------------------------------ routing
def _views(n: int) -> list[ReplicaView]:
    return [ReplicaView(i) for i in range(n)]


def test_affinity_keeps_a_session_on_its_replica_until_that_replica_is_past_its_cliff():
    router = Affinity(capacity_tokens=1000, slack=0.0)
    home = router.route(np.arange(100), _views(2), session="s", now=0.0)
    # a prompt with no prefix anywhere would go to the replica with least work; the session keeps it home
    assert router.route(np.arange(5000, 5100), _views(2), session="s", now=1.0) == home
    assert router.counts["session"] == 1
    big = router.route(np.arange(9000, 10200), _views(2), session="big", now=2.0)  # 1,200 tokens > 1,000
    assert big != home
    router.route(np.arange(9000, 10300), _views(2), session="big", now=3.0)
    assert router.counts["session"] == 1  # its replica is past its cliff: the usual rules decided
    router.route(np.arange(40000, 40010), _views(2), session="late", now=10_000.0)
    assert router.sessions.homes.placed == {"late"}  # idle sessions leave after session_window seconds


def test_the_cluster_simulator_routes_by_session_with_affinity_by_default(sessions):
    res = simulate_cluster(agentic(sessions), replicas=2, capacity_tokens=4096, page_size=64, references=False)
    assert res.config["router"] == "affinity"
    where: dict[str, set[int]] = {}
    for i, rep in enumerate(res.replicas):
        for row in rep.per_request:
            where.setdefault(row["session"], set()).add(i)
    assert all(len(v) == 1 for v in where.values())  # each session stayed on one replica


def test_the_fleet_passes_the_session_hint_to_a_router_that_follows_sessions():
    from radixkv.cluster.fleet import Fleet

    class Spy(Affinity):
        def route(self, tokens, replicas, namespace=None, now=0.0, session=None):
            self.seen = session
            return 0

    from radixkv.routing.base import LoadTracker

    fleet = Fleet.__new__(Fleet)  # the routing half only: no actor is started
    fleet.router, fleet.tracker, fleet.decisions, fleet.kv_used = Spy(), LoadTracker(1), [], [0.0]
    fleet.actors, fleet.started = [None], 0.0
    assert fleet.route("r1", [1, 2, 3], SamplingParams(session="s9")) == 0 and fleet.router.seen == "s9"
