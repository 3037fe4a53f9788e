"""radixkv: a research engine for KV-cache prefix reuse in LLM inference."""

from radixkv.cache import (
    HashBlockCache,
    HashV0Cache,
    LockError,
    MatchResult,
    NoPrefixCache,
    PrefixCache,
    RadixCache,
    make_cache,
    match_for_prefill,
)
from radixkv.memory import OutOfSlotsError, SlotAllocator

__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine, model and KV pool need torch; importing them lazily keeps `import radixkv`
    # (caches, simulator) torch-free and fast.
    if name == "KVPool":
        from radixkv.memory.kv_pool import KVPool

        return KVPool
    if name in ("LLM", "RequestOutput"):
        from radixkv import engine

        return getattr(engine, name)
    if name in ("SamplingParams", "EngineConfig"):
        from radixkv import config

        return getattr(config, name)
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")


__all__ = [
    "LLM",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "HashBlockCache",
    "HashV0Cache",
    "KVPool",
    "LockError",
    "MatchResult",
    "NoPrefixCache",
    "OutOfSlotsError",
    "PrefixCache",
    "RadixCache",
    "SlotAllocator",
    "make_cache",
    "match_for_prefill",
]
