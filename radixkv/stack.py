"""One configuration and one builder for what the engine, the simulator and every replica run: a prefix cache,
a slot allocator over the KV budget, and the scheduler that drives them.

``StackConfig`` holds every cache and scheduling setting, checked once at construction (``ValueError``).
``build_stack(config, slots)`` builds the three from it; ``LLM``, ``simulate``, ``simulate_cluster`` and
their references, ``Cluster`` and the server all go through it, so each rule below is written here only:

* the allocator's granularity is the cache's page: the radix page, the hash caches' block, one slot for
  ``none`` (``kv_page_size``);
* in-batch prefix sharing never applies without a prefix cache (holding requests back for a cache that
  never hits only delays them);
* at idle nothing is locked and every slot is free or evictable (``check_idle``).

Defaults are the engine's: ``lpm`` with in-batch sharing at 32 tokens, 4,096 tokens a step, prefill chunks
of 1,024, 64 running. The simulator's keyword calls start from ``SIMULATOR_DEFAULTS`` instead, the one place
that differs, and says why there. O(1) to build, but for the allocator's free list (O(slots)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from radixkv.cache.base import PrefixCache
from radixkv.cache.eviction import POLICIES as EVICTION_POLICIES
from radixkv.cache.factory import CACHES, make_cache
from radixkv.cache.none import NoPrefixCache
from radixkv.checks import is_int
from radixkv.memory import SlotAllocator
from radixkv.scheduling import POLICIES as SCHEDULE_POLICIES
from radixkv.scheduling import RequestState, Scheduler, make_policy

BLOCK_CACHES = ("hash", "hash-v0")  # caches that allocate whole blocks of ``block_size``


@dataclass(frozen=True)
class StackConfig:
    """Every cache and scheduling setting of one engine or simulated replica; see the module docstring.

    ``capacity_tokens``: the KV budget (None: the engine sizes it from free memory, the simulator makes room
    for every token). ``in_batch_sharing``: SGLang's in-batch prefix caching threshold in tokens (0: off).
    ``max_batch_tokens`` / ``chunked_prefill_size``: tokens per step and per prefill chunk (None: no limit).
    ``eviction_policy`` takes ``belady`` too where the caller supplies the future (the simulator).
    """

    prefix_cache: str = "radix"
    capacity_tokens: int | None = None
    page_size: int = 1
    block_size: int = 16
    eviction_policy: str = "lru"
    schedule_policy: str = "lpm"
    in_batch_sharing: int = 32
    max_batch_tokens: int | None = 4096
    chunked_prefill_size: int | None = 1024
    max_running: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for message in self.problems():
            raise ValueError(f"invalid settings: {message} (got {asdict(self)})")

    def problems(self) -> list[str]:
        """What is wrong with these settings, types first (the range checks compare numbers)."""
        ints = ("page_size", "block_size", "max_running", "in_batch_sharing", "seed")
        optional = ("capacity_tokens", "max_batch_tokens", "chunked_prefill_size")
        wrong = [f"{n} must be an integer" for n in ints if not is_int(getattr(self, n))]
        wrong += [f"{n} must be an integer or None (capacity_tokens and the token budgets)" for n in optional
                  if getattr(self, n) is not None and not is_int(getattr(self, n))]
        if wrong:
            return wrong
        checks = [
            (self.prefix_cache in CACHES, f"prefix_cache must be one of {CACHES}"),
            (self.eviction_policy in (*EVICTION_POLICIES, "belady"),
             f"eviction_policy must be one of {sorted(EVICTION_POLICIES)} (or belady, in the simulator)"),
            (self.schedule_policy in SCHEDULE_POLICIES, f"schedule_policy must be one of {SCHEDULE_POLICIES}"),
            (self.page_size >= 1 and self.block_size >= 1, "page_size and block_size must be >= 1"),
            (all(getattr(self, n) is None or getattr(self, n) >= 1 for n in optional),
             "capacity_tokens and the token budgets must be >= 1 or None"),
            (self.max_running >= 1, "max_running must be >= 1"),
            (self.in_batch_sharing >= 0, "in_batch_sharing must be >= 0 (0 disables it)"),
        ]
        return [message for ok, message in checks if not ok]

    @property
    def kv_page_size(self) -> int:
        """Slots per KV page: the hash caches' block, the radix page, 1 for ``none`` (its matches are empty)."""
        return kv_page_size(self.prefix_cache, self.page_size, self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_page_size(prefix_cache: str, page_size: int, block_size: int) -> int:
    """The allocator's (and the KV pool's) page for a cache of that name: see ``StackConfig.kv_page_size``."""
    if prefix_cache in BLOCK_CACHES:
        return block_size
    return page_size if prefix_cache == "radix" else 1


# The simulator's keyword calls start from these, not from the engine's defaults: the published replays this
# project reproduces (SGLang's and Mooncake's figures, the routing studies) admit first come first served and
# prefill each prompt whole in one step, so a bare ``simulate(requests, ...)`` models that; a study of the
# engine's own schedule passes ``EngineConfig(...).stack`` (``simulate(requests, config=...)``).
SIMULATOR_DEFAULTS = StackConfig(schedule_policy="fcfs", in_batch_sharing=0, max_batch_tokens=None,
                                 chunked_prefill_size=None)


def settings_from(base: StackConfig, **settings: Any) -> StackConfig:
    """``base`` with ``settings`` replaced; ``ValueError`` naming an unknown setting."""
    known = {f.name for f in fields(StackConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown settings {unknown}; the settings are {sorted(known)}")
    return replace(base, **settings)


@dataclass
class Stack:
    """What ``build_stack`` built: the cache, the allocator over its slots, and the scheduler over both."""

    cache: PrefixCache
    allocator: SlotAllocator
    scheduler: Scheduler


def build_stack(config: StackConfig, slots: int, *, cache: PrefixCache | None = None,
                whole_kv: Callable[[RequestState], int] | None = None, **cache_options: Any) -> Stack:
    """The cache (``cache`` if given, else ``make_cache`` from ``config`` with ``cache_options``, e.g. the
    simulator's ``future`` for Belady), an allocator of ``slots`` at the cache's page, and a scheduler with
    ``config``'s policy and budgets; ``whole_kv`` reserves each request's whole KV at admission (see
    ``Scheduler``)."""
    prefix_cache = cache if cache is not None else make_cache(
        config.prefix_cache, page_size=config.page_size, block_size=config.block_size,
        eviction_policy=config.eviction_policy, **cache_options)
    page = prefix_cache.page_size  # the granularity every cache exposes: its whole pages or blocks
    # in-batch sharing never applies without a prefix cache: holding requests back for one only delays them
    sharing = 0 if isinstance(prefix_cache, NoPrefixCache) else config.in_batch_sharing
    policy = make_policy(config.schedule_policy, seed=config.seed, in_batch_sharing=sharing or None, page_size=page)
    allocator = SlotAllocator(slots, page_size=page)
    budget, chunk = (math.inf if v is None else int(v) for v in (config.max_batch_tokens, config.chunked_prefill_size))
    scheduler = Scheduler(prefix_cache, allocator, policy, max_running=config.max_running, max_batch_tokens=budget,
                          chunked_prefill_size=chunk, whole_kv=whole_kv)
    return Stack(prefix_cache, allocator, scheduler)


def check_idle(cache: PrefixCache, allocator: SlotAllocator) -> None:
    """Both structures' invariants hold, nothing is locked, and every slot is free or evictable (no leak);
    ``AssertionError`` otherwise. Call it when no request waits or runs."""
    cache.check_invariants()
    allocator.check_invariants()
    if cache.protected_size:
        raise AssertionError(f"idle but {cache.protected_size} cached tokens are still locked")
    held = allocator.num_free + cache.evictable_size
    if held != allocator.capacity:
        raise AssertionError(f"slots leaked: free + evictable = {held} != {allocator.capacity}")
