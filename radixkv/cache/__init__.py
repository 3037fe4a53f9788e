"""Prefix caches behind one interface (:class:`PrefixCache`)."""

from radixkv.cache.base import LockError, MatchResult, PrefixCache, match_for_prefill
from radixkv.cache.eviction import POLICIES
from radixkv.cache.factory import CACHES, make_cache
from radixkv.cache.hash_block import HashBlockCache
from radixkv.cache.hash_v0 import HashV0Cache
from radixkv.cache.none import NoPrefixCache
from radixkv.cache.radix import RadixCache, RadixNode

__all__ = [
    "CACHES",
    "HashBlockCache",
    "HashV0Cache",
    "LockError",
    "MatchResult",
    "NoPrefixCache",
    "POLICIES",
    "PrefixCache",
    "RadixCache",
    "RadixNode",
    "make_cache",
    "match_for_prefill",
]
