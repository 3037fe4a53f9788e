"""experiments.sweep and experiments.routing on tiny workloads: the grid, resuming, Ray, the files written."""

from __future__ import annotations

import json

import pytest

from experiments import routing, sweep
from experiments.common import read_rows
from radixkv import workloads
from radixkv.sim import simulate_cluster

SIZES = {"groups": 6, "prompts_per_group": 4, "system_tokens": 200, "question_tokens": 16, "output_tokens": 4,
         "rate": 50}
FLAGS = ["--workload", "shared_prefix", "--sizes", json.dumps(SIZES), "--routers", "round_robin,affinity",
         "--replicas", "1,2", "--capacities", "600"]


def lines(out) -> list[str]:
    return (out / sweep.RESULTS).read_text().splitlines()


def test_sweep_runs_the_grid_and_references_once_per_shape(tmp_path):
    rows = sweep.main([*FLAGS, "--out", str(tmp_path / "s"), "--no-ray"])
    kinds = sorted((r["config"]["kind"], r["config"]["replicas"], r["config"].get("router")) for r in rows)
    assert kinds == [("references", 1, None), ("references", 2, None), ("run", 1, "affinity"),
                     ("run", 1, "round_robin"), ("run", 2, "affinity"), ("run", 2, "round_robin")]
    assert all(r["key"] == sweep.key(r["config"]) for r in rows)
    config = json.loads((tmp_path / "s" / sweep.CONFIG).read_text())
    assert config["grid"] == 6 and config["workload"]["sizes"] == SIZES
    flat = sweep.joined(rows)
    run = next(r for r in flat if r["replicas"] == 2 and r["router"] == "affinity")
    assert run["router_params"] == {"capacity_tokens": 600}  # affinity is told the replicas' budget
    want = simulate_cluster(workloads.make("shared_prefix", seed=0, **SIZES), replicas=2, router="affinity",
                            router_params={"capacity_tokens": 600}, capacity_tokens=600, page_size=16,
                            references=True)
    assert run["hit_rate"] == want.hit_rate and run["pooled_lru"] == want.references["pooled_lru"]
    assert run["share_of_pooled_lru"] == want.summary()["share_of_pooled_lru"]
    # one replica is the pooled cache itself: every router gets exactly its hit rate
    assert all(r["share_of_pooled_lru"] == 1.0 for r in flat if r["replicas"] == 1)


def test_sweep_resumes_adds_nothing_the_second_time_and_redoes_only_a_deleted_row(tmp_path):
    out = tmp_path / "s"
    sweep.main([*FLAGS, "--out", str(out), "--no-ray"])
    first = lines(out)
    sweep.main([*FLAGS, "--out", str(out), "--no-ray"])
    assert lines(out) == first
    invocations = json.loads((out / sweep.CONFIG).read_text())["invocations"]
    assert [i["to_run"] for i in invocations] == [6, 0]  # every command that wrote here is recorded
    dropped = first.pop(3)
    (out / sweep.RESULTS).write_text("\n".join(first) + "\n" + dropped[:40])  # and a line an interrupt cut short
    sweep.main([*FLAGS, "--out", str(out), "--no-ray"])
    again = lines(out)
    assert again[:-1] == first and json.loads(again[-1])["key"] == json.loads(dropped)["key"]
    # a wider grid runs only what it adds
    sweep.main([*FLAGS[:-4], "--replicas", "1,2,3", "--capacities", "600", "--out", str(out), "--no-ray"])
    assert len(lines(out)) == 9 and lines(out)[:6] == again


def test_sweep_on_ray_streams_the_same_rows_and_resumes(tmp_path):
    ray = pytest.importorskip("ray")
    local = sweep.main([*FLAGS, "--out", str(tmp_path / "local"), "--no-ray"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = sweep.main([*FLAGS, "--out", str(tmp_path / "ray")])
        assert ray.is_initialized()  # an instance the caller started is left up
        before = lines(tmp_path / "ray")
        sweep.main([*FLAGS, "--out", str(tmp_path / "ray")])
        assert lines(tmp_path / "ray") == before
    finally:
        ray.shutdown()
    strip = lambda r: {k: v for k, v in r.items() if k != "seconds"}
    assert sorted(map(json.dumps, map(strip, rows))) == sorted(map(json.dumps, map(strip, local)))


def test_sweep_rejects_bad_grids_before_running(tmp_path):
    with pytest.raises(ValueError, match="--routers"):
        sweep.main([*FLAGS, "--routers", "nope", "--out", str(tmp_path / "x"), "--no-ray"])
    with pytest.raises(ValueError, match="bad parameters"):
        sweep.main([*FLAGS, "--router-params", '{"affinity": {"typo": 1}}', "--out", str(tmp_path / "x"),
                    "--no-ray"])
    with pytest.raises(SystemExit):
        sweep.main(["--routers", "affinity", "--out", str(tmp_path / "x")])  # no workload
    assert not (tmp_path / "x").exists()


def _small_trace(path):
    records = [{"timestamp": 500 * i, "input_length": 1100 + 300 * (i % 3), "output_length": 40,
                "hash_ids": [0, 1, 2 + i % 3, *([9 + i] if i % 3 == 2 else [])]} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_routing_writes_rows_config_tables_and_figures_and_skips_an_absent_trace(tmp_path, capsys):
    out = tmp_path / "r"
    rows = routing.main(["--workloads", "multi_turn,shared_prefix,mooncake", "--trace", str(tmp_path / "none.jsonl"),
                         "--routers", "round_robin,affinity", "--replicas", "1,2", "--limit", "30", "--no-ray",
                         "--out", str(out)])
    text = capsys.readouterr().out
    assert "skipping mooncake" in text and "target" in text and "not checked" in text
    for name in (routing.RESULTS, "config.json", "tables.md", "hit_rate_vs_replicas.png",
                 "hit_rate_vs_imbalance.png"):
        assert (out / name).exists(), name
    assert len(read_rows(out / routing.RESULTS)) == 2 * (2 + 2 * 2)  # per workload: 2 references, 2 x 2 runs
    assert {(r["workload_name"], r["replicas"], r["router"]) for r in rows} == {
        (w, n, r) for w in ("multi_turn", "shared_prefix") for n in (1, 2) for r in ("round_robin", "affinity")}
    config = json.loads((out / "config.json").read_text())
    pooled = routing.WORKLOADS["shared_prefix"]["pooled_capacity"]
    assert config["workloads"]["shared_prefix"]["per_replica_capacity"] == {"1": pooled, "2": pooled // 2}
    assert all(r["hit_rate"] == r["pooled_lru"] for r in rows if r["replicas"] == 1)  # one replica: the pooled cache
    assert any(r["hit_rate"] > 0 for r in rows)
    assert routing.main(["--workloads", "shared_prefix", "--routers", "round_robin,affinity", "--replicas", "1,2",
                         "--limit", "30", "--no-ray", "--out", str(out)])  # resumed: nothing to run
    assert "0 to run" in capsys.readouterr().out


def test_routing_prints_the_mooncake_table_and_checks_the_target(tmp_path, capsys):
    rows = routing.main(["--workloads", "mooncake", "--trace", _small_trace(tmp_path / "t.jsonl"), "--replicas", "8",
                         "--routers", "affinity,cache_aware,kv_events", "--mooncake-capacity", "24000",
                         "--workers", "1", "--out", str(tmp_path / "m")])
    text = capsys.readouterr().out
    assert "### mooncake, N = 8 (each replica 3,000 tokens)" in text
    assert "| pooled LRU (one cache, N x capacity) |" in text and "pooled Belady" in text
    assert ("target" in text) and ("HOLDS" in text or "DOES NOT HOLD" in text)
    assert {r["router"] for r in rows} == {"affinity", "cache_aware", "kv_events"}
    assert all(r["router_params"].get("block_size") == 16 for r in rows if r["router"] == "kv_events")
