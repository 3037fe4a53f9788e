"""``KVPool`` lives in ``radixkv.memory.kv_pool``; this path stays importable."""

from __future__ import annotations

from radixkv.memory.kv_pool import KVPool

__all__ = ["KVPool"]
