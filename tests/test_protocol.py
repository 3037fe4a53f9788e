"""The cache contract: ``PrefixCache`` lists every member its callers use and each cache implements exactly
it (plus what its policy may ask, ``EntryCache``, and the inspection helpers docs/cache_semantics.md names);
tiers and policies are data and capabilities, never names or types tested outside ``radixkv/cache/``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from radixkv.cache.base import PrefixCache
from radixkv.cache.eviction import EVERY_POLICY, needs_future
from radixkv.cache.eviction.base import EntryCache
from radixkv.cache.factory import CACHES, make_cache
from radixkv.cache.tiered import Tier, TieredCache
from radixkv.memory import SlotAllocator

ROOT = Path(__file__).resolve().parents[1] / "radixkv"
INSPECTION = {  # read-only helpers for notebooks, experiments and tests, not part of the contract
    "RadixCache": {"num_nodes", "root", "root_of", "namespace_of", "eviction_policy", "policy"},
    "HashBlockCache": {"num_blocks", "root", "block_keys", "MEMO_CHAINS", "MEMO_ENTRIES", "eviction_policy", "policy",
                       "block_size", "hash_algo"},
    "HashV0Cache": {"num_blocks", "root", "hash_algo", "hash_of_block", "stranded", "eviction_policy", "block_size"},
    "NoPrefixCache": {"root", "eviction_policy"},
    "TieredCache": {"device", "mover", "worth_loading", "write_policy", "write_threshold", "copies",
                    "eviction_policy"},
}


def members(protocol: type) -> set[str]:
    return {n for n in dir(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


def every_cache() -> list:
    caches = [make_cache(name, block_size=4) for name in CACHES]
    lower = make_cache("radix")
    caches.append(TieredCache(make_cache("radix"), [Tier("host", lower, SlotAllocator(64))]))
    return caches


@pytest.mark.parametrize("cache", every_cache(), ids=lambda c: type(c).__name__)
def test_each_cache_implements_exactly_the_protocol(cache):
    proto = members(PrefixCache)
    have = {n for n in dir(cache) if not n.startswith("_")}
    assert proto <= have, f"{type(cache).__name__} lacks {sorted(proto - have)}"
    for name in proto:
        want = getattr(PrefixCache, name, None)
        if inspect.isfunction(want):
            assert list(inspect.signature(getattr(cache, name)).parameters) == \
                list(inspect.signature(want).parameters)[1:], f"{type(cache).__name__}.{name}"
    extra = have - proto - members(EntryCache) - INSPECTION[type(cache).__name__]
    assert not extra, f"{type(cache).__name__} has public members outside the contract: {sorted(extra)}"


@pytest.mark.parametrize("name", ["radix", "hash"])
def test_caches_with_policies_answer_what_policies_ask(name):
    cache = make_cache(name, block_size=4)
    assert members(EntryCache) <= {n for n in dir(cache) if not n.startswith("_")}
    cache.insert(np.arange(16), np.arange(16))
    assert cache.plan_load(np.arange(16), cache.match_prefix(np.arange(15))).length == 0
    assert cache.take_copies() == [] and cache.loaded_tokens == {} and cache.tiers == ()


def _source_nodes(skip: tuple[str, ...]):
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(skip):
            for node in ast.walk(ast.parse(path.read_text())):
                yield rel, node


def test_no_tier_test_by_type_or_attribute_outside_the_cache_package():
    found = []
    for rel, node in _source_nodes(("cache/",)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "getattr", "hasattr"):
            text = ast.unparse(node)
            if "Tiered" in text or "tiers" in text or "Tier" in text:
                found.append(f"{rel}:{node.lineno} {text}")
    assert found == []


def test_tier_names_are_written_only_in_the_tier_specs():
    found = [f"{rel}:{node.lineno} {node.value!r}" for rel, node in _source_nodes(("cache/tiers.py",))
             if isinstance(node, ast.Constant) and node.value in ("host", "storage", "device")
             and rel != "config.py"]  # config.py reads torch's type name ``device``, not a tier's
    assert found == []


def test_the_clairvoyant_policy_is_named_only_in_its_module_and_the_registry():
    found = [f"{rel}:{getattr(node, 'lineno', '?')}" for rel, node in _source_nodes(("cache/eviction/",))
             if (isinstance(node, ast.Constant) and node.value == "belady")
             or (isinstance(node, ast.Name | ast.alias) and "belady" in (getattr(node, "id", None)
                                                                        or getattr(node, "name", "")).lower())]
    assert found == []
    assert [name for name in EVERY_POLICY if needs_future(name)] == ["belady"]
