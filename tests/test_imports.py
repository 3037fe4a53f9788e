"""The research core imports neither torch nor matplotlib: caches, simulator, workloads and scheduling run
(and load fast) where neither is installed. Each import runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = ["radixkv", "radixkv.cache", "radixkv.sim", "radixkv.workloads", "radixkv.scheduling",
              "radixkv.config", "radixkv.checks", "radixkv.routing"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_research_core_imports_neither_torch_nor_matplotlib(module):
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'matplotlib') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"import {module} imported {out.stdout.strip()}"


def test_make_cache_is_the_one_factory():
    from radixkv import HashBlockCache, NoPrefixCache, RadixCache, make_cache
    from radixkv.cache import CACHES
    from radixkv.config import PREFIX_CACHES

    assert CACHES == PREFIX_CACHES == ("radix", "hash", "hash-v0", "none")
    radix = make_cache("radix", page_size=4, eviction_policy="lfu")
    assert isinstance(radix, RadixCache) and radix.page_size == 4
    assert isinstance(make_cache("hash", block_size=8), HashBlockCache)
    assert isinstance(make_cache("none"), NoPrefixCache)
    for bad in [dict(name="lru-tree"), dict(name="radix", eviction_policy="clock"), dict(name="hash", colour=1),
                dict(name="hash", eviction_policy="belady")]:
        with pytest.raises(ValueError):
            make_cache(**bad)
