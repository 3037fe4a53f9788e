"""``python -m experiments.tiers`` on tiny inputs: parts (a) and (b) (the simulator; part (c) runs the real
model and is left out), its files, its rows and its printed targets."""

from __future__ import annotations

import json

import pytest

from experiments import tiers
from experiments.common import read_rows

QUICK = ["--ratios", "0,2", "--policies", "write_through,write_back", "--limit", "120", "--no-ray"]


def tiny_trace(path) -> None:
    """A Mooncake-format trace: 12 conversations of 3 turns, each turn two 512-token blocks past the last,
    every prompt starting with the same block."""
    lines, t = [], 0
    for conv in range(12):
        ids = [0]
        for _ in range(3):
            ids = ids + [1000 * (conv + 1) + len(ids), 1000 * (conv + 1) + len(ids) + 1]
            lines.append({"timestamp": t, "input_length": 512 * len(ids) - 100, "output_length": 20,
                          "hash_ids": list(ids)})
            t += 250
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def check_rows(rows: list[dict]) -> None:
    for r in rows:
        if r["config"]["arm"] != "references":
            assert sum(r["hit_rate_by_tier"].values()) == pytest.approx(r["hit_rate"])
            assert set(r["hit_rate_by_tier"]) <= {"device", "host", "storage"}
            assert r["rejected"] == 0 and r["ttft_p50"] >= 0
        assert r["key"] and r["config"]["cost_model"]["kv_bytes_per_token"] > 0


def test_synthetic_workloads_write_rows_tables_and_a_figure(tmp_path, capsys):
    out = tmp_path / "tiers"
    tiers.main(["--parts", "a,b", "--workloads", "multi_turn,shared_prefix", "--trace", str(tmp_path / "absent.jsonl"),
                "--out", str(out), *QUICK])
    printed = capsys.readouterr().out
    assert "skipping mooncake" in printed and "target 3: not checked" in printed
    for name in ("tiers.jsonl", "config.json", "tables.md", "hit_rate_vs_capacity.png"):
        assert (out / name).stat().st_size > 0
    rows = read_rows(out / "tiers.jsonl")
    # per workload and device size: references, device alone, device x 3, device x 2, and 2 policies at ratio 2;
    # each of the two smaller devices x 2 is the next size's device alone, run once
    assert len(rows) == len({r["key"] for r in rows}) == 2 * (3 * 6 - 2)
    check_rows(rows)
    tiered = [r for r in rows if r["config"]["arm"] == "tiered"]
    assert tiered and all(r["config"]["host_capacity_tokens"] == 2 * r["config"]["capacity_tokens"] for r in tiered)
    assert any(r["hit_rate_by_tier"].get("host", 0) > 0 for r in tiered)
    # the router is told what a replica can hit: device + host
    assert all(r["config"]["router_params"]["capacity_tokens"] == 3 * r["config"]["capacity_tokens"] for r in tiered)
    assert "### (a) shared_prefix" in (out / "tables.md").read_text()
    again = tiers.main(["--parts", "a", "--workloads", "multi_turn", "--trace", str(tmp_path / "absent.jsonl"),
                        "--out", str(out), *QUICK])  # everything is in the file: nothing reruns
    assert "0 to run" in capsys.readouterr().out and len(again) == 3 * 6 - 2


def test_local_against_global_storage_on_a_mooncake_format_trace(tmp_path, capsys):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "tiers"
    tiny_trace(trace)
    tiers.main(["--parts", "b", "--trace", str(trace), "--out", str(out), "--local-storage", "4096",
                "--local-routers", "affinity,round_robin", *QUICK])
    rows = read_rows(out / "tiers.jsonl")
    check_rows(rows)
    arms = {(r["config"]["arm"], r["config"]["router"]) for r in rows if r["config"]["arm"] != "references"}
    assert arms == {(a, r) for a in ("single", "local", "global") for r in ("affinity", "round_robin")}
    glob = next(r for r in rows if r["config"]["arm"] == "global")
    assert glob["config"]["storage_capacity_tokens"] == 8 * 4096 and glob["config"]["host_capacity_tokens"] is None
    assert "target 3 (global / local within 25%" in capsys.readouterr().out
    assert "### (b) Mooncake" in (out / "tables.md").read_text()


def test_bad_flags_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit):
        tiers.main(["--limit", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--parts"):
        tiers.main(["--parts", "a,d", "--out", str(tmp_path)])
