"""``saved_prefill_s``: the prefill seconds the cache saved under the cost model, for a prompt of n tokens
whose admission hit h, ``cost.prefill_time(n, 0) - cost.prefill_time(n - h, h)``; in ``SimResult`` (total,
summary, per-request rows), ``ClusterResult`` (over replicas) and ``LLM.stats()`` (priced by ``CostModel()``)."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import LLM, SamplingParams
from radixkv.sim import CostModel, simulate, simulate_cluster
from radixkv.workloads import make
from radixkv.workloads.request import Request

COST = CostModel(prefill_per_token=1.0, attention_per_pair=0.5)  # round numbers to check by hand


def _multi_turn() -> list[Request]:
    return make("multi_turn", seed=0, sessions=4, turns=3, system_tokens=64, user_tokens=24, output_tokens=8)


def test_the_formula_and_its_closed_form():
    assert COST.saved_prefill_time(12, 0) == 0.0
    # n = 12, h = 8: (12 + 0.5 * 12 * 13 / 2) - (4 + 0.5 * 4 * (8 + 5 / 2)) = 51 - 25
    assert COST.saved_prefill_time(12, 8) == 26.0
    cost = CostModel()
    for n, h in [(1, 0), (100, 37), (4096, 4000)]:  # per token plus the pairs among the cached tokens
        closed = cost.prefill_per_token * h + cost.attention_per_pair * h * (h + 1) / 2
        assert cost.saved_prefill_time(n, h) == pytest.approx(closed, rel=1e-12)


def test_nothing_saved_without_hits():
    reqs = _multi_turn()
    for res in (simulate(reqs, cache="none", cost_model=COST),
                simulate(make("no_sharing", seed=0, requests=6), cache="radix", cost_model=COST)):
        assert res.hit_tokens == 0
        assert res.saved_prefill_s == 0.0 and res.summary()["saved_prefill_s"] == 0.0
        assert all(row["saved_prefill_s"] == 0.0 for row in res.per_request)


def test_two_requests_sharing_a_prefix_by_hand():
    prefix = np.arange(100, 108)
    first = Request(0.0, "a", np.concatenate([prefix, [1, 2]]), 2)
    second = Request(50.0, "b", np.concatenate([prefix, [3, 4, 5, 6]]), 2)  # sent once the first is done
    res = simulate([first, second], cache="radix", capacity_tokens=None, cost_model=COST)
    assert [row["hit"] for row in res.per_request] == [0, 8]
    assert [row["saved_prefill_s"] for row in res.per_request] == [0.0, 26.0]  # n = 12, h = 8, as above
    assert res.saved_prefill_s == 26.0 and res.summary()["saved_prefill_s"] == 26.0


def test_a_multi_turn_workload_saves_time_and_the_total_is_its_rows():
    res = simulate(_multi_turn(), cache="radix")
    rows = res.per_request
    assert res.saved_prefill_s > 0
    assert res.saved_prefill_s == pytest.approx(sum(r["saved_prefill_s"] for r in rows))
    cost = CostModel()
    assert all(r["saved_prefill_s"] == cost.saved_prefill_time(r["prompt_len"], r["hit"]) for r in rows)


def test_hits_from_every_tier_count():
    reqs = _multi_turn()
    res = simulate(reqs, cache="radix", capacity_tokens=256, host_capacity_tokens=8192)
    assert res.hit_tokens_by_tier.get("host", 0) > 0  # some hits came from the host tier
    cost = CostModel()
    for row in res.per_request:
        assert row["hit"] == sum(row["hit_by_tier"].values())
        assert row["saved_prefill_s"] == cost.saved_prefill_time(row["prompt_len"], row["hit"])
    assert res.saved_prefill_s == pytest.approx(sum(r["saved_prefill_s"] for r in res.per_request))


def test_a_cluster_sums_its_replicas():
    res = simulate_cluster(_multi_turn(), replicas=2, router="round_robin", references=False, cache="radix")
    each = [r.saved_prefill_s for r in res.replicas]
    assert all(s > 0 for s in each)
    assert res.saved_prefill_s == pytest.approx(sum(each)) and res.summary()["saved_prefill_s"] == res.saved_prefill_s


def test_the_engine_prices_its_hits_with_the_cpu_preset():
    shared = list(range(3, 60))
    prompts = [shared + [101, 102], shared + [103, 104, 105]]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    llm = LLM("tiny-random", kv_cache_tokens=1024)
    outs = [llm.generate([p], params)[0] for p in prompts]  # one after the other: the second hits the first
    assert outs[1].num_cached_tokens > 0
    want = sum(CostModel().saved_prefill_time(o.num_prompt_tokens, o.num_cached_tokens) for o in outs)
    assert llm.stats()["saved_prefill_s"] == pytest.approx(want) and want > 0
    llm.reset_stats()
    assert llm.stats()["saved_prefill_s"] == 0.0
    none = LLM("tiny-random", kv_cache_tokens=1024, prefix_cache="none")
    for p in prompts:
        none.generate([p], params)
    assert none.stats()["saved_prefill_s"] == 0.0
