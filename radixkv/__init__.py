"""radixkv: a research engine for KV-cache prefix reuse in LLM inference."""

import importlib

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

# The engine, model and KV pool need torch; importing them lazily keeps `import radixkv` (caches, simulator)
# torch-free and fast: each such name -> the module that defines it.
_LAZY = {"KVPool": "radixkv.memory.kv_pool", "LLM": "radixkv.engine", "RequestOutput": "radixkv.engine",
         "SamplingParams": "radixkv.config", "EngineConfig": "radixkv.config"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


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
