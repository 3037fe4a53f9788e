"""A request's priority and hold time (``SamplingParams`` / ``Request``: ``priority``, ``ttl``) reach the cache as
its ``CacheHints`` with every call made for it: the scheduler's matches, the commits and the release, in the
simulator and in the engine; the server takes ``priority`` (vLLM's extra) and refuses a malformed one; the
simulator's cache reads simulated seconds through its ``clock``."""

from __future__ import annotations

import math
from fractions import Fraction

import httpx
import numpy as np
import pytest
from server_fixture import running_server

from radixkv import LLM, SamplingParams
from radixkv.cache.base import NO_HINTS, CacheHints
from radixkv.cache.hash_block import HashBlockCache
from radixkv.cache.radix import RadixCache
from radixkv.routing import RoundRobin
from radixkv.serving.protocol import ChatRequest, CompletionRequest
from radixkv.sim import CostModel, simulate
from radixkv.sim.cluster import build_replica, run_cluster
from radixkv.stack import SIMULATOR_DEFAULTS, settings_from
from radixkv.workloads import make
from radixkv.workloads.request import Request

BAD_PRIORITIES = [True, False, 1.5, 2.0, "1", None, Fraction(1, 2)]
BAD_TTLS = [-1, -0.5, math.inf, -math.inf, math.nan, "3", True]


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("priority", [0, -7, 3, np.int64(5), 2**70])
def test_sampling_params_take_an_integer_priority(priority):
    sp = SamplingParams(priority=priority)
    assert sp.priority == priority and type(sp.priority) is int
    assert sp.cache_hints == CacheHints(int(priority), None)


@pytest.mark.parametrize("ttl", [None, 0, 2, 0.25, np.float64(1.5), Fraction(3, 2)])
def test_sampling_params_take_a_ttl_none_or_finite_and_not_negative(ttl):
    sp = SamplingParams(ttl=ttl)
    assert sp.ttl == (None if ttl is None else float(ttl))
    assert sp.ttl is None or type(sp.ttl) is float
    assert sp.cache_hints == CacheHints(0, sp.ttl)


@pytest.mark.parametrize("priority", BAD_PRIORITIES)
def test_sampling_params_refuse_a_priority_that_is_not_an_integer(priority):
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=priority)


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_sampling_params_refuse_a_bad_ttl(ttl):
    with pytest.raises(ValueError, match="ttl must be None or a finite number >= 0"):
        SamplingParams(ttl=ttl)


def test_defaults_are_no_hints():
    assert SamplingParams().cache_hints == NO_HINTS
    r = Request(0.0, 0, [1, 2, 3], 2)
    assert (r.priority, r.ttl) == (0, None)


@pytest.mark.parametrize("priority", [0, -2, 9, np.int32(4)])
@pytest.mark.parametrize("ttl", [None, 0, 3, 0.5])
def test_requests_take_priority_and_ttl(priority, ttl):
    r = Request(0.0, 0, [1, 2, 3], 2, priority=priority, ttl=ttl)
    assert r.priority == priority and type(r.priority) is int
    assert r.ttl == ttl and (ttl is None or type(r.ttl) is float)


@pytest.mark.parametrize("priority", BAD_PRIORITIES)
def test_requests_refuse_a_priority_that_is_not_an_integer(priority):
    with pytest.raises(ValueError, match="priority must be an integer"):
        Request(0.0, 0, [1, 2, 3], 2, priority=priority)


@pytest.mark.parametrize("ttl", BAD_TTLS)
def test_requests_refuse_a_bad_ttl(ttl):
    with pytest.raises(ValueError, match="ttl must be None or a finite number >= 0"):
        Request(0.0, 0, [1, 2, 3], 2, ttl=ttl)


# ------------------------------------------------------------------ plumbing
def _recorded(cls):
    """``cls`` with every ``match_prefix`` and ``insert`` logged as (first token, hints, clock reading)."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls: list[tuple[str, int, CacheHints, float]] = []

        def match_prefix(self, tokens, namespace=None, hints=NO_HINTS):
            if len(tokens):
                self.calls.append(("match", int(tokens[0]), hints, self.clock()))
            return super().match_prefix(tokens, namespace, hints)

        def insert(self, tokens, indices, namespace=None, hints=NO_HINTS):
            if len(tokens):
                self.calls.append(("insert", int(tokens[0]), hints, self.clock()))
            return super().insert(tokens, indices, namespace, hints)

    return Recording


def _hinted_requests(n: int = 6) -> list[Request]:
    """Requests with distinct first tokens (so each cache call names its request) and distinct hints, sent
    close together so that several run at once and some are ranked while waiting."""
    rng = np.random.default_rng(0)
    return [Request(0.001 * i, i, np.concatenate([[1000 + i], rng.integers(0, 10**9, 40 + 8 * i)]), 5 + i,
                    priority=i - 2, ttl=None if i % 2 else 0.5 * i) for i in range(n)]


@pytest.mark.parametrize("make_cache", [lambda: _recorded(RadixCache)(page_size=4),
                                        lambda: _recorded(HashBlockCache)(block_size=8)], ids=["radix", "hash"])
@pytest.mark.parametrize("chunk", [None, 16])
def test_every_cache_call_of_the_simulator_carries_its_request_s_hints(make_cache, chunk):
    reqs = _hinted_requests()
    want = {1000 + i: CacheHints(r.priority, r.ttl, i) for i, r in enumerate(reqs)}  # request: the rid
    cache = make_cache()
    simulate(reqs, cache=cache, schedule_policy="lpm", chunked_prefill_size=chunk,
             max_batch_tokens=None if chunk is None else 64, preemption=chunk is not None)
    assert cache.calls
    for kind, first, hints, _ in cache.calls:
        assert hints == want[first], (kind, first, hints)
    for first in want:  # each request matched and inserted at least once
        assert {k for k, f, _, _ in cache.calls if f == first} == {"match", "insert"}


def test_every_cache_call_of_the_engine_carries_its_request_s_hints(monkeypatch):
    llm = LLM("tiny-random", kv_cache_tokens=1024, chunked_prefill_size=16)
    calls: list[tuple[int, CacheHints]] = []
    match, insert = llm.cache.match_prefix, llm.cache.insert

    def logged_match(tokens, namespace=None, hints=NO_HINTS):
        if len(tokens):
            calls.append((int(tokens[0]), hints))
        return match(tokens, namespace, hints)

    def logged_insert(tokens, indices, namespace=None, hints=NO_HINTS):
        if len(tokens):
            calls.append((int(tokens[0]), hints))
        return insert(tokens, indices, namespace, hints)

    monkeypatch.setattr(llm.cache, "match_prefix", logged_match)
    monkeypatch.setattr(llm.cache, "insert", logged_insert)
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True, priority=p, ttl=t)
              for p, t in [(5, None), (-1, 2.0), (0, 0.0)]]
    prompts = [[10 + i] + list(range(30, 70)) for i in range(3)]  # a shared tail after distinct first tokens
    llm.generate(prompts, params)
    llm.add_request([40, 41, 42], SamplingParams(max_new_tokens=2, priority=7))
    assert llm.waiting[0].hints == CacheHints(7, None, llm.waiting[0].rid)
    while llm.has_unfinished():
        llm.step()
    aborted = llm.add_request([50] + list(range(100, 140)), SamplingParams(max_new_tokens=8, priority=9, ttl=1.0))
    llm.step()  # its first chunk is committed
    llm.abort(aborted)  # what it computed is released into the cache, with its hints
    assert [o.finish_reason for o in llm.step()] == ["abort"]
    want = {10 + i: sp.cache_hints for i, sp in enumerate(params)} | {40: CacheHints(7, None), 50: CacheHints(9, 1.0)}
    assert {first for first, _ in calls} == set(want)
    # the finish's insert also says how the answer ended (the engine's finish kind); no other call knows it
    assert all(hints._replace(request=None, stop=None) == want[first] for first, hints in calls)
    assert {hints.stop for first, hints in calls if first in (10, 11, 12, 40)} == {None, "length"}
    assert {hints.stop for first, hints in calls if first == 50} == {None, "abort"}  # the finish says abort
    requests = {}  # each request's calls name it, the same id each time
    for first, hints in calls:
        assert hints.request is not None and requests.setdefault(first, hints.request) == hints.request


# ------------------------------------------------------------------ the simulator's clock
def test_the_simulator_s_cache_reads_simulated_seconds():
    reqs = make("multi_turn", seed=0, sessions=3, turns=3, system_tokens=32, user_tokens=16, output_tokens=8,
                think_time=5.0)
    cache = _recorded(RadixCache)()
    res = simulate(reqs, cache=cache, capacity_tokens=4096)
    reads = [t for *_, t in cache.calls]
    assert reads == sorted(reads) and reads[0] >= 0  # simulated time never runs back
    assert cache.clock() == res.makespan  # the replica's clock, also after the run
    assert res.makespan > 10.0  # think time passed on the simulated clock, not on the wall's
    finishes = {row["finish"] for row in res.per_request}
    inserted_at = {t for kind, _, _, t in cache.calls if kind == "insert"}
    assert finishes <= inserted_at  # each request's sequence joins the cache at its simulated finish
    by_name = simulate(reqs, cache="radix", capacity_tokens=4096)
    assert by_name.summary() == res.summary()  # built by name or handed in: the same replay


def test_each_replica_s_cache_reads_its_own_replica_s_clock():
    reqs = make("multi_turn", seed=1, sessions=4, turns=2, system_tokens=16, user_tokens=24, output_tokens=6)
    config = settings_from(SIMULATOR_DEFAULTS, capacity_tokens=2048)
    stacks = [build_replica(reqs, config, False)[0] for _ in range(2)]
    res = run_cluster(reqs, stacks, RoundRobin(), CostModel())
    for stack, rep in zip(stacks, res.replicas, strict=True):
        assert stack.cache.clock() == rep.makespan > 0


# ------------------------------------------------------------------ the server
def test_the_body_s_priority_becomes_the_sampling_params():
    assert CompletionRequest(prompt=[1, 2], priority=4).sampling(8).priority == 4
    assert ChatRequest(messages=[{"role": "user", "content": "hi"}]).sampling(8).priority == 0
    for bad in ("high", 1.5, True, None, [1]):
        with pytest.raises(ValueError):
            CompletionRequest(prompt=[1, 2], priority=bad)


def test_the_server_takes_an_integer_priority_and_refuses_any_other_with_400():
    args = ("tiny-random", "--kv-cache-tokens", "512", "--max-batch-tokens", "128", "--chunked-prefill-size", "64")
    with running_server(*args) as (base, _):
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "priority": -3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        for route, body in [("completions", {"prompt": [1, 2, 3]}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            for bad in ("high", 1.5, True, None, {"level": 1}):
                r = httpx.post(f"{base}/v1/{route}", json={**body, "max_tokens": 2, "priority": bad})
                assert r.status_code == 400, (route, bad, r.text)
                err = r.json()["error"]
                assert err["param"] == "priority" and "integer" in err["message"], err
