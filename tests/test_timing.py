from __future__ import annotations

from radixkv.timing import interleaved, seconds, timed


def test_timed_is_a_median_after_one_warm_up_and_interleaved_takes_turns_by_round():
    calls = []
    assert timed(lambda: calls.append(1), repeats=4) >= 0
    assert len(calls) == 5
    order = []
    got = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=2, per_round=1)
    assert order == ["a", "b", "a", "b", "a", "b"] and set(got) == {"a", "b"}
    assert seconds(lambda: None) >= 0
