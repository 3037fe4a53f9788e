"""Routers on hand-made cases where the right answer is known (issue 32, first part)."""

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
