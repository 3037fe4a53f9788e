"""Every eviction policy in the engine (``LLM(eviction_policy=...)``), alone and below a host tier: greedy
outputs do not depend on what the cache keeps, nothing leaks at idle, the request's priority reaches the
cache, and the server's CLI takes the policy and its parameters."""

from __future__ import annotations

import pytest

from radixkv import LLM, SamplingParams
from radixkv.cache.eviction import POLICIES
from radixkv.serve import parser
from tests.test_tiers_engine import GREEDY, sessions


def _serve(**settings) -> tuple[list, dict]:
    llm = LLM("tiny-random", chunked_prefill_size=64, kv_cache_tokens=384, **settings)
    outs = [[o.token_ids for o in llm.generate([c[t] for c in sessions()], GREEDY)] for t in range(3)]
    llm.check_idle()
    return outs, llm.stats()


@pytest.fixture(scope="module")
def lru_outputs() -> list:
    return _serve(eviction_policy="lru")[0]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_greedy_outputs_do_not_depend_on_the_policy(name, lru_outputs):
    outs, stats = _serve(eviction_policy=name, page_size=16)
    assert outs == lru_outputs
    assert stats["evictions"] > 0 and stats["saved_prefill_s"] > 0


@pytest.mark.parametrize("name", ["arc", "s3fifo", "learned", "ttl"])
def test_policies_hold_below_a_host_tier_too(name, lru_outputs):
    outs, stats = _serve(eviction_policy=name, page_size=16, host_kv_cache_tokens=2048)
    assert outs == lru_outputs and stats["hit_tokens_by_tier"]["host"] > 0


def test_the_request_priority_reaches_the_cache():
    llm = LLM("tiny-random", kv_cache_tokens=256, eviction_policy="priority")
    a, b, c = ([t % 400 + 3] * 100 for t in range(3))  # three unrelated 100-token prompts
    llm.generate([a], SamplingParams(max_new_tokens=2, priority=7))
    llm.generate([b], SamplingParams(max_new_tokens=2, priority=1))
    llm.generate([c], SamplingParams(max_new_tokens=2))  # must evict: the priority-1 prompt goes, not the older a
    assert llm.generate([a], SamplingParams(max_new_tokens=1))[0].num_cached_tokens == 99
    assert llm.generate([b], SamplingParams(max_new_tokens=1))[0].num_cached_tokens == 0


def test_cli_takes_the_policy_and_its_parameters():
    args = parser().parse_args(["tiny-random", "--eviction-policy", "ttl", "--eviction-params", '{"ttl": 5}'])
    assert args.eviction_policy == "ttl" and args.eviction_params == {"ttl": 5}
    with pytest.raises(SystemExit):
        parser().parse_args(["tiny-random", "--eviction-policy", "belady"])
    with pytest.raises(ValueError, match="ttl"):
        LLM("tiny-random", eviction_policy="ttl", eviction_params={"ttl": -1})
