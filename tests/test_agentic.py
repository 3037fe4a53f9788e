"""The agentic-session reader (``radixkv.workloads.agentic``): strict checks, the session layout (Poisson
starts by Little's law, closed-loop streams, sub-agents, capped pauses, a shared tool prefix), block prompts
built on demand, and the replay through the simulator; the real file where ``shared/`` has it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from radixkv.bounds import upper_bound
from radixkv.sim import simulate, simulate_cluster
from radixkv.workloads import BlockPrompt, Request, agentic
from radixkv.workloads.agentic import read_sessions, session_duration

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "agentic" / "sessions.jsonl"


def rec(session: str, t: float, blocks: list[list[int]], n: int | None = None, stream: int = 0, **kw) -> dict:
    """One record: ``blocks`` runs, ``n`` prompt tokens (the runs' blocks x 64 + 10 by default)."""
    n = sum(c for _, c in blocks) * 64 + 10 if n is None else n
    row = dict(session=session, stream=stream, agent=None if stream == 0 else "Explore", t=t, input_length=n,
               output_length=20, api_time=2.0, think_time=1.0, stop="tool_use", model="m", tool_tokens=128,
               system_tokens=64, block_runs=blocks)
    return row | kw


def write(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """Two sessions: A's main agent (3 requests, a human turn), a sub-agent it starts; B's main agent."""
    return write(tmp_path / "s.jsonl", [
        rec("A", 0.0, [[1, 4]]),
        rec("A", 10.0, [[1, 6]], stop="end_turn"),  # 10 - 0 - 2 = 8 s pause
        rec("A", 13.0, [[1, 2], [20, 3]], stream=1),  # the sub-agent: after request 2 (t 10, answered at 12)
        rec("A", 100.0, [[1, 7]], api_time=None, think_time=30.0),  # the human came back after 88 s
        rec("A", 16.0, [[1, 2], [20, 5]], stream=1, api_time=None),
        rec("B", 0.0, [[1, 3]], tool_tokens=128, system_tokens=64),
    ])


def by_meta(reqs: list[Request]) -> dict[tuple, Request]:
    return {(r.session, r.meta["stream"], r.meta["turn"]): r for r in reqs}


def test_block_prompts_build_their_tokens_on_demand():
    p = BlockPrompt([[5, 2], [9, 1]], block=4, tail=3, tail_start=1000)
    assert len(p) == 15 and p.block_ids().tolist() == [5, 6, 9]
    assert p.tokens().tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 36, 37, 38, 39, 1000, 1001, 1002]
    r = Request(0.0, "s", p, 3)
    assert r.prompt_len == 15 and r.tokens().tolist() == p.tokens().tolist()
    plain = Request(0.0, "s", [1, 2, 3], 1)
    assert plain.prompt_len == 3 and plain.tokens() is plain.prompt


def test_streams_are_closed_loops_and_sub_agents_start_where_recorded(small):
    reqs = agentic(small, concurrency=2, seed=1)
    m = by_meta(reqs)
    a0, a1, sub0, a2, sub1 = (m[("A", 0, 0)], m[("A", 0, 1)], m[("A", 1, 0)], m[("A", 0, 2)], m[("A", 1, 1)])
    assert a0.parent is None and a1.parent == a0.rid and a2.parent == a1.rid and sub1.parent == sub0.rid
    assert sub0.parent == a1.rid  # the main agent's latest request sent before it
    assert a1.think_time == pytest.approx(8.0) and sub0.think_time == pytest.approx(1.0)
    assert a2.think_time == pytest.approx(88.0)  # the previous answer's time recorded: t difference less it
    assert sub1.think_time == pytest.approx(1.0)  # 16 - 13 - 2
    assert a1.arrival == a0.arrival + 8.0 and sub0.arrival == a1.arrival + 1.0  # start + the chain's pauses
    assert a2.arrival == a1.arrival + 88.0 and a0.rid < a1.rid < sub0.rid < sub1.rid < a2.rid
    assert [a0.meta["stop"], a1.meta["stop"]] == ["tool_use", "end_turn"] and sub0.meta["agent"] == "Explore"
    assert all(isinstance(r.prompt, BlockPrompt) for r in reqs)
    assert a1.prompt_len == 6 * 64 + 10 and a1.tokens()[: 4 * 64].tolist() == a0.tokens()[: 4 * 64].tolist()
    assert set(a0.tokens()[4 * 64 :]).isdisjoint(a1.tokens())  # a partial last block is never shared
    b0 = m[("B", 0, 0)]
    assert set(b0.tokens()).isdisjoint(a0.tokens())  # sessions share nothing (same local ids)
    capped = by_meta(agentic(small, concurrency=2, max_pause=5.0))
    assert capped[("A", 0, 2)].think_time == 5.0 and capped[("A", 0, 1)].think_time == 5.0


def test_session_starts_are_seeded_poisson_by_littles_law(tmp_path):
    rows = [rec(f"s{i}", t, [[1, 1 + k]]) for i in range(400) for k, t in enumerate((0.0, 40.0, 98.0))]
    path = write(tmp_path / "many.jsonl", rows)
    assert session_duration([r for r in rows if r["session"] == "s0"]) == 100.0
    starts = sorted({r.arrival for r in agentic(path, concurrency=10, seed=3) if r.parent is None})
    gaps = np.diff([0.0, *starts])
    assert np.mean(gaps) == pytest.approx(100.0 / 10, rel=0.15)  # rate = concurrency / mean duration
    assert starts == sorted({r.arrival for r in agentic(path, concurrency=10, seed=3) if r.parent is None})
    assert starts != sorted({r.arrival for r in agentic(path, concurrency=10, seed=4) if r.parent is None})
    fixed = sorted({r.arrival for r in agentic(path, rate=2.0) if r.parent is None})
    assert np.mean(np.diff([0.0, *fixed])) == pytest.approx(0.5, rel=0.15)
    assert len({r.session for r in agentic(path, sessions=7)}) == 7


def test_a_shared_tool_prefix_is_shared_across_sessions(small):
    plain = by_meta(agentic(small))
    shared = by_meta(agentic(small, share_prefix=True))
    k = (128 + 64) // 64  # blocks of tools + system prompt
    a, b = shared[("A", 0, 0)].tokens(), shared[("B", 0, 0)].tokens()
    assert a[: k * 64].tolist() == b[: k * 64].tolist() and a[k * 64] != b[k * 64]
    assert set(plain[("A", 0, 0)].tokens()).isdisjoint(plain[("B", 0, 0)].tokens())
    a1 = shared[("A", 0, 1)].tokens()
    assert a1[: 4 * 64].tolist() == a[: 4 * 64].tolist()  # the session's own chain is intact
    assert shared[("A", 1, 0)].tokens()[: 2 * 64].tolist() == a[: 2 * 64].tolist()


BAD = [  # (a line, what the error names)
    ('{"session": "A", "stream": 0', "not a JSON line"),
    ("[1, 2]", "JSON object"),
    (json.dumps({k: v for k, v in rec("A", 0.0, [[1, 1]]).items() if k != "block_runs"}), "no block_runs"),
    (json.dumps(rec("A", 0.0, [[1, 1]], n=3 * 64)), "input_length"),  # runs do not add up to n // 64
    (json.dumps(rec("A", -1.0, [[1, 1]])), "t must be"),
    (json.dumps(rec("A", 0.0, [[1, 1]], think_time=-2.0)), "think_time"),
    (json.dumps(rec("A", 0.0, [[1, 1]], api_time=float("nan"))), "api_time"),
    (json.dumps(rec("A", 0.0, [[1, 1]], output_length=-1)), "output_length"),
    (json.dumps(rec("A", 0.0, [[1, 0]])), "block_runs"),
    (json.dumps(rec("A", 0.0, [[-1, 1]])), "block_runs"),
    (json.dumps(rec("A", 0.0, [[1, 1]], stop="maybe")), "stop"),
    (json.dumps(rec("", 0.0, [[1, 1]])), "session"),
]


@pytest.mark.parametrize("line, says", BAD)
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, line, says):
    path = write(tmp_path / "bad.jsonl", [rec("A", 0.0, [[1, 1]]), line])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{says}"):
        agentic(path)


def test_bad_files_and_arguments_are_clear_errors(tmp_path, small):
    with pytest.raises(FileNotFoundError, match="agentic trace not found"):
        agentic(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no records"):
        agentic(write(tmp_path / "empty.jsonl", []))
    truncated = tmp_path / "cut.jsonl"
    truncated.write_text(json.dumps(rec("A", 0.0, [[1, 1]])) + "\n" + json.dumps(rec("A", 5.0, [[1, 2]]))[:40])
    with pytest.raises(ValueError, match="cut.jsonl:2: not a JSON line"):
        agentic(truncated)
    backwards = write(tmp_path / "back.jsonl", [rec("A", 5.0, [[1, 1]]), rec("A", 1.0, [[1, 2]])])
    with pytest.raises(ValueError, match="back.jsonl:2: t 1.0 is before"):
        read_sessions(backwards)
    for bad in (dict(concurrency=0), dict(concurrency=-1), dict(concurrency=float("nan")), dict(rate=0),
                dict(max_pause=-1), dict(sessions=0), dict(seed=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            agentic(small, **bad)


def test_the_replay_runs_through_the_simulator_with_its_labels(small):
    reqs = agentic(small, concurrency=2)
    res = simulate(reqs, capacity_tokens=4096, page_size=64)
    rows = {(r["session"], r["stream"], r["turn"]): r for r in res.per_request}
    assert rows[("A", 0, 1)]["stop"] == "end_turn" and rows[("A", 1, 0)]["agent"] == "Explore"
    assert rows[("A", 0, 1)]["hit"] == 4 * 64 and rows[("A", 0, 0)]["hit"] == 0
    assert res.prompt_tokens == sum(r.prompt_len for r in reqs)
    assert res.hit_rate <= upper_bound(reqs, page_size=64) + 1e-12
    cluster = simulate_cluster(reqs, replicas=2, router="affinity", capacity_tokens=4096, page_size=64)
    assert cluster.hit_rate <= cluster.references["upper_bound"] + 1e-12


def test_the_caches_hints_carry_session_stream_and_stop(small):
    from radixkv.cache import RadixCache

    seen = []

    class Spy(RadixCache):
        def insert(self, tokens, indices, namespace=None, hints=None):
            seen.append(hints)
            return super().insert(tokens, indices, namespace, hints)

    simulate(agentic(small), cache=Spy(page_size=64), capacity_tokens=4096)
    assert {(h.session, h.stream, h.stop) for h in seen} >= {("A", 0, "end_turn"), ("A", 1, "tool_use")}


@pytest.mark.skipif(not TRACE.is_file(), reason=f"the agentic trace is not at {TRACE} (shared/traces/agentic)")
def test_the_real_file_matches_its_readme():
    reqs = agentic(TRACE)
    assert len(reqs) == 36_566 and len({r.session for r in reqs}) == 563
    assert sum(r.prompt_len for r in reqs) == 4_296_196_573
    stops = [r.meta["stop"] for r in reqs]
    assert stops.count("tool_use") / len(stops) == pytest.approx(0.848, abs=0.001)
    assert stops.count("end_turn") / len(stops) == pytest.approx(0.057, abs=0.001)
    assert float(np.median([r.prompt_len for r in reqs])) == pytest.approx(100_314, rel=0.01)


def test_the_experiment_writes_its_grid_tables_and_figures(small, tmp_path):
    from experiments import agentic as experiment

    out = tmp_path / "out"
    argv = ["--trace", str(small), "--out", str(out), "--no-ray", "--capacities", "0.001,0.004", "--concurrency",
            "2", "--cost-presets", "llama3-8b-h100", "--policies", "lru,belady", "--routers", "round_robin,affinity",
            "--replicas", "2", "--write-policies", "write_back", "--orders", "1"]
    rows = experiment.main(argv)
    # capacity: radix lru + belady, hash lru; tiers: one; routers: references + two routers; sessions: eleven
    # configurations on the device alone, ten over a host tier in each of the three layouts (belady and
    # oracle: the device alone; session+prefetch: over a host tier only); per capacity; and the workload's
    # unlimited-cache reference
    assert len(rows) == 2 * (3 + 1 + 3 + 11 + 10 * 3) + 1
    assert all(bool(r["config"].get("prefetch")) == (r["config"].get("label") == "session+prefetch" or (
        r["config"].get("label") == "kvflow" and r["config"]["host_ratio"] > 0)) for r in rows)
    for layout in ("segments", "chains"):
        laid = [r for r in rows if r["config"].get("host_layout") == layout]
        assert len(laid) == 20 and all(r["config"]["host_ratio"] for r in laid)
    learned = next(r for r in rows if r["config"]["part"] == "sessions" and r["config"]["label"] == "session")
    assert learned["eviction"]["name"] == "session" and learned["eviction"]["learned_hold_main"] > 0
    run = next(r for r in rows if r["config"]["eviction_policy"] == "lru" and r["config"]["part"] == "capacity")
    assert set(run["missed_by_after"]) == {"tool_use", "end_turn", "", "None"} and run["session_time_mean"] > 0
    assert run["config"]["concurrency"] == 2 and run["config"]["capacity_tokens"] in (1000, 4000)
    text = (out / "tables.md").read_text()
    assert "Upper bound" in text and "Capacity cliff" in text and "| lru | belady |" in text
    assert "### sessions" in text and "Tool-call holds the session eviction policy learned" in text
    assert "| 0.001M (segments) |" in text
    assert (out / "config.json").is_file() and (out / "hit_rate_vs_capacity.png").is_file()
    assert (out / "sessions_ttft_vs_capacity.png").is_file()
    assert text.startswith("rows from ") and all(r["git_commit"] == rows[0]["git_commit"] for r in rows)
    with pytest.raises(ValueError, match="already holds .* --resume"):  # a rerun never keeps old rows silently
        experiment.main(argv)
    resumed = experiment.main([*argv, "--resume"])
    assert resumed and len((out / "agentic.jsonl").read_text().splitlines()) == len(rows)  # nothing was missing
    with pytest.raises(ValueError, match="--policies"):
        experiment.main([*argv, "--policies", "nope"])
    # a second write policy over the host tier: its own rows, marked in the table
    more = experiment.main([*argv, "--parts", "sessions", "--session-configs", "session", "--resume",
                            "--session-write-policies", "write_back,write_through"])
    more = [r for r in more if r["config"]["part"] == "sessions" and r["config"]["label"] == "session"]
    assert sorted(r["config"]["write_policy"] or "-" for r in more) == ["-"] * 2 + ["write_back"] * 6 + \
        ["write_through"] * 6  # per capacity: the device alone, then each write policy in each layout
    assert "| 0.001M (write_through) |" in (out / "tables.md").read_text()
    assert "| 0.001M (write_through, segments) |" in (out / "tables.md").read_text()
    with pytest.raises(ValueError, match="--session-write-policies"):
        experiment.main([*argv, "--session-write-policies", "nope"])
    with pytest.raises(ValueError, match="--session-host-layouts"):
        experiment.main([*argv, "--session-host-layouts", "rows"])


def test_the_engine_slice_gets_the_hits_the_simulator_predicts(small, tmp_path):
    from experiments import agentic as experiment

    rows = experiment.main(["--trace", str(small), "--out", str(tmp_path), "--engine", "--model", "tiny-random",
                            "--engine-kv-tokens", "256"])
    assert len(rows) == 6 and all(r["equal"] for r in rows)
    assert sum(r["engine_hit"] for r in rows) > 0 and (tmp_path / "engine.jsonl").is_file()


def test_a_capacity_past_the_nodes_memory_is_refused_unless_forced_and_then_marked(small, tmp_path):
    from experiments import agentic as experiment
    from radixkv.gpu_memory import InfeasibleCapacity

    argv = ["--trace", str(small), "--no-ray", "--capacities", "0.001,0.5", "--concurrency", "2", "--cost-presets",
            "llama3-8b-h100", "--parts", "capacity", "--caches", "radix", "--policies", "lru", "--orders", "1"]
    with pytest.raises(InfeasibleCapacity, match="426,788 tokens"):  # 1 x 80 GB less 16.1 GB of weights, less 10%
        experiment.main([*argv, "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused" / "agentic.jsonl").exists()
    rows = experiment.main([*argv, "--force-capacity", "--out", str(tmp_path / "forced")])
    assert {(r["config"]["capacity_tokens"], bool(r["config"].get("infeasible"))) for r in rows
            if r["config"]["part"] == "capacity"} == {(1000, False), (500_000, True)}
    assert "| 0.5M infeasible |" in (tmp_path / "forced" / "tables.md").read_text()


def test_a_main_agent_waits_for_the_sub_agents_the_trace_shows_it_waited_for(small, tmp_path):
    plain, waiting = by_meta(agentic(small)), by_meta(agentic(small, wait_for_sub_agents=True))
    human = waiting["A", 0, 2]  # sent at t 100; the sub-agent's final answer ended at t 16, after t 10's send
    assert plain["A", 0, 2].after == () and plain["A", 0, 2].think_time == 88.0
    assert human.after == (waiting["A", 1, 1].rid,) and human.think_time == 84.0  # its gap after that answer
    assert human.arrival >= waiting["A", 1, 1].arrival + 84.0
    assert all(r.after == () for key, r in waiting.items() if key != ("A", 0, 2))  # no other request waited
    res = simulate(list(waiting.values()), capacity_tokens=10_000)
    rows = {(r["session"], r["stream"], r["turn"]): r for r in res.per_request}
    assert rows["A", 0, 2]["ready"] == pytest.approx(rows["A", 1, 1]["finish"] + 84.0)


def test_every_configuration_runs_in_several_orders_and_the_tables_fold_them_with_agent_metrics(small, tmp_path):
    from experiments import agentic as experiment
    from experiments.agentic_tables import over_orders, with_slowdowns

    out = tmp_path / "orders"
    rows = experiment.main(["--trace", str(small), "--out", str(out), "--no-ray", "--capacities", "0.001",
                            "--concurrency", "2", "--cost-presets", "llama3-8b-h100", "--parts", "sessions",
                            "--session-configs", "lru,session", "--session-host-ratios", "0", "--orders", "2"])
    assert sorted((r["config"]["order"], r["config"]["part"]) for r in rows) == [
        (o, part) for o in (0, 1) for part in ("reference", "sessions", "sessions")]
    slowed = with_slowdowns(rows)
    for r in slowed:
        assert r["session_completions"] and r["first_ttft_mean"] <= r["longest_wait"]
        if r["config"]["part"] == "reference":  # against itself
            assert r["slowdown_mean"] == pytest.approx(1.0) and r["jain_fairness"] == pytest.approx(1.0)
        else:
            assert r["slowdown_max"] >= r["slowdown_mean"] > 0 and 0 < r["jain_fairness"] <= 1
    folded = over_orders(slowed)
    assert len(folded) == 3 and all(r["orders"] == 2 and len(r["ttft_mean_values"]) == 2 for r in folded)
    lru = next(r for r in folded if r["config"].get("label") == "lru")
    assert lru["ttft_mean"] == pytest.approx(np.mean([r["ttft_mean"] for r in rows
                                                      if r["config"].get("label") == "lru"]))
    text = (out / "tables.md").read_text()
    assert "slowdown mean / max" in text and "Jain" in text and " ± " in text and "| session | 2 |" in text


def test_one_configuration_beats_another_only_where_the_paired_orders_separate():
    from experiments.agentic_tables import versus

    a = {"ttft_mean_values": [1.0, 2.0, 3.0]}
    assert versus(a, {"ttft_mean_values": [1.5, 2.5, 3.5]}) == "lower"  # every order 0.5 s lower
    assert versus(a, {"ttft_mean_values": [0.5, 2.5, 3.0]}) == "tie"  # -0.5, +0.5, 0: zero inside
    assert versus({"ttft_mean_values": [1.0]}, {"ttft_mean_values": [2.0]}) == "tie"  # one order resolves nothing


def test_another_arrival_order_keeps_the_sub_agent_waits(small):
    from radixkv.workloads.agentic_scaled import reordered

    waiting = agentic(small, wait_for_sub_agents=True)
    moved = reordered(waiting, 1)
    assert sum(bool(r.after) for r in moved) == sum(bool(r.after) for r in waiting) > 0
    by_rid = {r.rid: r for r in moved}
    assert all(by_rid[d].arrival <= r.arrival for r in moved for d in r.after)


def test_the_scaled_replay_keeps_the_sub_agent_waits_when_asked(small):
    from radixkv.workloads.agentic_scaled import agentic_scaled

    plain = agentic_scaled(small, token_scale=1 / 64)
    waiting = agentic_scaled(small, token_scale=1 / 64, wait_for_sub_agents=True)
    assert not any(r.after for r in plain) and any(r.after for r in waiting)
    by_rid = {r.rid: r for r in waiting}
    for r in waiting:
        for d in r.after:  # an earlier request of the same session, a sub-agent's
            assert d < r.rid and by_rid[d].session == r.session and by_rid[d].meta["stream"] != 0
