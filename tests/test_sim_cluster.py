"""The simulated cluster: N = 1 is ``simulate``; decisions, totals and references."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import workloads
from radixkv.routing import make_router
from radixkv.routing.base import LoadTracker
from radixkv.sim import CostModel, simulate, simulate_cluster
from radixkv.sim.cluster import cluster_references


@pytest.fixture(scope="module")
def chats():
    return workloads.make("multi_turn", seed=0)


@pytest.mark.parametrize("cache, kw", [
    ("radix", dict(page_size=1)), ("radix", dict(page_size=16, capacity_tokens=6000)),
    ("hash", dict(block_size=16, capacity_tokens=6000)), ("hash-v0", dict(block_size=8)), ("none", {}),
    ("radix", dict(capacity_tokens=5000, preemption=True, chunked_prefill_size=256, schedule_policy="lpm")),
])
def test_one_replica_is_simulate(chats, cache, kw):
    alone = simulate(chats, cache=cache, **kw)
    cluster = simulate_cluster(chats, replicas=1, router="round_robin", cache=cache, references=False, **kw)
    assert cluster.replicas[0].per_request == alone.per_request
    assert cluster.replicas[0].steps == alone.steps
    assert cluster.hit_rate == alone.hit_rate and cluster.makespan == alone.makespan
    assert cluster.imbalance == 1.0


@pytest.mark.parametrize("router", ["round_robin", "least_load", "prefix_hash", "cache_aware", "kv_events",
                                    "preble", "affinity"])
def test_every_router_serves_every_request_once_and_leaks_nothing(chats, router):
    res = simulate_cluster(chats, replicas=3, router=router, capacity_tokens=8000, page_size=16,
                           router_params={"block_size": 16} if router == "kv_events" else None)
    assert sorted(row["rid"] for r in res.replicas for row in r.per_request) == list(range(len(chats)))
    assert all(0 <= d < 3 for d in res.decisions)
    assert sum(res.decision_counts[f"replica {i}"] for i in range(3) if f"replica {i}" in res.decision_counts) \
        == len(chats)
    s = res.summary()
    assert s["prompt_tokens"] == sum(len(r.prompt) for r in chats)
    assert s["imbalance"] >= 1.0 and s["ttft_p99"] >= s["ttft_p50"] > 0
    assert (res.ttft_p50, res.ttft_p99, res.throughput) == (s["ttft_p50"], s["ttft_p99"], s["throughput"])
    assert set(res.references) == {"upper_bound", "pooled_lru", "pooled_belady"}
    assert res.config["router"] == router and res.config["replicas"] == 3


def test_round_robin_decisions_cycle_and_imbalance_is_max_over_mean(chats):
    res = simulate_cluster(chats, replicas=4, router="round_robin", references=False)
    assert res.decisions[:4] == [0, 1, 2, 3]  # the first turns arrive together, in rid order
    counts = [res.decision_counts[f"replica {i}"] for i in range(4)]
    assert max(counts) - min(counts) <= 1
    c = res.computed_tokens
    assert res.imbalance == pytest.approx(max(c) / (sum(c) / 4))


def test_affinity_keeps_sessions_together_and_beats_round_robin(chats):
    rr = simulate_cluster(chats, replicas=4, router="round_robin", capacity_tokens=20_000, references=False)
    aff = simulate_cluster(chats, replicas=4, router="affinity", capacity_tokens=20_000,
                           router_params={"capacity_tokens": 20_000}, references=False)
    assert aff.hit_rate > rr.hit_rate
    homes: dict = {}
    for r in chats:
        homes.setdefault(r.session, set()).add(aff.decisions[r.rid])
    assert sum(len(h) == 1 for h in homes.values()) >= 0.8 * len(homes)


def test_references_bound_the_pooled_cache(chats):
    refs = cluster_references(chats, 4, 5000)
    assert refs["pooled_lru"] <= refs["upper_bound"] and refs["pooled_belady"] <= refs["upper_bound"] + 1e-12
    pooled = simulate(chats, capacity_tokens=20_000, max_running=256,
                      cost_model=CostModel(**{k: v / 4 for k, v in CostModel().__dict__.items()}))
    assert refs["pooled_lru"] == pooled.hit_rate
    assert "pooled_belady" not in cluster_references(chats, 2, 5000, cache="hash")


def test_a_router_object_is_used_as_is_and_bad_settings_are_value_errors(chats):
    router = make_router("affinity")
    res = simulate_cluster(chats[:20], replicas=2, router=router, references=False)
    assert sum(router.counts.values()) == 20 and res.config["router"] == "affinity"
    for bad in [dict(replicas=0), dict(router="nope"), dict(eviction_policy="belady"),
                dict(router=router, router_params={"slack": 1}), dict(cache=object()), dict(capacity_tokens=0)]:
        with pytest.raises(ValueError):
            simulate_cluster(chats[:5], **bad)


def test_a_router_returning_a_bad_index_is_an_error(chats):
    class Wrong:
        name = "wrong"

        def route(self, tokens, replicas, namespace=None, now=0.0):
            return 7

        def finished(self, replica, tokens, namespace=None):
            return None

    with pytest.raises(ValueError, match="not a replica index"):
        simulate_cluster(chats[:3], replicas=2, router=Wrong(), references=False)


def test_load_tracker_counts_what_the_router_sent():
    t = LoadTracker(2)
    t.sent("a", 0, 100, 10)
    t.sent("b", 0, 50, 5)
    t.started("a")
    v = t.views([0.5, 0.0])
    assert (v[0].running, v[0].waiting, v[0].outstanding_tokens, v[0].kv_used) == (1, 1, 165, 0.5)
    assert t.on(0) == ["a", "b"] and t.done("a") == 0 and t.views()[0].outstanding_tokens == 55
    with pytest.raises(ValueError):
        t.sent("b", 1, 1, 1)
    with pytest.raises(ValueError):
        LoadTracker(0)


def test_event_delay_changes_what_kv_events_knows(chats):
    now = simulate_cluster(chats, replicas=3, router="kv_events", page_size=16, capacity_tokens=8000,
                           router_params={"block_size": 16}, references=False)
    late = simulate_cluster(chats, replicas=3, router="kv_events", page_size=16, capacity_tokens=8000,
                            router_params={"block_size": 16, "event_delay": 1e6}, references=False)
    assert late.decision_counts.get("cache_hit", 0) == 0 < now.decision_counts["cache_hit"]
    assert np.isfinite(late.hit_rate)


def test_a_preempted_request_keeps_its_first_token_time(chats):
    """As in the engine: a request preempted after its first token recomputes it, and its ``ttft`` stays the
    first time (before its last admission)."""
    res = simulate(chats, cache="radix", capacity_tokens=5000, preemption=True, chunked_prefill_size=64)
    assert res.preemptions > 0
    rows = res.per_request
    assert all(r["ready"] <= r["first_token"] <= r["finish"] for r in rows)
    assert any(r["first_token"] < r["admitted"] for r in rows)
