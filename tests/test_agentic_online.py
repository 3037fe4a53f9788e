"""The agent replay: the project's tune/test split, sessions scaled in tokens and time, the conversations the
replay client keeps, and the client itself against a real server and against the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import agentic_check, agentic_online
from experiments.agentic_replay import (
    Conversation,
    anthropic_body,
    calls_tool,
    openai_body,
    tool_call_answer,
    words,
)
from experiments.agentic_sim import rendered
from radixkv.workloads import SPLITS, Request, agentic, split_of
from radixkv.workloads.agentic_scaled import UNIT_TAIL, agentic_scaled, reordered, units_of, units_per_block
from tests.server_fixture import running_server
from tests.test_agentic import rec, write


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Twelve sessions: a main agent of four requests (the third a human turn, the fourth a compacted
    context), a sub-agent in every third."""
    rows = []
    for s in range(12):
        name = f"trace_{s:04d}"
        rows += [rec(name, 0.0, [[1, 4]]), rec(name, 10.0, [[1, 6]], stop="end_turn"),
                 rec(name, 40.0, [[1, 8]]), rec(name, 60.0, [[1, 2], [30, 3]])]
        if s % 3 == 0:
            rows.append(rec(name, 13.0, [[1, 2], [20, 3]], stream=1))
    return write(tmp_path / "sessions.jsonl", rows)


def test_the_split_is_a_function_of_the_session_id_alone(trace: Path):
    ids = [f"trace_{i:04d}" for i in range(400)]
    sides = [split_of(i) for i in ids]
    assert sides == [split_of(i) for i in reversed(ids)][::-1]  # order-free
    assert set(sides) == set(SPLITS) and 0.4 < sides.count("test") / len(sides) < 0.6
    parts = {s: {r.session for r in agentic(trace, split=s)} for s in SPLITS}
    assert parts["tune"].isdisjoint(parts["test"])
    assert parts["tune"] | parts["test"] == {r.session for r in agentic(trace)}
    assert all(split_of(s) == side for side, names in parts.items() for s in names)
    with pytest.raises(ValueError, match="unknown split"):
        agentic(trace, split="train")


def test_units_share_exactly_what_blocks_share():
    a, b = np.array([5, 6, 7, 8]), np.array([5, 6, 9, 10])
    assert units_per_block(1 / 32) == 2 and units_per_block(1 / 128) == 0.5
    two = units_of(a, units_per_block(1 / 32)), units_of(b, units_per_block(1 / 32))
    assert len(two[0]) == 8 and np.array_equal(two[0][:4], two[1][:4]) and two[0][4] != two[1][4]
    half = units_of(a, units_per_block(1 / 128)), units_of(b, units_per_block(1 / 128))
    assert half[0].tolist() == [6, 8] and half[1].tolist() == [6, 10]  # a unit per two blocks: the second's id
    for bad in (0, 1 / 48, 2):
        with pytest.raises(ValueError, match="token_scale"):
            units_per_block(bad)


def test_scaled_sessions_keep_their_links_their_turns_and_their_scales(trace: Path):
    full = agentic_scaled(trace, token_scale=1 / 32, time_scale=0.5)
    real = agentic(trace)
    assert len(full) == len(real) and all(r.prompt[-1] >= UNIT_TAIL for r in full)
    for r in full:
        assert len(r.prompt) == 2 * (r.meta["real_prompt"] // 64) + 1  # two units a block, one for the tail
        assert r.think_time == pytest.approx(0.5 * r.meta["real_pause"])
        assert r.parent is None or full[r.parent].session == r.session
    assert full[1].output_len == 1  # 20 tokens at 1/32, at least 1
    kept = agentic_scaled(trace, turns=2, token_scale=1 / 32)
    assert max(sum(r.session == s for r in kept) for s in {r.session for r in kept}) == 2
    short = agentic_scaled(trace, token_scale=1 / 32, max_context=13)  # 6 blocks: 13 units; 8 blocks are over
    assert all(len(r.prompt) <= 13 for r in short)
    assert not any(r.meta["turn"] >= 2 and r.meta["stream"] == 0 for r in short)  # the rest waited on turn 2
    with pytest.raises(ValueError, match="turns"):
        agentic_scaled(trace, turns=0)


def test_other_arrival_orders_deal_the_same_starts_to_the_same_sessions(trace: Path):
    reqs = agentic_scaled(trace, token_scale=1 / 32)
    assert [r.arrival for r in reordered(reqs, 0)] == [r.arrival for r in reqs]
    starts = lambda rs: {s: min(r.arrival for r in rs if r.session == s) for s in {r.session for r in rs}}  # noqa: E731
    again = reordered(reqs, 1)
    assert sorted(starts(again).values()) == pytest.approx(sorted(starts(reqs).values()))
    assert starts(again) != starts(reqs)
    for r in again:  # each session moved whole: its links and pauses kept
        assert r.parent is None or (again[r.parent].session == r.session and again[r.parent].arrival <= r.arrival)
    with pytest.raises(ValueError, match="order"):
        reordered(reqs, -1)


def test_a_conversation_continues_at_message_granularity():
    first = Conversation().extend(np.arange(10))
    assert [m["role"] for m in first.messages()] == ["system", "user"]
    assert first.messages()[0]["content"] == words(np.arange(9)) and len(words(np.arange(9)).split()) == 9
    called = first.answered(tool_call_answer("call_1"))
    second = called.extend(np.arange(14))
    assert [m["role"] for m in second.messages()] == ["system", "user", "assistant", "tool"]
    assert second.messages()[-1] == {"role": "tool", "tool_call_id": "call_1", "content": words(np.arange(10, 14))}
    human = second.answered({"role": "assistant", "content": "done"}).extend(np.arange(20))
    assert [m["role"] for m in human.messages()][-2:] == ["assistant", "user"]
    compacted = human.answered({"role": "assistant", "content": "ok"}).extend(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                                           99, 98]))
    assert [m["role"] for m in compacted.messages()] == ["system", "user"]  # the system turn is what it shares
    assert compacted.messages()[1]["content"] == words(np.array([99, 98]))
    other = Conversation().extend(np.array([50, 51]))  # shares nothing: a fresh conversation
    assert [m["role"] for m in human.answered({"role": "assistant", "content": "x"}).extend(
        np.array([50, 51])).messages()] == [m["role"] for m in other.messages()]


def test_request_bodies_ask_for_a_call_where_the_trace_called_a_tool():
    conv = Conversation().extend(np.arange(5)).answered(tool_call_answer("call_7")).extend(np.arange(8))
    call = Request(0.0, "s", np.arange(8), 3, meta={"stop": "tool_use", "stream": 1})
    text = Request(0.0, "s", np.arange(8), 3, meta={"stop": "end_turn", "stream": 0})
    body = openai_body(conv, call, "m", {"id": "s", "stream": 1, "parent": 0})
    assert body["tool_choice"] == {"type": "function", "function": {"name": "run"}} and body["prompt_cache_key"] == "s"
    assert openai_body(conv, text, "m", {})["tool_choice"] == "none"
    msgs = anthropic_body(conv, call, "m")
    assert msgs["tool_choice"] == {"type": "tool", "name": "run"} and msgs["system"] == words(np.arange(4))
    assert msgs["messages"][1]["content"][0] == {"type": "tool_use", "id": "call_7", "name": "run",
                                                 "input": {"command": "ls"}}
    assert msgs["messages"][2]["content"][0]["tool_use_id"] == "call_7"


def test_simulated_prompts_extend_their_parents_through_the_answers(trace: Path):
    reqs = agentic_scaled(trace, token_scale=1 / 32)

    def chat(messages: list[dict]) -> list[int]:  # a stand-in template: every word and role a token
        out = []
        for m in messages:
            out += [hash(m["role"]) % 1000]
            text = m.get("content") or json.dumps(m.get("tool_calls"))
            out += [hash(w) % 100_000 for w in text.split()]
        return out

    out = rendered(reqs, chat, call_tokens=2)
    extending = 0
    for r in out:
        parent = None if r.parent is None else out[r.parent]
        if parent is not None and np.array_equal(r.prompt[:len(parent.prompt)], parent.prompt):
            extending += 1  # its stream's next turn: the answer's tokens follow the parent's prompt
            assert parent.output is not None and np.array_equal(
                r.prompt[len(parent.prompt):len(parent.prompt) + parent.output_len], parent.output)
    assert extending >= 12 * 2  # every session's second and third turns at least
    # each answer ends as the server sees it: a forced call, or max_tokens under ignore_eos (not end_turn)
    assert {r.meta["stop"] for r in out} <= {"tool_use", "length"}
    assert all((r.meta["stop"] == "tool_use") == calls_tool(q) for r, q in zip(out, reqs, strict=True))


def test_the_client_replays_on_a_server_and_the_simulator_predicts_the_same_rows(trace: Path, tmp_path: Path):
    flags = ["--trace", str(trace), "--sessions", "3", "--split", "test", "--token-scale", "1/32",
             "--time-scale", "0.01", "--force-scales", "--concurrency", "3"]
    with running_server("smollm2-135m", "--kv-cache-tokens", "4096") as (base, _):
        measured = agentic_online.main([*flags, "--url", base, "--out", str(tmp_path / "m")])
    predicted = agentic_online.main([*flags, "--simulate", "cpu-smollm2-135m", "--kv-cache-tokens", "4096",
                                     "--out", str(tmp_path / "p")])
    rows = {kind: [json.loads(line) for line in (tmp_path / kind / "requests.jsonl").read_text().splitlines()]
            for kind in ("m", "p")}
    key = lambda r: (r["session"], r["stream"], r["turn"])  # noqa: E731
    assert sorted(map(key, rows["m"])) == sorted(map(key, rows["p"])) and measured["finished"] == len(rows["m"])
    for r in rows["m"]:
        assert set(agentic_online.ROW_KEYS) - {"error"} <= set(r) and r["ttft"] <= r["latency"]
        assert r["finish"] == ("tool_calls" if r["asked_tool"] else "length")
    assert predicted["finished"] == len(rows["p"])
    by_key = {key(r): r for r in rows["p"]}
    for r in rows["m"]:  # the same conversations, rendered the same: prompt lengths within the answers' slack
        assert abs(r["prompt_tokens"] - by_key[key(r)]["prompt_tokens"]) <= 8
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["env"]["git_commit"] is not None and config["scales"]["time_scale"] == 0.01
    assert predicted["orders"]["count"] == 5 and len(predicted["orders"]["ttft_mean"]["values"]) == 5
    check = agentic_check.main(["--pair", "lru", str(tmp_path / "m"), str(tmp_path / "p"),
                                "--out", str(tmp_path / "check")])
    assert check["rows"][0]["requests"] == len(rows["m"]) and check["ranking"]["measured"] == ["lru"]
    assert (tmp_path / "check.md").read_text().count("lru") >= 2


def test_scales_that_break_similarity_are_refused(trace: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="force-scales"):
        agentic_online.main(["--trace", str(trace), "--time-scale", "1000", "--simulate", "cpu-smollm2-135m",
                             "--sessions", "2", "--out", str(tmp_path / "x")])


def test_a_server_that_fails_leaves_a_row_per_request_sent_and_the_file_readable(trace: Path, tmp_path: Path):
    from tests.server_fixture import free_port

    result = agentic_online.main(["--trace", str(trace), "--sessions", "2", "--split", "test", "--time-scale", "0.01",
                                  "--force-scales", "--url", f"http://127.0.0.1:{free_port()}",  # nobody listens
                                  "--request-timeout", "5", "--out", str(tmp_path / "dead")])
    rows = [json.loads(line) for line in (tmp_path / "dead" / "requests.jsonl").read_text().splitlines()]
    assert rows and all(r["error"] for r in rows) and all(r["turn"] == 0 for r in rows)  # each stream's first
    assert result["finished"] == 0 and result["requests"] == len(rows)


def test_the_check_averages_several_measured_orders_and_pairs_them_with_the_simulators(tmp_path: Path):
    def folder(name: str, summary: dict, order: int | None = None) -> str:
        path = tmp_path / name
        path.mkdir()
        rows = [{"session": "s", "stream": 0, "turn": t, "ttft": 0.1, "prompt_tokens": 10, "cached_tokens": 5}
                for t in range(2)]
        (path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path / "summary.json").write_text(json.dumps({"requests": 2, "finished": 2, **summary}))
        if order is not None:
            (path / "config.json").write_text(json.dumps({"config": {"order": order}}))
        return str(path)

    metrics = ("ttft_mean", "ttft_p90", "hit_rate", "session_completion_mean")
    m0 = folder("m0", dict.fromkeys(metrics, 1.0), order=0)
    m2 = folder("m2", dict.fromkeys(metrics, 3.0), order=2)
    values = [1.0, 9.0, 2.0, 9.0, 9.0]  # the simulator's five orders
    p = folder("p", {**dict.fromkeys(metrics, 1.0), "orders": {
        m: {"mean": float(np.mean(values)), "ci95": 1.0, "values": values} for m in metrics}})
    row = agentic_check.compare("lru", f"{m0},{m2}", p)
    assert row["measured_orders"] == [0, 2] and row["ttft_mean_measured"] == 2.0
    assert row["ttft_mean_predicted"] == 6.0 and row["ttft_mean_predicted_paired"] == 1.5  # orders 0 and 2
    assert row["ttft_mean_error"] == pytest.approx(2.0) and row["hit_rate_error"] == pytest.approx(4.0)
    # against the simulator's mean over the measured orders alone: 1.5 predicted for 2.0 measured
    assert row["ttft_mean_error_paired"] == pytest.approx(-0.25) and row["hit_rate_error_paired"] == pytest.approx(-0.5)
    assert row["ttft_mean_measured_values"] == [1.0, 3.0] and row["ttft_mean_predicted_values"] == values
    one = agentic_check.compare("lru", m0, p)
    assert one["ttft_mean_measured"] == 1.0 and np.isnan(one["ttft_mean_measured_ci95"])


def test_two_rankings_conflict_only_where_a_side_separates_the_pair():
    def row(name: str, measured: dict[int, float], predicted: list[float]) -> dict:
        return {"config": name, "measured_orders": list(measured), "ttft_mean_measured_values": list(measured.values()),
                "ttft_mean_predicted_values": predicted}

    base = row("base", {0: 1.0, 1: 2.0, 2: 3.0}, [1.0, 2.0, 3.0, 4.0, 5.0])
    close = row("close", {0: 1.01, 1: 1.98, 2: 3.02}, [0.99, 2.01, 2.98, 4.02, 4.99])  # opposite, inside noise
    far = row("far", {0: 0.5, 1: 1.5, 2: 2.5}, [1.5, 2.5, 3.5, 4.5, 5.5])  # opposite, each side separates
    verdicts = {(q["a"], q["b"]): q for q in agentic_check.ranking_pairs([base, close, far])}
    assert verdicts["base", "close"]["verdict"] == "tie" and verdicts["base", "close"]["measured_orders"] == [0, 1, 2]
    assert verdicts["base", "far"]["verdict"] == "conflict"
    assert verdicts["base", "far"]["measured_difference"] == pytest.approx(0.5)
    assert verdicts["base", "far"]["predicted_difference"] == pytest.approx(-0.5)
    same = row("same", {0: 2.0}, [2.0, 3.0, 4.0, 5.0, 6.0])  # one order: no measured interval, the sim separates
    assert agentic_check.ranking_pairs([base, same])[0]["verdict"] == "agree"
