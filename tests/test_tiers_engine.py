"""The engine with a host tier (``LLM(host_kv_cache_tokens=N)``): a second KV buffer with real copies. Greedy
outputs equal an engine with one pool large enough for both; stats split hits by tier; a host copy equals
the device copy bit for bit; the CLI's spellings (the fault contract: tests/test_faults.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv import LLM, SamplingParams
from radixkv.serve import parser

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def sessions(turns: int = 3) -> list[list[list[int]]]:
    """Eight conversations of ``turns`` prompts, each turn extending the last (a shared 120-token system
    prompt), generated once so every engine sees the same tokens."""
    rng = np.random.default_rng(0)
    system = rng.integers(3, 500, 120).tolist()
    convs = [[system + rng.integers(3, 500, 30).tolist()] for _ in range(8)]
    for conv in convs:
        for _ in range(turns - 1):
            conv.append(conv[-1] + rng.integers(3, 500, 40).tolist())
    return convs


def serve(**settings) -> tuple[list, dict, LLM]:
    llm = LLM("tiny-random", chunked_prefill_size=64, **settings)
    outs = [[o.token_ids for o in llm.generate([c[t] for c in sessions()], GREEDY)] for t in range(3)]
    llm.check_idle()
    return outs, llm.stats(), llm


@pytest.mark.parametrize("cache, geometry", [("radix", {"page_size": 1}), ("radix", {"page_size": 16}),
                                             ("hash", {"block_size": 16}),
                                             ("radix", {"page_size": 16, "host_layout": "segments"}),
                                             ("radix", {"page_size": 16, "host_layout": "chains"})])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_greedy_outputs_equal_one_big_pool(cache, geometry, policy):
    small, stats, llm = serve(prefix_cache=cache, kv_cache_tokens=384, host_kv_cache_tokens=4096,
                              write_policy=policy, write_threshold=1, **geometry)
    geometry = {k: v for k, v in geometry.items() if k != "host_layout"}  # the big pool has no host tier
    big, big_stats, _ = serve(prefix_cache=cache, kv_cache_tokens=384 + 4096, **geometry)
    assert small == big
    by_tier = stats["hit_tokens_by_tier"]
    assert sum(by_tier.values()) == stats["cached_tokens"]
    assert by_tier["host"] > 0 and stats["loaded_tokens"] >= by_tier["host"] and stats["written_tokens"] > 0
    assert big_stats["hit_tokens_by_tier"] == {"device": big_stats["cached_tokens"], "host": 0}
    assert big_stats["loaded_tokens"] == big_stats["written_tokens"] == 0
    assert llm.cache_state()["tiers"]["host"]["capacity"] == 4096


def test_a_host_copy_equals_the_device_copy_bit_for_bit():
    _, _, llm = serve(kv_cache_tokens=512, host_kv_cache_tokens=2048, dtype="bfloat16")
    host_tier = llm.cache.tiers[0]
    host, device = llm.mover.pools["host"], llm.pool
    compared = 0
    for conv in sessions():
        for prompt in conv:
            h = host_tier.cache.match_prefix(prompt)
            d = llm.cache.device.match_prefix(prompt)
            n = min(h.length, d.length)
            kv_h = host.gather(torch.as_tensor(h.indices[:n]))
            kv_d = device.gather(torch.as_tensor(d.indices[:n]))
            assert torch.equal(kv_h, kv_d)
            compared += n
    assert compared > 0


def test_hicache_ratio_sizes_the_host_tier_from_the_pool():
    llm = LLM("tiny-random", kv_cache_tokens=256, page_size=16, hicache_ratio=2.5)
    assert llm.config.host_kv_cache_tokens == 640 and llm.cache.tiers[0].allocator.capacity == 640
    with pytest.raises(ValueError, match="hicache_ratio"):
        LLM("tiny-random", kv_cache_tokens=256, hicache_ratio=2, host_kv_cache_tokens=512)
    with pytest.raises(ValueError, match="hicache_ratio"):
        LLM("tiny-random", kv_cache_tokens=256, hicache_ratio=0)
    with pytest.raises(ValueError, match="write_policy"):
        LLM("tiny-random", host_kv_cache_tokens=512, write_policy="write_sometimes")
    with pytest.raises(ValueError, match="tiers work with"):
        LLM("tiny-random", prefix_cache="hash-v0", host_kv_cache_tokens=512)


def test_flush_cache_empties_the_host_tier_too():
    _, _, llm = serve(kv_cache_tokens=512, host_kv_cache_tokens=2048)
    assert llm.cache.tiers[0].cache.total_size > 0
    llm.flush_cache()
    assert llm.cache.total_size == 0 and llm.cache.tiers[0].cache.total_size == 0
    llm.check_idle()


def test_cli_spells_the_tier_as_sglang_does():
    args = parser().parse_args(["tiny-random", "--host-kv-cache-tokens", "4096", "--hicache-write-policy",
                                "write_back", "--write-threshold", "3"])
    assert (args.host_kv_cache_tokens, args.write_policy, args.write_threshold) == (4096, "write_back", 3)
    assert parser().parse_args(["tiny-random", "--hicache-ratio", "2"]).hicache_ratio == 2.0
    assert parser().parse_args(["tiny-random"]).host_kv_cache_tokens is None


def test_metrics_count_hits_per_tier():
    """A prompt pushed out of a 64-token pool by others comes back from the host tier: ``/metrics`` counts it
    under vLLM's external prefix cache names and per tier, and ``cached_tokens`` counts every tier."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_fixture import running_server

    def metrics(base: str) -> dict:
        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
            for sample in family.samples:
                out[(sample.name, sample.labels.get("tier"))] = sample.value
        return out

    first = list(range(3, 51))
    with running_server("tiny-random", "--kv-cache-tokens", "64", "--host-kv-cache-tokens", "512") as (base, _):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        ask = lambda p: c.completions.create(model="tiny-random", prompt=p, max_tokens=2, temperature=0)  # noqa: E731
        ask(first)
        ask(list(range(100, 148)))  # evicts ``first`` from the 64-token device pool
        again = ask(first)
        assert again.usage.prompt_tokens_details.cached_tokens == len(first) - 1
        m = metrics(base)
    assert m[("radixkv:external_prefix_cache_hits_total", None)] == len(first) - 1
    assert m[("radixkv:external_prefix_cache_queries_total", None)] >= 3 * len(first) - 3
    assert m[("radixkv:prefix_cache_hits_by_tier_total", "host")] == len(first) - 1
    assert m[("radixkv:prefix_cache_hits_by_tier_total", "device")] == m[("radixkv:prefix_cache_hits_total", None)] \
        - (len(first) - 1)


def test_a_storage_tier_below_the_host_serves_the_same_outputs_from_a_file():
    small, stats, llm = serve(kv_cache_tokens=384, host_kv_cache_tokens=512, storage_capacity_tokens=4096)
    big, _, _ = serve(kv_cache_tokens=384 + 4096)
    assert small == big
    assert [t.name for t in llm.cache.tiers] == ["host", "storage"]
    by_tier = stats["hit_tokens_by_tier"]
    assert sum(by_tier.values()) == stats["cached_tokens"] and by_tier["storage"] > 0
    assert llm.cache_state()["tiers"]["storage"]["capacity"] == 4096
