"""Routers on hand-made cases where the right answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.routing import ROUTERS, ReplicaView, Router, make_router


def views(n: int, loads=None, dead=()) -> list[ReplicaView]:
    loads = loads or [0] * n
    return [ReplicaView(i, outstanding_tokens=loads[i], alive=i not in dead) for i in range(n)]


def prompt(seed: int, n: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def test_factory_names_and_bad_parameters():
    for name in ROUTERS:
        assert isinstance(make_router(name), Router) and make_router(name).name == name
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random_walk")
    with pytest.raises(ValueError, match="bad parameters"):
        make_router("round_robin", temperature=1.0)
    with pytest.raises(ValueError, match="prefix_tokens"):
        make_router("prefix_hash", prefix_tokens=0)


def test_round_robin_cycles_and_skips_dead_replicas():
    r = make_router("round_robin")
    assert [r.route(prompt(0), views(3)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [r.route(prompt(0), views(3, dead={2})) for _ in range(4)] == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="alive"):
        r.route(prompt(0), views(2, dead={0, 1}))


def test_least_load_takes_the_fewest_outstanding_tokens():
    r = make_router("least_load")
    assert r.route(prompt(0), views(3, loads=[500, 20, 300])) == 1
    assert r.route(prompt(0), views(3, loads=[500, 20, 300], dead={1})) == 2


def test_prefix_hash_keeps_a_prefix_on_one_replica_and_moves_few_when_replicas_are_added():
    r = make_router("prefix_hash", prefix_tokens=64)
    shared = prompt(1, 64)
    picks = {r.route(np.concatenate([shared, prompt(s, 50)]), views(4)) for s in range(20)}
    assert len(picks) == 1  # same first 64 tokens: same replica, whatever follows
    before = [r.route(prompt(s), views(8)) for s in range(400)]
    after = [r.route(prompt(s), views(9)) for s in range(400)]
    moved = sum(a != b for a, b in zip(before, after, strict=True))
    assert all(new == 8 for old, new in zip(before, after, strict=True) if old != new)  # only to the new one
    assert 0 < moved < 400 * 2 / 9  # about 1/9 of the prefixes move
    assert len(set(before)) == 8  # the ring spreads prefixes over every replica


def test_prefix_hash_passes_over_an_overloaded_replica_and_namespaces_differ():
    r = make_router("prefix_hash", prefix_tokens=64, load_factor=1.25)
    p = prompt(7)
    home = r.route(p, views(4))
    loads = [0] * 4
    loads[home] = 10_000
    assert r.route(p, views(4, loads=loads)) != home
    spread = {r.route(p, views(4), namespace=f"tenant-{k}") for k in range(40)}
    assert len(spread) > 1  # the namespace is part of the key


# -- routers that model caches ----------------------------------------------------------------

def busy(n: int, requests: list[int], dead=()) -> list[ReplicaView]:
    """Replicas with the given numbers of unfinished requests (what cache_aware reads as load)."""
    return [ReplicaView(i, waiting=requests[i], outstanding_tokens=300 * requests[i], alive=i not in dead)
            for i in range(n)]


def test_cache_aware_follows_a_long_shared_prefix_unless_the_load_is_past_both_thresholds():
    r = make_router("cache_aware")
    p = prompt(1, 1000)
    first = r.route(p, busy(3, [0, 0, 0]))  # nothing cached: the smallest tree (all empty: replica 0)
    assert first == 0 and r.counts["smallest_tree"] == 1
    assert r.route(prompt(2), busy(3, [0, 0, 0])) == 1  # a miss goes to the smallest tree
    follow = np.concatenate([p[:900], prompt(3, 100)])  # shares 90% with replica 0's prompt
    assert r.route(follow, busy(3, [10, 0, 0])) == 0 and r.counts["cache_hit"] == 1
    # SGLang's imbalance test: max - min > 64 and max > 1.5 x min, then the least loaded wins
    assert r.route(follow, busy(3, [70, 5, 3])) == 2 and r.counts["balance"] == 1
    assert r.route(follow, busy(3, [70, 10, 60])) == 0  # 70 > 1.5 x 10 but 70 - 10 <= 64: still the cache
    short = np.concatenate([p[:200], prompt(4, 800)])  # 20% < cache_threshold 0.3: the smallest tree
    assert r.route(short, busy(3, [0, 0, 0])) == 1  # trees: 0 holds 1900, 1 holds 300, 2 holds 1000


def test_cache_aware_trims_its_trees_to_max_tree_size_every_interval():
    r = make_router("cache_aware", max_tree_size=500, eviction_interval_secs=10)
    p = prompt(5, 1000)
    assert r.route(p, busy(2, [0, 0]), now=0.0) == 0
    assert r.route(p, busy(2, [0, 0]), now=5.0) == 0  # before the interval: still cached
    assert r.route(prompt(6), busy(2, [0, 0]), now=20.0) == 0  # the trim at 20 s emptied replica 0's tree
    assert r.route(p, busy(2, [0, 0]), now=21.0) == 1 and r.counts["smallest_tree"] == 3  # p was forgotten


def test_preble_exploits_a_prefix_longer_than_the_rest_and_explores_otherwise():
    r = make_router("preble")
    p = prompt(7, 1000)
    assert r.route(p, views(2)) == 0 and r.counts["explore"] == 1
    assert r.route(prompt(8, 1000), views(2)) == 1  # explore: replica 0 has 1000 tokens of recent work
    longer = np.concatenate([p[:600], prompt(9, 400)])  # 600 cached > 400 not: exploit
    assert r.route(longer, views(2)) == 0 and r.counts["exploit"] == 1
    shorter = np.concatenate([p[:300], prompt(10, 700)])  # 300 cached < 700 not: the least load cost
    assert r.route(shorter, views(2)) == 1  # replica 0: 1400 recent + 700 > replica 1: 1000 + 1000
    assert r.counts["explore"] == 3


def test_preble_forgets_load_older_than_its_window():
    r = make_router("preble", window_secs=60)
    assert r.route(prompt(11, 1000), views(2), now=0.0) == 0
    assert r.route(prompt(12, 10), views(2), now=1.0) == 1
    assert r.route(prompt(13, 10), views(2), now=100.0) == 0  # both windows empty: the lower index


def test_affinity_keeps_a_conversation_home_and_spreads_new_ones():
    r = make_router("affinity")
    a, b = prompt(20, 1000), prompt(21, 1000)
    assert [r.route(a, views(2)), r.route(b, views(2))] == [0, 1]
    r.finished(0, np.concatenate([a, prompt(22, 50)]))  # the answer joins replica 0's tree
    turn2 = np.concatenate([a, prompt(22, 50), prompt(23, 100)])
    assert r.route(turn2, views(2)) == 0 and r.counts["affinity"] == 1


def test_affinity_leaves_home_when_its_work_would_pass_the_slack():
    r = make_router("affinity", slack=0.05)
    a = prompt(30, 1000)
    assert r.route(a, views(2)) == 0
    assert r.route(prompt(31, 100), views(2)) == 1  # replica 1: 100 tokens of work, replica 0: 1000
    big = np.concatenate([a[:100], prompt(32, 2000)])  # home 0 would reach 3000 against a mean of 1600
    assert r.route(big, views(2)) == 1 and r.counts["balance"] == 1


def test_affinity_follows_its_capacity_and_skips_dead_replicas():
    r = make_router("affinity", capacity_tokens=600)
    a = prompt(40, 1000)
    assert r.route(a, views(2)) == 0  # 1000 > 600: the tree keeps nothing of it
    assert r.route(a, views(2)) == 1 and r.counts["new"] == 2
    assert r.route(prompt(41), views(2, dead={1})) == 0


def test_kv_events_routes_by_the_index_its_events_built_and_respects_the_delay():
    from radixkv.cache.factory import make_cache

    r = make_router("kv_events", block_size=4, event_delay=1.0)
    caches = [make_cache("radix", page_size=4) for _ in range(2)]
    for i, c in enumerate(caches):
        c.listener = lambda ev, i=i: r.observe(i, ev, 0.0)
    p = prompt(50, 400)
    caches[1].insert(p, np.arange(len(p)))
    q = np.concatenate([p[:300], prompt(51, 100)])
    assert r.route(q, views(2), now=0.5) == 0  # the events are not due yet: equal costs, lowest index
    assert r.route(q, views(2), now=1.0) == 1 and r.counts["cache_hit"] == 1
    assert r.route(q, views(2, loads=[0, 2000]), now=1.0) == 0  # 2000 active tokens outweigh 300 cached
    caches[1].evict(400)
    r2 = make_router("kv_events", block_size=4, temperature=1.0, seed=3)
    picks = {r2.route(q, views(2)) for _ in range(50)}
    assert picks == {0, 1}  # softmax sampling reaches both


@pytest.mark.parametrize("name, bad", [
    ("cache_aware", {"cache_threshold": -0.1}), ("cache_aware", {"balance_rel_threshold": 0.5}),
    ("cache_aware", {"max_tree_size": 0}), ("kv_events", {"block_size": 0}), ("kv_events", {"temperature": -1}),
    ("kv_events", {"event_delay": float("nan")}), ("preble", {"window_secs": -1}), ("affinity", {"slack": -0.1}),
    ("affinity", {"capacity_tokens": 0}), ("affinity", {"capacity": 10}),
])
def test_bad_router_parameters_are_value_errors(name, bad):
    with pytest.raises(ValueError):
        make_router(name, **bad)
