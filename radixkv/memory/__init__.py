"""KV memory: the slot allocator (``allocator``: which KV slots are free, page-aligned; torch-free) and the
KV pool (``kv_pool``: the per-layer K/V tensors those slots index; needs torch, so import it from
``radixkv.memory.kv_pool``)."""

from __future__ import annotations

from radixkv.memory.allocator import OutOfSlotsError, SlotAllocator

__all__ = ["OutOfSlotsError", "SlotAllocator"]
