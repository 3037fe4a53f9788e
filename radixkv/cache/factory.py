"""``make_cache``: every prefix cache by name, the one factory the engine, the simulator and the experiments use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixkv.cache.base import PrefixCache
from radixkv.cache.eviction import make_policy
from radixkv.cache.hash_block import HashBlockCache
from radixkv.cache.hash_v0 import HashV0Cache
from radixkv.cache.none import NoPrefixCache
from radixkv.cache.radix import RadixCache

CACHES = ("radix", "hash", "hash-v0", "none")


def make_cache(name: str, *, page_size: int = 1, block_size: int = 16, eviction_policy: str = "lru",
               eviction_params: Mapping[str, Any] | None = None, **options: Any) -> PrefixCache:
    """A prefix cache by name: ``radix`` (``RadixCache(page_size, eviction_policy)``), ``hash``
    (``HashBlockCache(block_size, eviction_policy)``), ``hash-v0`` (``HashV0Cache(block_size)``, vLLM v0's APC,
    whose only policy is ``lru``: v0's evictor) or ``none`` (``NoPrefixCache``, which takes nothing).

    ``page_size`` is the radix tree's granularity (tokens per KV page it matches in) and ``block_size`` the
    hash caches' (tokens per hashed block); each cache reads its own. A policy that ``needs_future`` (the
    clairvoyant reference, radix only) is handed ``future=FutureUses(...)`` (what the simulator knows of the
    arrivals). ``eviction_params`` are the policy's parameters (``make_policy(eviction_policy, **params)``,
    :mod:`radixkv.cache.eviction`). Unknown names, options, policies and parameters raise ``ValueError``.
    """
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; choose one of {list(CACHES)}")
    future = options.pop("future", None)  # for a policy that needs_future
    if options:
        raise ValueError(f"make_cache({name!r}) takes no options {sorted(options)}")
    if future is not None and name not in ("radix", "hash"):
        raise ValueError(f"future= goes to a radix or hash cache's policy, not to {name!r}")
    params = dict(eviction_params or {})
    if name in ("radix", "hash"):
        policy = make_policy(eviction_policy, future, **params)
        if name == "radix":
            return RadixCache(page_size=page_size, eviction_policy=policy)
        return HashBlockCache(block_size=block_size, eviction_policy=policy)
    if params:
        raise ValueError(f"the {name!r} cache takes no eviction_params")
    if name == "hash-v0":
        return HashV0Cache(block_size=block_size, eviction_policy=eviction_policy)
    return NoPrefixCache()
