"""``python -m experiments.eviction_oracles``: its conversation links, oracles, AUC and files, on tiny traces."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments import eviction_oracles as eo
from experiments.common import read_rows
from radixkv.cache import make_cache
from radixkv.cache.base import CacheHints
from radixkv.workloads.mooncake import trace_requests


def _records() -> list[dict]:
    """Two conversations over the common block 0: A (turns at 0, 10 and 100 s), B (one turn at 5 s), and C at
    20 s, which shares only block 0 with them (no parent)."""
    return [{"timestamp": 0, "input_length": 1500, "output_length": 8, "hash_ids": [0, 1, 2]},
            {"timestamp": 5_000, "input_length": 1500, "output_length": 8, "hash_ids": [0, 7, 8]},
            {"timestamp": 10_000, "input_length": 2500, "output_length": 8, "hash_ids": [0, 1, 2, 3, 4]},
            {"timestamp": 20_000, "input_length": 1000, "output_length": 8, "hash_ids": [0, 9]},
            {"timestamp": 100_000, "input_length": 3000, "output_length": 8, "hash_ids": [0, 1, 2, 3, 4, 5]}]


def test_links_follow_the_longest_shared_run_of_blocks_past_the_common_first_block():
    requests = trace_requests(_records())
    parents = eo.conversation_links(requests)
    assert parents == [-1, -1, 0, -1, 2]
    assert eo.conversation_links(requests, min_shared_blocks=1)[3] == 2  # block 0 alone: the latest owner
    gaps = eo.next_turn_gaps(requests, parents)
    assert gaps[0] == 10.0 and gaps[2] == 90.0 and np.isinf(gaps[[1, 3, 4]]).all()
    marked = eo.with_oracle(requests, gaps, 60.0)
    assert [r.priority for r in marked] == [1, 0, 0, 0, 0]
    assert [r.priority for r in eo.with_oracle(requests, gaps, math.inf)] == [1, 0, 1, 0, 0]


def test_features_see_only_the_past():
    requests = trace_requests(_records())
    feats = eo.features(requests, eo.conversation_links(requests))
    assert [f[0] for f in feats] == ["1", "1", "2", "1", "3"]
    assert feats[2][1] == "0-30 s" and feats[4][1] == "60-120 s" and feats[0][1] == "none"
    assert feats[3][2] == "0-2,000" and feats[4][2] == "2,000-5,000"


def test_cross_fitted_rates_come_from_the_other_half_of_the_trace():
    feats, gaps = [("a",), ("a",), ("a",), ("b",)], np.array([10.0, np.inf, 10.0, np.inf])
    assert eo.cross_fitted_rates(feats, gaps, 60.0, prior=0).tolist() == [1.0, 1.0, 0.5, 0.0]
    # a group the other half never saw gets that half's pooled rate (0.5), others shrink toward it
    assert eo.cross_fitted_rates(feats, gaps, 60.0, prior=2).tolist() == [2 / 3, 2 / 3, 0.5, 0.5]
    assert eo.cross_fitted_rates(feats, gaps, 5.0, prior=0).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rich_features_add_output_length_and_new_prompt_tokens():
    requests = trace_requests(_records())
    parents = eo.conversation_links(requests)
    rich = eo.rich_features(requests, parents, eo.features(requests, parents))
    assert [f[3] for f in rich] == ["0-50 out"] * 5
    # turn 2: 2,500 prompt tokens after a 1,500-token prompt and 8 output tokens; turn 1: all of it
    assert [f[4] for f in rich] == ["500-2,000 new", "500-2,000 new", "500-2,000 new", "500-2,000 new", "100-500 new"]
    assert rich[2][:3] == ("2", "0-30 s", "2,000-5,000")


def test_latest_hint_ranks_by_the_latest_requests_hint_then_lru():
    cache = make_cache("radix", page_size=1, eviction_policy=eo.LatestHint())
    keep, drop = CacheHints(priority=1), CacheHints(priority=0)
    cache.insert([1, 2], np.array([0, 1]), hints=keep)
    cache.insert([5, 6], np.array([2, 3]), hints=drop)
    cache.insert([8, 9], np.array([4, 5]), hints=keep)
    assert sorted(cache.evict(2).tolist()) == [2, 3]  # the unhinted one first, though not the least recent
    cache.match_prefix([1, 2], hints=drop)  # the latest request says it is over (priority keeps the highest)
    assert sorted(cache.evict(2).tolist()) == [0, 1]
    cache.check_invariants()


@pytest.mark.parametrize(("score", "label", "weight", "auc"), [
    ([1, 2, 3, 4], [0, 0, 1, 1], [1, 1, 1, 1], 1.0),
    ([4, 3, 2, 1], [0, 0, 1, 1], [1, 1, 1, 1], 0.0),
    ([1, 1, 1, 1], [0, 1, 0, 1], [1, 1, 1, 1], 0.5),
    ([1, 2, 3], [1, 0, 1], [1, 1, 2], 2 / 3),  # positives 1 (below the negative) and 3 (weight 2, above)
])
def test_weighted_auc(score, label, weight, auc):
    assert eo.weighted_auc(np.array(score, float), np.array(label, float), np.array(weight, float)) == \
        pytest.approx(auc)


def test_the_command_writes_runs_predictability_and_tables(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    out = tmp_path / "o"
    rows = eo.main(["--trace", str(trace), "--capacities", "2048,4096", "--arms", "lru,continues,belady",
                    "--out", str(out)])
    runs = [r for r in rows if "arm" in r]
    assert [(r["capacity_tokens"], r["arm"]) for r in runs] == [
        (c, a) for c in (2048, 4096) for a in ("lru", "continues", "belady")]
    assert all(r["page_size"] == 512 and r["trace"] == str(trace) and "env" in r for r in rows)
    written = read_rows(out.with_suffix(".jsonl"))  # JSON has no infinity: continues' horizon is null there
    assert [(r.get("arm"), r.get("hit_rate")) for r in written] == [(r.get("arm"), r.get("hit_rate")) for r in rows]
    assert written[-1]["kind"] == "predictability" and written[-1]["cells"] == 3
    text = (tmp_path / "o.md").read_text()
    assert "| continues |" in text and "Token-weighted AUC" in text
    assert (tmp_path / "o.png").exists()
    arms = ["group rates (hindsight)", "rich groups <= 60 s (hindsight)", "rich groups <= 300 s (cross-fitted)"]
    hindsight = eo.main(["--trace", str(trace), "--capacities", "2048", "--out", str(out), "--arms", ",".join(arms)])
    assert [(r["features"], r["oracle_horizon_s"], r["rank_horizon"], r["fit"]) for r in hindsight[:3]] == [
        ("base", math.inf, 6000.0, "hindsight"), ("rich", 60.0, 6000.0, "hindsight"), ("rich", 300.0, 2000.0, "cross")]
    assert hindsight[-1]["rich_cells"] == 3  # requests 0, 1 and 3 share one group
    assert "With output length and new prompt tokens" in (tmp_path / "o.md").read_text()
    with pytest.raises(ValueError, match="--arms"):
        eo.main(["--trace", str(trace), "--arms", "nope", "--out", str(out)])
    with pytest.raises(ValueError, match="--capacities"):
        eo.main(["--trace", str(trace), "--capacities", "0", "--out", str(out)])


def test_group_rates_are_each_feature_groups_continued_share():
    requests = trace_requests(_records())
    parents = eo.conversation_links(requests)
    rates, groups = eo.group_rates(eo.features(requests, parents), eo.next_turn_gaps(requests, parents))
    assert groups == 3
    assert [r.priority for r in eo.with_group_rates(requests, rates)] == [333, 333, 1000, 333, 0]
    within, _ = eo.group_rates(eo.features(requests, parents), eo.next_turn_gaps(requests, parents), 60.0)
    assert [round(1000 * x) for x in within] == [333, 333, 0, 333, 0]  # turn 2's continuation came 90 s later
    policy = eo.GroupRate(horizon=10.0)
    cache = make_cache("radix", page_size=1, eviction_policy=policy)
    cache.insert([1, 2], np.array([0, 1]), hints=CacheHints(priority=1000))
    cache.insert([5, 6], np.array([2, 3]), hints=CacheHints(priority=100))  # ln 0.1 x 10: 23 ticks earlier
    assert sorted(cache.evict(2).tolist()) == [2, 3]
