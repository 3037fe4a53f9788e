"""``python -m experiments.eviction`` on tiny inputs: its files, rows, shares, targets, resuming and redoing."""

from __future__ import annotations

import pytest

from experiments import eviction
from experiments.common import read_rows
from tests.test_tiers_experiment import tiny_trace

QUICK = ["--quick", "--no-ray", "--policies", "lru,lfu,cost"]


def test_synthetic_rows_tables_figure_rerun_and_redo(tmp_path, capsys):
    out = tmp_path / "ev"
    eviction.main([*QUICK, "--workloads", "mooncake,few_shot", "--trace", str(tmp_path / "absent.jsonl"),
                   "--out", str(out)])
    printed = capsys.readouterr().out
    assert "skipping mooncake" in printed and "targets 1-4: not checked" in printed
    for name in ("eviction.jsonl", "config.json", "tables.md", "hit_rate_vs_capacity.png"):
        assert (out / name).stat().st_size > 0
    rows = read_rows(out / "eviction.jsonl")
    runs = [r for r in rows if r["config"]["kind"] == "run"]
    # 2 tiers x 4 capacities x (2 caches x 3 policies + Belady), and the upper bound
    assert len(rows) == len({r["key"] for r in rows}) == 2 * 4 * 7 + 1
    for r in runs:
        c = r["config"]
        assert set(r["runs"]) == {"default", "llama3-8b-h100"} and r["hit_rate_cost_model"] == "default"
        assert r["hit_rate"] == r["runs"]["default"]["hit_rate"] and r["seconds"] > 0
        assert r["saved_prefill_s"] is not None and r["ttft_p99"] >= r["ttft_p50"] >= 0
        assert (c["host_capacity_tokens"] == 4 * c["device_tokens"]) == (c["tiers"] == "host" and
                                                                         c["eviction_policy"] != "belady")
        if c["eviction_policy"] == "cost":
            assert c["eviction_params"]["prefill_per_token"] > 0 and r["policy"]["name"] == "cost"
        if c["eviction_policy"] == "belady":  # a tiered group's Belady: one radix cache of device + host
            assert c["cache"] == "radix" and c["capacity_tokens"] == c["device_tokens"] * (5 if c["tiers"] == "host"
                                                                                          else 1)
    assert "### few_shot: hash, device + host x4" in (out / "tables.md").read_text()
    assert "target 3" not in printed  # no Mooncake rows: no best policy
    again = eviction.main([*QUICK, "--workloads", "few_shot", "--trace", str(tmp_path / "absent.jsonl"),
                           "--out", str(out)])
    assert "0 to run" in capsys.readouterr().out and len(again) == len(rows)
    eviction.main([*QUICK, "--workloads", "few_shot", "--trace", str(tmp_path / "absent.jsonl"), "--out", str(out),
                   "--redo-policies", "cost"])
    printed = capsys.readouterr().out
    assert "dropped 16 row(s) of cost" in printed and "16 to run" in printed


def test_shares_follow_the_definition():
    def row(hit, p50):
        return {"runs": {"default": {"hit_rate": hit}, "gpu": {"hit_rate": hit, "ttft_p50": p50}},
                "hit_rate_cost_model": "default", "cost_preset": "gpu"}

    lru, bel, x = row(0.2, 10.0), row(0.4, 6.0), row(0.25, 9.0)
    assert eviction.share(x, lru, bel, "hit_rate", False) == pytest.approx(0.25)
    assert eviction.share(x, lru, bel, "ttft_p50", True) == pytest.approx(0.25)
    assert eviction.share(x, lru, row(0.2, 10.0), "hit_rate", False) is None  # Belady = LRU: undefined
    assert eviction._pct(None) == "-" and eviction._pct(-0.001) == "0%"


def test_mooncake_format_trace_targets_and_timing(tmp_path, capsys):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "ev"
    tiny_trace(trace)
    eviction.main(["--no-ray", "--workloads", "mooncake", "--trace", str(trace), "--out", str(out), "--policies",
                   "lru,lfu", "--caches", "radix", "--tiers", "one", "--mooncake-capacities", "1e6,4e6",
                   "--timing-repeats", "1"])
    printed = capsys.readouterr().out
    assert "best online policy" in printed and "target 1 (" in printed and "target 2 (" in printed
    assert "target 3 (lru" in printed or "target 3 (lfu" in printed
    assert "target 4 (" in printed and ("PASS" in printed or "MISS" in printed)
    rows = read_rows(out / "eviction.jsonl")
    timing = [r for r in rows if r["config"]["kind"] == "timing"]
    assert len(timing) == 1 and len(timing[0]["seconds"]["policy"]) == 1
    mooncake = [r for r in rows if r["config"]["kind"] == "run"]
    assert all(r["config"]["page_size"] == 512 and set(r["runs"]) == {"default", "llama3-8b-h100"} for r in mooncake)
    assert (out / "share_of_gap_mooncake.png").stat().st_size > 0


def test_bad_flags_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit):
        eviction.main(["--timing-repeats", "-1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--policies"):
        eviction.main([*QUICK, "--policies", "nope", "--workloads", "few_shot", "--out", str(tmp_path)])
