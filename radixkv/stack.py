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
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from radixkv.cache.base import PrefixCache
from radixkv.cache.eviction import EVERY_POLICY as EVICTION_POLICIES
from radixkv.cache.eviction import make_policy as make_policy_named
from radixkv.cache.eviction import needs_future
from radixkv.cache.factory import CACHES, make_cache
from radixkv.cache.none import NoPrefixCache
from radixkv.cache.segments import TIER_KINDS
from radixkv.cache.tiered import WRITE_POLICIES, Tier, TieredCache, eviction_policies
from radixkv.cache.tiers import HOST_LAYOUTS, TierSpec, lower_tiers
from radixkv.memory import SlotAllocator
from radixkv.scheduling import POLICIES as SCHEDULE_POLICIES
from radixkv.scheduling import RequestState, Scheduler, make_policy
from radixkv.scheduling.prefetch import Prefetcher
from radixkv.settings import canonical, problems, setting

BLOCK_CACHES = ("hash", "hash-v0")  # caches that allocate whole blocks of ``block_size``
TIERED_CACHES = ("radix", "hash")  # those a host or storage tier can sit below


@dataclass(frozen=True)
class StackConfig:
    """Every cache and scheduling setting of one engine or simulated replica; see the module docstring.

    ``capacity_tokens``: the KV budget (None: the engine sizes it from free memory, the simulator makes room
    for every token). ``in_batch_sharing``: SGLang's in-batch prefix caching threshold in tokens (0: off).
    ``max_batch_tokens`` / ``chunked_prefill_size``: tokens per step and per prefill chunk (None: no limit).
    ``eviction_policy`` may be one that ``needs_future`` where the caller supplies it (the simulator);
    ``eviction_params`` are the policy's parameters (``radixkv.cache.eviction``), for every tier.
    ``host_capacity_tokens`` / ``storage_capacity_tokens`` put lower tiers below a radix or hash cache (None
    or 0: none), copied down under ``write_policy`` (``write_threshold`` hits for the selective one) and kept
    as ``host_layout`` says (``radixkv.cache.segments``); see ``radixkv.cache.tiered``.
    """

    prefix_cache: str = setting("radix", "the prefix cache: radix tree (SGLang), hash blocks (vLLM v1 / v0), or "
                                "none", choices=CACHES)
    capacity_tokens: int | None = setting(
        None, "KV budget in tokens (the engine's None: a quarter of free memory, 1,024 to 2**20; the "
              "simulator's: room for every token)",
        aliases=("kv_cache_tokens",), flags=("--kv-cache-tokens", "--max-total-tokens"), minimum=1)
    page_size: int = setting(1, "radix cache: tokens per KV page (a node holds whole pages)", minimum=1)
    block_size: int = setting(16, "hash / hash-v0 caches: tokens per hashed block (also their KV page)", minimum=1)
    eviction_policy: str = setting("lru", "which unreferenced cache entries go first under memory pressure",
                                   flags=("--radix-eviction-policy",), choices=sorted(EVICTION_POLICIES))
    eviction_params: Mapping[str, Any] = setting(
        {}, 'the eviction policy\'s parameters (JSON on a command line, e.g. \'{"ttl": 60}\' for ttl; '
            'docs/eviction.md)')
    schedule_policy: str = setting("lpm", "order in which waiting requests are admitted (lpm: longest cached "
                                          "prefix first)", choices=SCHEDULE_POLICIES)
    in_batch_sharing: int = setting(32, "admit one of several waiting requests sharing an uncached prefix of at "
                                        "least this many tokens first (SGLang's in-batch prefix caching; 0: off)",
                                    minimum=0)
    max_batch_tokens: int | None = setting(4096, "tokens per step, decodes and prefill chunks together (None: no "
                                                 "limit)", flags=("--max-num-batched-tokens",), minimum=1)
    chunked_prefill_size: int | None = setting(1024, "longest prefill chunk of one request per step (None: whole "
                                                     "prompts)", minimum=1)
    max_running: int = setting(64, "most requests running at once", flags=("--max-running-requests",
                                                                           "--max-num-seqs"), minimum=1)
    seed: int = setting(0, "seed for sampling and for random policies")
    host_capacity_tokens: int | None = setting(
        None, "host tier below the device's KV, in tokens (HiCache: a second KV buffer in host memory; None: "
              "none)", aliases=("host_kv_cache_tokens",), flags=("--host-kv-cache-tokens",), minimum=0)
    storage_capacity_tokens: int | None = setting(None, "storage tier below the host tier, in tokens (None: none)",
                                                  minimum=0)
    write_policy: str = setting("write_through", "when KV is copied to the lower tiers: on insert, after "
                                                 "write_threshold hits, or on eviction",
                                flags=("--hicache-write-policy",), choices=WRITE_POLICIES)
    write_threshold: int = setting(2, "hits before write_through_selective copies an entry to the host tier",
                                   minimum=1)
    host_layout: str = setting("prefix", "how each lower tier but a shared store keeps what it gets: whole prefixes "
                                         "(one prefix tree), segments below the prefix the device still holds, or "
                                         "such segments written as one chain per context (radix only)",
                               choices=HOST_LAYOUTS)
    prefetch: bool = setting(False, "load an agent session's context back from the lower tiers before its "
                                    "predicted return (KVFlow's prefetch; radixkv.scheduling.prefetch)")

    def __post_init__(self) -> None:
        for message in self.problems():
            raise ValueError(f"invalid settings: {message} (got {asdict(self)})")

    def problems(self) -> list[str]:
        """What is wrong with these settings: each one's own check (``radixkv.settings.problems``) first, then
        how they go together."""
        wrong = problems(self)
        if wrong:
            return wrong
        if self.tiered and self.prefix_cache not in TIERED_CACHES:
            wrong.append(f"host and storage tiers work with the caches {TIERED_CACHES}")
        if self.tiered and self.host_layout != "prefix" and self.prefix_cache != "radix":
            wrong.append(f"host_layout {self.host_layout} works below the radix cache")
        if self.prefetch and not self.tiered:
            wrong.append("prefetch loads from a host or storage tier: give host_capacity_tokens")
        if self.tiered and needs_future(self.eviction_policy):
            wrong.append("tiers take an online eviction_policy (one that needs no future)")
        try:  # what ``make_policy`` says of the eviction policy's parameters
            make_policy_named(self.eviction_policy, **self.eviction_params)
        except ValueError as e:
            wrong.append(str(e))
        return wrong

    @property
    def tiers(self) -> list[TierSpec]:
        """The memory below the device's cache, nearest first: a ``TierSpec`` per host or storage capacity."""
        return lower_tiers(self.host_capacity_tokens, self.storage_capacity_tokens, self.write_policy)

    @property
    def tiered(self) -> bool:
        """Whether any tier sits below the device's cache."""
        return bool(self.tiers)

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
    """``base`` with ``settings`` replaced (by field name or alias: ``kv_cache_tokens`` is ``capacity_tokens``);
    ``ValueError`` naming an unknown setting."""
    return replace(base, **canonical(StackConfig, settings))


@dataclass
class Stack:
    """What ``build_stack`` built: the cache, the allocator over its slots, and the scheduler over both."""

    cache: PrefixCache
    allocator: SlotAllocator
    scheduler: Scheduler
    future: Any = None  # what a policy that needs the future was handed; its user marks requests served


def build_stack(config: StackConfig, slots: int, *, cache: PrefixCache | None = None,
                whole_kv: Callable[[RequestState], int] | None = None, storage: Tier | None = None,
                worth_loading: Callable[[str, int, int], bool] | None = None, memory: Any = None,
                future: Any = None, load_time: Callable[[int], float] | None = None) -> Stack:
    """The cache (``cache`` if given, else ``make_cache`` from ``config``, handing ``future`` to a policy that
    needs it: the simulator's), an allocator of ``slots`` at the cache's page, and a scheduler with
    ``config``'s policy and budgets; ``whole_kv`` reserves each request's whole KV at admission (see
    ``Scheduler``). Each of ``config.tiers`` is built whole (``lower_tier``): its cache, its allocator and,
    with ``memory`` (the engine's ``TierMemory``), its KV buffer, and the cache becomes a ``TieredCache`` over
    them, with ``worth_loading`` and ``memory``'s mover (see ``TieredCache``); ``storage``: a built store in
    place of the storage spec's (one several replicas share). With ``config.prefetch`` the scheduler gets a
    ``Prefetcher`` that starts each load ``load_time(tokens)`` seconds ahead (None: 0)."""
    prefix_cache = cache if cache is not None else make_cache(
        config.prefix_cache, page_size=config.page_size, block_size=config.block_size,
        eviction_policy=config.eviction_policy, eviction_params=config.eviction_params, future=future)
    if cache is None and config.tiers:
        tiers = [storage if storage is not None and spec.name == storage.name else lower_tier(config, spec, memory)
                 for spec in config.tiers]
        prefix_cache = TieredCache(prefix_cache, tiers, config.write_policy, config.write_threshold, worth_loading,
                                   None if memory is None else memory.mover())
    page = prefix_cache.page_size  # the granularity every cache exposes: its whole pages or blocks
    # in-batch sharing never applies without a prefix cache: holding requests back for one only delays them
    sharing = 0 if isinstance(prefix_cache, NoPrefixCache) else config.in_batch_sharing
    policy = make_policy(config.schedule_policy, seed=config.seed, in_batch_sharing=sharing or None, page_size=page)
    allocator = SlotAllocator(slots, page_size=page)
    budget, chunk = (math.inf if v is None else int(v) for v in (config.max_batch_tokens, config.chunked_prefill_size))
    scheduler = Scheduler(prefix_cache, allocator, policy, max_running=config.max_running, max_batch_tokens=budget,
                          chunked_prefill_size=chunk, whole_kv=whole_kv)
    for eviction in eviction_policies(prefix_cache):
        if hasattr(eviction, "sessions"):  # an eviction policy that follows sessions reads the scheduler's book
            eviction.sessions = scheduler.sessions
    if config.prefetch:
        scheduler.prefetcher = Prefetcher(load_time, scheduler.sessions)
    return Stack(prefix_cache, allocator, scheduler, future)


def lower_tier(config: StackConfig, spec: TierSpec, memory: Any = None) -> Tier:
    """The tier ``spec`` describes, whole, below ``config``'s cache: a cache of the same kind, page and eviction
    policy (a policy of its own) over ``spec.tokens`` slots, and with ``memory`` (the engine's) its KV buffer."""
    cache = make_cache(config.prefix_cache, page_size=config.page_size, block_size=config.block_size,
                       eviction_policy=config.eviction_policy, eviction_params=config.eviction_params)
    kind = Tier if spec.shared else TIER_KINDS[config.host_layout]
    return kind(spec.name, cache, SlotAllocator(spec.tokens, page_size=cache.page_size), spec.shared,
                None if memory is None else memory.buffer(spec))


def check_idle(cache: PrefixCache, allocator: SlotAllocator) -> None:
    """Both structures' invariants hold, nothing is locked, and every slot is free or evictable (no leak);
    ``AssertionError`` otherwise. Call it when no request waits or runs."""
    cache.check_invariants()
    allocator.check_invariants()
    if cache.protected_size:
        raise AssertionError(f"idle but {cache.protected_size} cached tokens are still locked")
    for tier in cache.tiers:  # lower tiers hold locks only while a load reads them
        if tier.cache.protected_size and not tier.shared:
            raise AssertionError(f"idle but {tier.cache.protected_size} tokens of tier {tier.name!r} are locked")
    held = allocator.num_free + cache.evictable_size
    if held != allocator.capacity:
        raise AssertionError(f"slots leaked: free + evictable = {held} != {allocator.capacity}")
