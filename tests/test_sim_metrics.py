"""What a replay comes to for agents (``radixkv.sim.metrics``): completion, slowdown, fairness, intervals."""

from __future__ import annotations

import math

import pytest

from radixkv.sim.metrics import agent_metrics, completions, interval, jain, separated


def row(session: str, ready: float, finish: float, ttft: float, rejected: bool = False) -> dict:
    return {"session": session, "ready": ready, "finish": finish, "ttft": ttft, "rejected": rejected}


ROWS = [row("a", 0.0, 2.0, 1.0), row("a", 5.0, 6.0, 0.5), row("b", 1.0, 9.0, 4.0), row("c", 3.0, 3.5, 0.1, True)]
FAST = [row("a", 0.0, 1.0, 0.2), row("a", 5.0, 5.5, 0.1), row("b", 1.0, 3.0, 1.0)]


def test_completion_first_request_and_longest_wait_of_each_session():
    assert completions(ROWS) == {"a": 6.0, "b": 8.0}  # a rejected request counts for nothing
    got = agent_metrics(ROWS)
    assert got["session_completion_mean"] == 7.0 and got["first_ttft_mean"] == 2.5  # a's first 1.0, b's 4.0
    assert got["longest_wait"] == 4.0 and got["ttft_mean"] == pytest.approx(5.5 / 3)
    assert math.isnan(got["slowdown_mean"]) and math.isnan(got["jain_fairness"])  # no reference given


def test_slowdowns_against_an_unlimited_cache_and_their_fairness():
    got = agent_metrics(ROWS, reference=FAST)  # a: 6 / 5.5, b: 8 / 2
    assert got["slowdown_max"] == pytest.approx(4.0) and got["slowdown_mean"] == pytest.approx((6 / 5.5 + 4) / 2)
    assert got["jain_fairness"] == pytest.approx(jain([6 / 5.5, 4.0])) and got["jain_fairness"] < 0.9
    assert agent_metrics(FAST, reference=FAST)["jain_fairness"] == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == 0.25  # one bears it all: 1 / n


def test_intervals_separate_only_when_they_do_not_overlap():
    a, b = interval([1.0, 1.1, 0.9]), interval([2.0, 2.1, 1.9])
    assert a["mean"] == pytest.approx(1.0) and a["ci95"] == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert separated(a, b) and not separated(a, interval([1.0, 1.5, 0.5]))
    assert math.isnan(interval([3.0])["ci95"])
