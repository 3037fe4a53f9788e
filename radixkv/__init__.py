"""radixkv: a research engine for KV-cache prefix reuse in LLM inference."""

from radixkv.cache import (
    HashBlockCache,
    LockError,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    RadixCache,
    match_for_prefill,
)
from radixkv.memory import OutOfSlotsError, SlotAllocator

__version__ = "0.1.0"


def __getattr__(name: str):
    # KVPool needs torch; importing it lazily keeps `import radixkv` (caches, simulator) torch-free and fast.
    if name == "KVPool":
        from radixkv.kv_pool import KVPool

        return KVPool
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")


__all__ = [
    "HashBlockCache",
    "KVPool",
    "LockError",
    "MatchResult",
    "NoPrefixCache",
    "OutOfSlotsError",
    "PrefixCache",
    "RadixCache",
    "SlotAllocator",
    "match_for_prefill",
]
