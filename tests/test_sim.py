"""The simulator, the bounds, the scheduling policies and the workloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from radixkv import workloads
from radixkv.scheduling import POLICIES, make_policy
from radixkv.sim import CostModel, simulate, upper_bound
from radixkv.workloads import Request
from radixkv.workloads.mooncake import read_trace, trace_upper_bound

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"

SMALL = {
    "multi_turn": dict(sessions=4, turns=3, user_tokens=(20, 40), output_tokens=(3, 6)),
    "shared_prefix": dict(groups=4, prompts_per_group=4, system_tokens=64, question_tokens=16, output_tokens=8),
    "few_shot": dict(subjects=3, questions_per_subject=4, prefix_tokens=(40, 80), question_tokens=(8, 16)),
    "tree_of_thought": dict(trees=2, branching=2, depth=2, problem_tokens=(30, 50), thought_tokens=(5, 10)),
    "self_consistency": dict(questions=3, samples=4, prompt_tokens=(30, 60), output_tokens=(4, 8)),
    "no_sharing": dict(requests=12, prompt_tokens=(20, 40), output_tokens=(2, 6)),
}


def req(prompt, output, rid, parent=None, arrival=0.0):
    return Request(arrival=arrival, session=0, prompt=prompt, output_len=len(output), output=output,
                   parent=parent, rid=rid)


# ---------------------------------------------------------------- upper bound
def test_upper_bound_two_prompts_sharing_a_prefix():
    reqs = [req([1, 2, 3, 4], [9], 0), req([1, 2, 3, 5], [9], 1)]
    assert upper_bound(reqs) == pytest.approx(3 / 8)


def test_upper_bound_identical_prompts_recompute_the_last_token():
    reqs = [req([1, 2, 3, 4], [9], 0), req([1, 2, 3, 4], [9], 1), req([1, 2, 3, 4], [9], 2)]
    assert upper_bound(reqs) == pytest.approx(6 / 12)  # each later one hits 3 of its 4


def test_upper_bound_counts_previous_answers_as_cached():
    first = req([1, 2, 3], [7, 8, 9], 0)
    second = req([1, 2, 3, 7, 8, 9, 5], [4], 1, parent=0)
    # second hits 1,2,3 (prompt of first) and 7,8 (first's answer, all but its last token)
    assert upper_bound([first, second]) == pytest.approx(5 / 10)


def test_upper_bound_page_granularity():
    reqs = [req([1, 2, 3, 4, 5, 6], [9], 0), req([1, 2, 3, 4, 5, 7], [9], 1)]
    assert upper_bound(reqs, page_size=1) == pytest.approx(5 / 12)
    assert upper_bound(reqs, page_size=4) == pytest.approx(4 / 12)


def test_upper_bound_nothing_shared():
    reqs = workloads.make("no_sharing", **SMALL["no_sharing"])
    assert upper_bound(reqs) == 0.0


# ---------------------------------------------------------------- simulator
def brute_force_hits(reqs: list[Request]) -> int:
    """Sequential, unlimited: each request hits its longest prefix (<= len-1) computed before."""
    seen: set[tuple] = set()
    hits = 0
    for r in reqs:
        p = r.prompt.tolist()
        h = 0
        for k in range(len(p) - 1, 0, -1):
            if tuple(p[:k]) in seen:
                h = k
                break
        hits += h
        seq = p + (r.output.tolist()[:-1] if r.output is not None else [])
        seen.update(tuple(seq[:k]) for k in range(1, len(seq) + 1))
    return hits


@pytest.mark.parametrize("name", sorted(SMALL))
def test_sim_hits_equal_brute_force_count(name):
    reqs = workloads.make(name, seed=1, **SMALL[name])
    res = simulate(reqs, cache="radix", max_running=1)
    assert res.hit_tokens == brute_force_hits(reqs)
    assert res.prompt_tokens == sum(r.prompt_len for r in reqs)
    assert res.computed_tokens == res.prompt_tokens - res.hit_tokens
    assert len(res.per_request) == len(reqs) and res.rejected == 0


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_order_reaches_upper_bound_when_capacity_holds_longest_request(policy):
    reqs = workloads.make("few_shot", seed=2, **SMALL["few_shot"])
    longest = max(r.prompt_len + r.output_len for r in reqs)
    res = simulate(reqs, cache="radix", capacity_tokens=longest, schedule_policy=policy, max_running=1)
    assert res.hit_rate == pytest.approx(upper_bound(reqs))
    fcfs = simulate(reqs, cache="radix", capacity_tokens=longest, schedule_policy="fcfs", max_running=1)
    assert fcfs.hit_rate < res.hit_rate


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("regime", [dict(max_running=1), dict(schedule_policy="lpm", in_batch_sharing=4)])
def test_radix_hits_at_least_hash_at_equal_capacity(name, regime):
    """Radix (page 1) holds a superset of what hash blocks hold, so it hits at least as much.

    Two regimes keep the comparison about the caches: requests served one at a
    time, or batched with in-batch prefix sharing. Without either, a cache that
    hits more lets more requests into the first batch, where they cannot hit
    each other (a batching effect, measured in docs/experiments.md); and
    under heavy memory pressure whole-leaf eviction can free more than block
    eviction needs.
    """
    reqs = workloads.make(name, seed=3, **SMALL[name])
    total = sum(r.prompt_len + r.output_len for r in reqs)
    for capacity in (None, total // 2, 3 * total // 4):
        for block in (4, 16):
            radix = simulate(reqs, cache="radix", capacity_tokens=capacity, **regime)
            hashed = simulate(reqs, cache="hash", capacity_tokens=capacity, block_size=block, **regime)
            assert radix.hit_tokens >= hashed.hit_tokens, (capacity, block)
    assert simulate(reqs, cache="none", capacity_tokens=total // 2).hit_tokens == 0


def test_eviction_runs_and_conserves_slots_under_pressure():
    reqs = workloads.make("multi_turn", seed=4, **SMALL["multi_turn"])
    longest = max(r.prompt_len + r.output_len for r in reqs)
    res = simulate(reqs, cache="radix", capacity_tokens=longest + 8, schedule_policy="lpm")
    assert res.evicted_tokens > 0 and res.rejected == 0
    assert res.hit_rate <= upper_bound(reqs) + 1e-12


def test_request_that_can_never_fit_is_rejected_and_counted():
    reqs = [req(list(range(100)), [1, 2], 0), req([5, 6, 7], [1], 1)]
    res = simulate(reqs, cache="radix", capacity_tokens=50)
    assert res.rejected == 1 and res.prompt_tokens == 3
    assert [r["rejected"] for r in res.per_request] == [True, False]


def test_belady_is_at_least_lru():
    reqs = workloads.make("shared_prefix", seed=5, groups=6, prompts_per_group=5, system_tokens=64,
                          question_tokens=16, output_tokens=4)
    cap = 200
    lru = simulate(reqs, cache="radix", capacity_tokens=cap, max_running=1)
    opt = simulate(reqs, cache="radix", capacity_tokens=cap, max_running=1, eviction_policy="belady")
    assert opt.hit_tokens >= lru.hit_tokens
    with pytest.raises(ValueError):
        simulate(reqs, cache="hash", eviction_policy="belady")


def test_in_batch_sharing_lets_samples_hit_the_first():
    reqs = workloads.make("self_consistency", seed=6, **SMALL["self_consistency"])
    plain = simulate(reqs, cache="radix")
    shared = simulate(reqs, cache="radix", in_batch_sharing=16)
    assert plain.hit_rate < shared.hit_rate == pytest.approx(upper_bound(reqs))


def test_turns_wait_for_their_parent():
    reqs = workloads.make("multi_turn", seed=7, think_time=1.0, **SMALL["multi_turn"])
    rows = {r["rid"]: r for r in simulate(reqs).per_request}
    for r in reqs:
        if r.parent is not None:
            assert rows[r.rid]["ready"] >= rows[r.parent]["finish"] + 1.0 - 1e-9
            assert rows[r.rid]["ttft"] > 0


def test_after_holds_a_request_until_every_named_one_has_finished():
    """A barrier: session 0's second turn is sent when session 1's longer turn ends, not when its own does."""
    first = req([1, 2, 3], [7], 0)
    other = req([4, 5, 6], [7, 8, 9, 10, 11], 1)
    second = Request(arrival=0.0, session=0, prompt=[1, 2, 3, 5], output_len=1, parent=0, rid=2, after=(1,))
    rows = {r["rid"]: r for r in simulate([first, other, second]).per_request}
    assert rows[0]["finish"] < rows[1]["finish"] == pytest.approx(rows[2]["ready"])


def test_part_of_a_workload_keeps_its_links_by_rid():
    """Filtered by session, rids are no longer positions: parent links still name the right requests."""
    reqs = workloads.make("multi_turn", seed=7, think_time=1.0, **SMALL["multi_turn"])
    part = [r for r in reqs if r.session in (1, 3)]
    assert any(r.rid != i for i, r in enumerate(part))
    rows = simulate(part).per_request
    by_prompt = {r.prompt.tobytes(): row for r, row in zip(sorted(part, key=lambda r: r.arrival), rows, strict=True)}
    for r in part:
        if r.parent is not None:
            parent = reqs[r.parent]
            assert by_prompt[r.prompt.tobytes()]["ready"] >= by_prompt[parent.prompt.tobytes()]["finish"] + 1.0 - 1e-9
    with pytest.raises(ValueError, match="by rid"):
        simulate([r for r in reqs if r.session == 1 and r.parent is not None])  # first turns left out


def test_links_to_no_request_or_in_a_cycle_are_clear_errors():
    a, b = req([1, 2], [3], 0, parent=1), req([1, 4], [3], 1, parent=0)
    with pytest.raises(ValueError, match="never sent"):
        simulate([a, b])
    for links in (dict(parent=5), dict(after=(0,)), dict(after=(-1,))):
        with pytest.raises(ValueError, match="must name other requests"):
            simulate([Request(arrival=0.0, session=0, prompt=[1, 2], output_len=1, rid=0, **links)])
    for after in (("x",), 5, (True,)):
        with pytest.raises(ValueError, match="request ids"):
            Request(arrival=0.0, session=0, prompt=[1], output_len=1, after=after)
    with pytest.raises(ValueError, match="not positions"):
        workloads.request.number([Request(arrival=0.0, session=0, prompt=[1], output_len=1, after=(3,))])


def test_chunked_prefill_under_a_token_budget_schedules_as_the_engine():
    """Running requests first (a decode each, or their next chunk), then admissions, under both budgets."""
    reqs = [req(list(range(100 * i, 100 * i + 10)), [7, 8, 9], i) for i in range(3)]
    cost = CostModel(prefill_per_token=1.0, attention_per_pair=0.0, decode_step=0.0, decode_per_seq=0.0,
                     step_overhead=1.0)
    res = simulate(reqs, cache="none", max_batch_tokens=16, chunked_prefill_size=8, cost_model=cost)
    assert res.steps == [(16, 72.0, 0, 1), (12, 74.0, 0, 1), (2, 19.0, 2, 1), (0, 0.0, 3, 1), (0, 0.0, 1, 1)]
    assert [r["ttft"] for r in res.per_request] == [30.0, 30.0, 33.0]
    assert res.config["max_batch_tokens"] == 16 and res.config["chunked_prefill_size"] == 8
    whole = simulate(reqs, cache="none", cost_model=cost)  # no budgets: every prompt whole in one step
    assert whole.steps[0] == (30, 3 * 10 * 5.5, 0, 1) and [r["ttft"] for r in whole.per_request] == [31.0] * 3


def test_cost_model_terms():
    cm = CostModel(prefill_per_token=1.0, attention_per_pair=0.5, decode_step=2.0, decode_per_seq=0.25)
    assert cm.prefill_time(2, 3) == pytest.approx(2 + 0.5 * 2 * (3 + 1.5))
    assert cm.decode_time(4) == pytest.approx(3.0) and cm.decode_time(0) == 0.0


def test_hand_made_requests_need_no_numbering():
    a = Request(arrival=1.0, session=0, prompt=[1, 2, 3, 4], output_len=2)
    b = Request(arrival=0.0, session=0, prompt=[1, 2, 3, 5], output_len=2)
    res = simulate([a, b], max_running=1)
    assert [r["prompt_len"] for r in res.per_request] == [4, 4] and res.hit_tokens == 3


def test_simulate_rejects_bad_arguments():
    reqs = workloads.make("no_sharing", **SMALL["no_sharing"])
    with pytest.raises(ValueError):
        simulate(reqs, cache="lru-tree")
    with pytest.raises(ValueError):
        simulate(reqs, schedule_policy="shortest-first")
    with pytest.raises(ValueError):
        simulate(reqs, eviction_policy="clock")
    for budgets in (dict(max_batch_tokens=0), dict(chunked_prefill_size=1.5), dict(max_batch_tokens=True)):
        with pytest.raises(ValueError, match="token budgets"):
            simulate(reqs, **budgets)


# ---------------------------------------------------------------- policies
def test_unknown_policy_raises():
    with pytest.raises(ValueError):
        make_policy("nope")


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_serves_every_request(name):
    reqs = workloads.make("shared_prefix", seed=8, **SMALL["shared_prefix"])
    res = simulate(reqs, schedule_policy=name, capacity_tokens=300)
    assert len(res.per_request) == len(reqs) and res.rejected == 0


# ---------------------------------------------------------------- workloads
@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_workloads_are_seeded_and_numbered(name):
    a = workloads.make(name, seed=9, **SMALL[name])
    b = workloads.make(name, seed=9, **SMALL[name])
    assert [r.prompt.tolist() for r in a] == [r.prompt.tolist() for r in b]
    assert [r.rid for r in a] == list(range(len(a)))
    assert all(r.arrival <= s.arrival for r, s in zip(a, a[1:], strict=False))
    for r in a:
        if r.parent is not None:
            parent = a[r.parent]
            history = np.concatenate([parent.prompt, parent.output])
            assert r.parent < r.rid and r.prompt[: len(history)].tolist() == history.tolist()


def test_default_shapes_follow_the_published_benchmarks():
    gsp = workloads.make("shared_prefix")
    assert len(gsp) == 64 * 16 and {r.prompt_len for r in gsp} == {2048 + 128}
    chat = workloads.make("multi_turn")
    assert len(chat) == 20 * 4
    vllm = workloads.make("multi_turn", preset="vllm")
    assert len({r.session for r in vllm}) == 24
    hs = workloads.make("few_shot", style="hellaswag", subjects=1, questions_per_subject=5)
    assert len(hs) == 5 * 4
    tot = workloads.make("tree_of_thought", trees=1)
    assert len(tot) == 1 + 3 + 9 + 27


def test_unknown_workload_raises():
    with pytest.raises(ValueError):
        workloads.make("sharegpt")


# ---------------------------------------------------------------- mooncake
@pytest.mark.skipif(not TRACE.is_file(), reason=f"Mooncake trace not found at {TRACE} (shared/ is not in a clone)")
def test_mooncake_unlimited_replay_equals_the_trace_bound():
    limit = 1500
    reqs = workloads.mooncake(TRACE, limit=limit)
    bound = trace_upper_bound(read_trace(TRACE, limit))
    res = simulate(reqs, cache="radix", max_running=1)
    assert res.prompt_tokens == bound["prompt_tokens"] == sum(r["input_length"] for r in read_trace(TRACE, limit))
    assert res.hit_tokens == bound["hit_tokens"]
    assert upper_bound(reqs) == pytest.approx(bound["hit_rate"])


def test_mooncake_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="Mooncake trace"):
        workloads.mooncake(tmp_path / "missing.jsonl")


GOOD_LINE = '{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}'


@pytest.mark.parametrize("line, message", [
    ("{not json", "not a JSON line"),
    ("[1, 2]", "must be a JSON object"),
    ('{"timestamp": 0, "output_length": 5, "hash_ids": [0, 1]}', "has no input_length"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length must be"),
    ('{"timestamp": 0, "input_length": "700", "output_length": 5, "hash_ids": [0, 1]}', "input_length must be"),
    ('{"timestamp": 0, "input_length": 700, "output_length": -1, "hash_ids": [0, 1]}', "output_length must be"),
    ('{"timestamp": "now", "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}', "timestamp must be"),
    ('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, "x"]}', "hash_ids must be"),
    ('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0]}', "do not cover input_length"),
    ('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 18014398509481984]}', "hash_ids must"),
    ('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [-1, 1]}', "hash_ids must"),
    ('{"timestamp": 1' + '0' * 400 + ', "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}',
     "timestamp must"),  # an int too large for a float
    ('{"timestamp": NaN, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}', "timestamp must"),
    ('{"timestamp": 0, "input_length": 700, "output_length": 1e20, "hash_ids": [0, 1]}', "output_length must"),
    ('{"timestamp": 0, "input_length": 700.5, "output_length": 5, "hash_ids": [0, 1]}', "input_length must"),
])
def test_mooncake_bad_line_names_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD_LINE}\n\n{line}\n")
    with pytest.raises(ValueError, match=message) as err:
        workloads.mooncake(path)
    assert f"{path}:3:" in str(err.value)
    assert len(workloads.mooncake(path, limit=1)) == 1  # the lines before the bad one still replay


def test_mooncake_line_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=f"{path}:2: not UTF-8"):
        workloads.mooncake(path)


def test_mooncake_integral_floats_and_numpy_limits_are_read_as_integers(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0.5, "input_length": 700.0, "output_length": 5.0, "hash_ids": [0, 1.0]}\n'
                    + GOOD_LINE + "\n")
    rows = read_trace(path, np.int64(1))
    assert len(rows) == 1 and rows[0]["input_length"] == 700 and type(rows[0]["input_length"]) is int
    (a,) = workloads.mooncake(path, limit=1)
    assert a.prompt_len == 700 and a.output_len == 5 and a.arrival == 0.0005


def test_mooncake_empty_trace_or_bad_limit_is_a_clear_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        workloads.mooncake(path)
    path.write_text(GOOD_LINE + "\n")
    for limit in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            read_trace(path, limit)


def test_mooncake_blocks_become_tokens(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]}\n')
    a, b = workloads.mooncake(path)
    assert a.prompt_len == 700 and b.prompt_len == 600 and b.arrival == 1.0
    assert a.prompt[:512].tolist() == b.prompt[:512].tolist() and a.prompt[512] != b.prompt[512]
    res = simulate([a, b], cache="radix", max_running=1)
    assert res.hit_tokens == 512 == trace_upper_bound(read_trace(path))["hit_tokens"]


def test_zero_cost_model_does_not_divide_by_zero():
    reqs = workloads.make("multi_turn", seed=10, **SMALL["multi_turn"])
    free = CostModel(prefill_per_token=0, attention_per_pair=0, decode_step=0, decode_per_seq=0, step_overhead=0)
    assert simulate(reqs, cost_model=free).makespan == pytest.approx(0.0, abs=1e-6)


def test_an_int_too_large_for_a_float_is_a_bad_value_not_an_overflow():
    with pytest.raises(ValueError, match="finite"):
        CostModel(decode_step=10**400)


def test_cost_model_fit_recovers_known_constants():
    from radixkv.cost import StepRecord
    from radixkv.sim import CostModel

    true = CostModel(prefill_per_token=4e-4, attention_per_pair=3e-8, decode_step=0.02, decode_per_seq=0.003,
                     step_overhead=0.001)
    rng = np.random.default_rng(0)
    records = []
    for i in range(60):
        tokens = int(rng.integers(1, 1500)) if i % 3 == 0 else 0
        decodes = int(rng.integers(1 if tokens == 0 else 0, 9))
        pairs = tokens * (400 + (tokens + 1) / 2)
        records.append(StepRecord(tokens, pairs, decodes, true.step_time(tokens, pairs, decodes), 0.0))
    fitted = CostModel.fit(records)
    for name, value in vars(true).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="at least 5"):
        CostModel.fit(records[:3])


def test_a_ready_clairvoyant_cache_is_told_what_was_served_as_one_built_by_name():
    from radixkv.cache.eviction.belady import Belady
    from radixkv.cache.future import FutureUses
    from radixkv.cache.radix import RadixCache
    from radixkv.sim.replica import cacheable_prompt, numbered

    reqs = numbered(list(workloads.make("multi_turn", **SMALL["multi_turn"])))
    cap = sum(r.prompt_len for r in reqs) // 6
    future = FutureUses([(cacheable_prompt(r.tokens()), r.namespace) for r in reqs], 1)
    ready = simulate(reqs, cache=RadixCache(eviction_policy=Belady(future)), capacity_tokens=cap)
    assert ready.hit_rate == simulate(reqs, eviction_policy="belady", capacity_tokens=cap).hit_rate
