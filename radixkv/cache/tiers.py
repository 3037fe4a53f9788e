"""The tier specs and what every cache shares about tiers: the names of a stack's memory tiers (the one place
they are written), ``TierSpec`` (one lower tier's description, from which ``radixkv.stack.build_stack`` builds
each tier whole), ``Copy`` and ``LoadPlan`` (what moves between tiers), and ``Untiered``, the tier surface of a
cache with no lower tier (``radixkv.cache.tiered.TieredCache`` is the one with some)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from radixkv.cache.base import NO_HINTS, CacheHints, MatchResult, TokenSeq, as_token_array
from radixkv.memory import SlotAllocator

# The tiers by name: the only place their names are written (everything else reads these or a spec's ``name``).
DEVICE, HOST, STORAGE = "device", "host", "storage"
REPORTED = (DEVICE, HOST)  # the tiers every hit report lists, present or not (tables and dashboards keep columns)
MEDIUM = {DEVICE: "GPU", HOST: "CPU", STORAGE: "STORAGE"}  # vLLM's KV event ``medium`` per tier
# how a lower tier keeps what it gets: one prefix tree (``Tier``), segments below the prefix the device holds
# (``radixkv.cache.segments.SegmentTier``), or such segments written as one chain per context (``ChainTier``)
HOST_LAYOUTS = ("prefix", "segments", "chains")


@dataclass(frozen=True)
class TierSpec:
    """One lower tier of a stack's memory: ``name``, capacity in ``tokens`` and its ``write_policy`` (when device
    KV is copied down to it; one for every tier of a stack today). Its bandwidth is the hardware's, so the
    cost model's (``CostModel.load_time``), not the layout's. ``shared``: one store several replicas use."""

    name: str
    tokens: int
    write_policy: str = "write_through"
    shared: bool = False


def lower_tiers(host_tokens: int | None, storage_tokens: int | None, write_policy: str) -> list[TierSpec]:
    """The lower tiers of a stack with a host tier of ``host_tokens`` and a storage tier of ``storage_tokens``
    (None or 0: none), nearest first, each under ``write_policy``."""
    specs = [TierSpec(HOST, host_tokens or 0, write_policy), TierSpec(STORAGE, storage_tokens or 0, write_policy)]
    return [spec for spec in specs if spec.tokens]


@dataclass(frozen=True)
class Copy:
    """KV to copy: ``src_slots[i]`` of tier ``src`` into ``dst_slots[i]`` of tier ``dst`` (int64 arrays)."""

    src: str
    dst: str
    src_slots: np.ndarray
    dst_slots: np.ndarray

    def __len__(self) -> int:
        return len(self.dst_slots)


class Part(NamedTuple):
    """Tokens ``[start, stop)`` of a plan, from ``tier``, whose (locked) match of the prompt is ``match``."""

    tier: Any  # a radixkv.cache.tiered.Tier
    match: MatchResult
    start: int
    stop: int


@dataclass
class LoadPlan:
    """What ``plan_load`` found: the device ``match`` and the ``parts`` lower tiers supply after it, nearest
    tier first. ``length``: tokens to load (device slots to allocate)."""

    tokens: np.ndarray
    namespace: Hashable
    match: MatchResult
    parts: list[Part] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.parts[-1].stop - self.match.length if self.parts else 0

    def by_tier(self) -> dict[str, int]:
        """Hit tokens per tier: the device's match, then what each lower tier supplies (in one part or more)."""
        out = {DEVICE: self.match.length}
        for p in self.parts:
            out[p.tier.name] = out.get(p.tier.name, 0) + p.stop - p.start
        return out


class Untiered:
    """The tier surface of a cache with no lower tier (``RadixCache``, ``HashBlockCache``, ``HashV0Cache``,
    ``NoPrefixCache``): every cache is one with zero or more lower tiers, so callers never ask which kind they
    hold. Plans load nothing, nothing is copied or counted, a flush evicts what no request holds. O(1) each
    but ``flush``."""

    tiers: tuple = ()  # no radixkv.cache.tiered.Tier below

    loaded_tokens = written_tokens = property(lambda self: {}, doc="Tokens copied up or down, by tier: none.")

    def plan_load(self, tokens: TokenSeq, match: MatchResult, namespace: Hashable = None,
                  hints: CacheHints = NO_HINTS) -> LoadPlan:
        return LoadPlan(as_token_array(tokens), namespace, match)

    def load(self, plan: LoadPlan, slots: np.ndarray) -> MatchResult:
        if len(slots):
            raise ValueError(f"load: {len(slots)} slots for a plan of nothing")
        return plan.match

    def cancel(self, plan: LoadPlan) -> None:
        """Nothing: nothing is locked for an empty plan."""

    def admitted(self, tokens: TokenSeq, match: MatchResult, namespace: Hashable = None,
                 hints: CacheHints = NO_HINTS) -> None:
        """Nothing: no write policy counts reuses."""

    def take_copies(self) -> list[Copy]:
        return []

    def reset_transfer_counts(self) -> None:
        """Nothing: no counts to zero."""

    def flush(self, allocator: SlotAllocator) -> int:
        """Evict every entry no request holds into ``allocator``: the slots freed. O(cache)."""
        freed = self.evict(self.evictable_size)
        allocator.free(freed)
        return len(freed)
