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

__all__ = [
    "HashBlockCache",
    "LockError",
    "MatchResult",
    "NoPrefixCache",
    "OutOfSlotsError",
    "PrefixCache",
    "RadixCache",
    "SlotAllocator",
    "match_for_prefill",
]
