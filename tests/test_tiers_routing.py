"""Routers weigh a replica's host-tier overlap below its device-tier overlap (``kv_events``'s
``host_overlap_weight``, ``affinity``'s ``host_weight``), and cache events carry their tier."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.cache.events import AllBlocksCleared, BlockStored
from radixkv.routing import Affinity, KVEvents, ReplicaView
from radixkv.stack import StackConfig, build_stack

VIEWS = [ReplicaView(0), ReplicaView(1)]
PROMPT = np.arange(1, 101)


def stored(tokens: np.ndarray, medium: str) -> BlockStored:
    blocks = len(tokens) // 16
    return BlockStored(tuple(range(blocks)), None, tuple(tokens[: 16 * blocks].tolist()), 16, None, medium)


@pytest.mark.parametrize("weight, choice", [(1.0, 0), (0.25, 1)])
def test_kv_events_weighs_host_overlap(weight, choice):
    """Replica 0 holds 64 tokens in its host tier, replica 1 32 on its device: a full-weight host block wins,
    a quarter-weight one (16 tokens' worth) loses."""
    router = KVEvents(block_size=16, host_overlap_weight=weight)
    router.observe(0, stored(PROMPT[:64], "CPU"), 0.0)
    router.observe(1, stored(PROMPT[:32], "GPU"), 0.0)
    assert router.route(PROMPT, VIEWS) == choice
    router.observe(0, AllBlocksCleared(), 1.0)  # a reset empties both of replica 0's indexes
    assert router.route(PROMPT, VIEWS, now=1.0) == 1


def test_kv_events_without_host_events_decides_as_before():
    router, plain = KVEvents(block_size=16), KVEvents(block_size=16, host_overlap_weight=0.0)
    for r in (router, plain):
        r.observe(1, stored(PROMPT[:48], "GPU"), 0.0)
    assert router.route(PROMPT, VIEWS) == plain.route(PROMPT, VIEWS) == 1


def test_a_tiered_cache_tells_its_listener_each_tier():
    stack = build_stack(StackConfig(page_size=16, capacity_tokens=64, host_capacity_tokens=256), 64)
    events = []
    stack.cache.listener = events.append
    stack.cache.insert(PROMPT[:64], np.arange(64))
    assert {e.medium for e in events if isinstance(e, BlockStored)} == {"GPU", "CPU"}
    router = KVEvents(block_size=16)
    for e in events:
        router.observe(0, e, 0.0)
    router.route(PROMPT, VIEWS)
    assert router.index.match(PROMPT) == {0: 64} and router.host_index.match(PROMPT) == {0: 64}


def test_affinity_weighs_what_only_the_host_tier_still_holds():
    """Both replicas were sent 64-token prompts; replica 0's was pushed out of its 64-token device tree by a
    later prompt but its host tier holds it: with weight 1 it keeps the conversation, with 0 it does not."""
    picks = []
    for weight in (1.0, 0.0):
        router = Affinity(capacity_tokens=64, host_capacity_tokens=256, host_weight=weight, slack=10.0)
        router.route(PROMPT[:64], VIEWS)  # -> 0 (tie, lowest index)
        router.route(np.arange(500, 564), VIEWS)  # -> 1 (least work)
        router.finished(0, np.arange(900, 964))  # replica 0's device tree forgets PROMPT
        router.finished(1, PROMPT[:40])
        picks.append(router.route(PROMPT, VIEWS))
    assert picks == [0, 1]
    with pytest.raises(ValueError, match="host_weight"):
        Affinity(host_weight=-1)
