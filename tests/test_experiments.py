"""The main job's command line on a tiny model: presets, --simulate, --calibrate, results written."""

from __future__ import annotations

import json
import types

import pytest

from experiments import multiturn
from experiments.common import read_rows
from radixkv.cost import TIME_CONSTANTS
from radixkv.sim import CostModel

TINY = ["--model", "tiny-random", "--dtype", "float32", "--sessions", "2", "--turns", "3", "--system-tokens", "40",
        "--user-tokens", "12", "--max-new-tokens", "4", "--kv-cache-tokens", "1024"]


def test_presets_set_the_workload_and_flags_override_them():
    args = multiturn.parse_args([])
    shape = (args.sessions, args.turns, args.system_tokens, args.user_tokens, args.max_new_tokens)
    assert shape == (8, 4, 500, 150, 32)
    args = multiturn.parse_args(["--preset", "wide", "--turns", "2"])
    assert args.sessions == multiturn.PRESETS["wide"]["sessions"] and args.turns == 2
    with pytest.raises(SystemExit):
        multiturn.parse_args(["--preset", "nope"])


def test_simulated_workload_matches_the_model_run(tmp_path):
    """The simulator sees the same prompts: equal prompt and cached token counts per turn, for every cache."""
    measured = multiturn.main([*TINY, "--out", str(tmp_path / "m")])
    simulated = multiturn.main([*TINY, "--simulate", "--out", str(tmp_path / "s")])
    for m, s in zip(measured, simulated, strict=True):
        assert m["cache"] == s["cache"]
        assert m["prefill_tokens"] == s["prefill_tokens"]
        for t in (1, 2, 3):
            assert m[f"cached_per_req_t{t}"] == s[f"cached_per_req_t{t}"]
    radix = next(s for s in measured if s["cache"] == "radix")
    assert radix["cached_per_req_t1"] == 40  # the warm-up cached the system prompt
    assert radix["cached_per_req_t3"] == 40 + 2 * 12 + 4 + 4 - 1  # the whole previous turn, answer included
    rows = read_rows(tmp_path / "m.jsonl")
    assert all("config" in r and "args" in r for r in rows[:-1]) and "summary" in rows[-1]
    assert (tmp_path / "m.png").exists()


def test_cold_start_shares_the_system_prompt_within_the_first_batch(tmp_path):
    for flag in ("", "--simulate"):
        summary = multiturn.main([*TINY, "--no-warmup", "--caches", "radix", "--out", str(tmp_path / "w"),
                                  *([flag] if flag else [])])
        assert summary[0]["cached_per_req_t1"] == 40 / 2  # in-batch sharing: the second session hits the first


def test_calibrate_fits_a_cost_model_and_reports_predictions(tmp_path):
    summary = multiturn.main([*TINY, "--caches", "none,radix", "--calibrate", "--out", str(tmp_path / "c")])
    assert sorted((s["cache"], s["source"]) for s in summary) == [
        ("none", "measured"), ("none", "simulated"), ("radix", "measured"), ("radix", "simulated")]
    cost = json.loads((tmp_path / "c-costmodel.json").read_text())
    assert set(cost) == set(TIME_CONSTANTS) == {"prefill_per_token", "attention_per_pair", "prefill_per_seq",
                                                 "decode_step", "decode_per_seq", "step_overhead"}
    assert all(v >= 0 for v in cost.values())
    again = multiturn.main([*TINY, "--simulate", "--cost-model", str(tmp_path / "c-costmodel.json"),
                            "--out", str(tmp_path / "s")])
    assert {s["cache"] for s in again} == {"none", "hash", "radix"}


def test_bad_workload_flags_are_argparse_errors():
    for flags in (["--turns", "0"], ["--sessions", "0"], ["--max-new-tokens", "0"], ["--cost-model", "x.json"]):
        with pytest.raises(SystemExit):
            multiturn.parse_args(flags)


def test_simulate_with_rejected_requests_and_one_turn(tmp_path):
    """A request that can never fit is rejected, not a crash; one turn has no later turns to average (null)."""
    summary = multiturn.main([*TINY, "--simulate", "--kv-cache-tokens", "75", "--out", str(tmp_path / "r")])
    assert {s["cache"] for s in summary} == {"none", "hash", "radix"}
    rejected = {s["cache"]: s["rejected"] for s in summary}
    assert rejected == {"none": 2, "radix": 2, "hash": 4}  # turn 3 needs 87 slots; hash's turn 2, 5 blocks of 16
    assert not any("ttft_mean_t3" in s for s in summary)
    one = multiturn.main([*TINY, "--simulate", "--turns", "1", "--out", str(tmp_path / "one")])
    assert all(s["ttft_later_vs_none"] is None or s["ttft_later_vs_none"] != s["ttft_later_vs_none"] for s in one)
    for line in (tmp_path / "one.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in a results file"))


def test_result_paths_keep_dots_and_record_the_code_version(tmp_path):
    from experiments.common import environment, with_ext, write_rows

    assert with_ext(tmp_path / "cap0.5", ".jsonl").name == "cap0.5.jsonl"
    assert with_ext(tmp_path / "run.jsonl", ".png").name == "run.png"
    path = write_rows(tmp_path / "cap0.5", [{"x": float("nan")}])
    assert path.name == "cap0.5.jsonl" and json.loads(path.read_text()) == {"x": None}
    env = environment()
    assert {"git_commit", "git_dirty", "torch", "radixkv"} <= set(env)


def test_simulate_grid_takes_belady_under_each_rows_schedule(tmp_path):
    from experiments import simulate as sim_experiment
    from radixkv import workloads
    from radixkv.sim import simulate, upper_bound

    rows = sim_experiment.main(["--workload", "multi_turn", "--scale", "0.25", "--caches", "radix,hash",
                                "--capacity-fracs", "0.1", "--schedule-policies", "fcfs,lpm", "--max-running", "8",
                                "--out", str(tmp_path / "g")])
    requests = workloads.make("multi_turn", seed=0, sessions=5)
    for r in rows:
        want = simulate(requests, cache="radix", capacity_tokens=r["capacity_tokens"], eviction_policy="belady",
                        schedule_policy=r["schedule_policy"], max_running=8, seed=0).hit_rate
        assert r["belady_hit_rate"] == want
        granularity = 16 if r["cache"] == "hash" else 1
        assert r["upper_bound"] == upper_bound(requests, page_size=granularity)


def test_simulate_grid_takes_the_engines_token_budgets(tmp_path):
    from experiments import simulate as sim_experiment

    flags = ["--workload", "multi_turn", "--scale", "0.25", "--caches", "none", "--capacity-fracs", "0",
             "--out", str(tmp_path / "b")]
    whole = sim_experiment.main(flags)[0]
    chunked = sim_experiment.main([*flags, "--max-batch-tokens", "256", "--chunked-prefill-size", "64"])[0]
    assert (chunked["max_batch_tokens"], chunked["chunked_prefill_size"]) == (256, 64)
    assert whole["max_batch_tokens"] is None and chunked["hit_rate"] == whole["hit_rate"] == 0
    assert chunked["makespan"] != whole["makespan"]
    with pytest.raises(SystemExit):
        sim_experiment.main([*flags, "--max-batch-tokens", "0"])


def _small_trace(path):
    lines = [{"timestamp": 10 * i, "input_length": 1100 + 300 * (i % 3), "output_length": 40,
              "hash_ids": [0, 1, 2 + i % 3, *([9 + i] if i % 3 == 2 else [])]} for i in range(6)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("experiment", ["ablation", "block_size", "mooncake"])
def test_simulator_experiments_take_the_engines_token_budgets(experiment, tmp_path):
    """As experiments.simulate: the flags reach every run (the references too) and change its schedule."""
    import importlib

    module = importlib.import_module(f"experiments.{experiment}")
    flags = {"ablation": ["--workloads", "multi_turn", "--capacity-fracs", "0.2", "--evictions", "lru,belady",
                          "--schedules", "lpm"],
             "block_size": ["--workloads", "multi_turn", "--block-sizes", "4", "--capacity-fracs", "0,0.5",
                            "--scale", "0.1", "--no-plot"],
             "mooncake": ["--trace", _small_trace(tmp_path / "trace.jsonl"), "--capacities", "3000,0",
                          "--arms", "radix page 1,hash block 16"]}[experiment] + ["--out", str(tmp_path / "x")]
    whole = module.main(flags)
    chunked = module.main([*flags, "--max-batch-tokens", "256", "--chunked-prefill-size", "64"])
    assert len(whole) == len(chunked) > 1
    assert all(r["max_batch_tokens"] is None and r["chunked_prefill_size"] is None for r in whole)
    assert all((r["max_batch_tokens"], r["chunked_prefill_size"]) == (256, 64) for r in chunked)
    assert any(a["makespan"] != b["makespan"] for a, b in zip(whole, chunked, strict=True))
    with pytest.raises(SystemExit):
        module.main([*flags, "--chunked-prefill-size", "0"])


def test_mooncake_with_nothing_to_reuse_does_not_divide_by_zero(tmp_path):
    from experiments import mooncake
    from experiments.common import DEFAULT_TRACE

    if not DEFAULT_TRACE.exists():
        pytest.skip(f"needs the Mooncake trace at {DEFAULT_TRACE} (../shared, not in a fresh clone)")
    rows = mooncake.main(["--limit", "1", "--capacities", "0", "--arms", "radix page 1", "--out", str(tmp_path / "m")])
    assert rows[0]["upper_bound"] == 0 and rows[0]["pct_of_upper_bound"] is None


def test_mooncake_unlimited_reference_is_the_radix_arms_own_replay(tmp_path, monkeypatch):
    """At unlimited capacity Belady evicts nothing: the radix page 1 arm's replay is the reference, run once."""
    from experiments import mooncake
    from experiments.common import DEFAULT_TRACE

    if not DEFAULT_TRACE.exists():
        pytest.skip(f"needs the Mooncake trace at {DEFAULT_TRACE} (../shared, not in a fresh clone)")
    calls = []
    real = mooncake.simulate

    def counted(*args, **kwargs):
        calls.append((kwargs["capacity_tokens"], kwargs.get("eviction_policy", "lru")))
        return real(*args, **kwargs)

    monkeypatch.setattr(mooncake, "simulate", counted)
    rows = mooncake.main(["--limit", "60", "--capacities", "2e4,0", "--arms", "hash block 16,radix page 1",
                          "--out", str(tmp_path / "m")])
    assert calls.count((None, "lru")) == 2  # the two arms; no separate reference replay
    radix = {r["capacity_tokens"]: r["hit_rate"] for r in rows if r["arm"] == "radix page 1"}
    assert all(r["belady_hit_rate"] == radix[None] for r in rows if r["capacity_tokens"] is None)
    assert all(r["belady_hit_rate"] is not None for r in rows)


def test_bench_engine_floors_read_every_weight_and_each_requests_kv_once_or_do_its_flops():
    import torch

    from experiments.bench_engine import floors, machine_rates
    from radixkv.model import load_model

    model = load_model("tiny-random", dtype=torch.float32).model
    cfg = model.config
    params = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    rates = {"read_gb_s": 1.0, "gemm_gflop_s": 1e3}  # 1 byte and 1,000 FLOPs per nanosecond: decode waits on memory
    got = floors(model, rates, context=600, prefill_tokens=100, decode_steps=3)
    assert got["prefill_ms_per_token"] == pytest.approx(2 * (params - cfg.hidden_size * cfg.vocab_size) / 1e9)
    assert got["decode_ms_b1"] == pytest.approx((4 * params + 600 * kv_per_token) / 1e6)
    assert got["decode_ms_b8"] == pytest.approx((4 * params + 8 * 600 * kv_per_token) / 1e6)
    assert got["decode_ms_b8_shared500"] == pytest.approx((4 * params + (500 + 8 * 100) * kv_per_token) / 1e6)
    assert got["end_to_end_s"] == pytest.approx((100 * got["prefill_ms_per_token"] + 3 * got["decode_ms_b8"]) / 1e3)
    short = floors(model, rates, context=100)  # shorter than the shared prefix: all of it is shared
    assert short["decode_ms_b8_shared500"] == pytest.approx(short["decode_ms_b1"]) and "end_to_end_s" not in short
    coded = model.model.layers[0].mlp.down_proj  # as if it had 4-bit codes of 1,000 bytes for every row count
    coded.coded, coded.coded_rows = types.SimpleNamespace(nbytes=1000), 2
    saved = 4 * coded.in_features * coded.out_features - 1000
    again = floors(model, rates, context=600)
    assert again["decode_ms_b1"] == pytest.approx(got["decode_ms_b1"] - saved / 1e6)
    assert again["decode_ms_b8"] == pytest.approx(got["decode_ms_b8"])  # batch 8 reads the 16-bit tiles
    fast_memory = floors(model, {"read_gb_s": 1e9, "gemm_gflop_s": 1.0}, context=600)  # bound by arithmetic
    assert fast_memory["decode_ms_b1"] == pytest.approx(2 * params / 1e6)
    assert fast_memory["decode_ms_b8"] == pytest.approx(16 * params / 1e6) == fast_memory["decode_ms_b8_shared500"]
    measured = machine_rates(model, repeats=1, rows=16)
    assert measured["read_gb_s"] > 0 and measured["gemm_gflop_s"] > 0 and measured["gemm_dtype"] == "float32"


def test_bench_engine_takes_the_best_rate_of_its_probes_and_times_the_decode_figures_in_turns():
    from experiments.bench_engine import best_rates, interleaved

    slow = {"read_gb_s": 11.7, "gemm_gflop_s": 140.0, "gemm_dtype": "float32"}
    fast = {"read_gb_s": 24.0, "gemm_gflop_s": 65.0, "gemm_dtype": "float32"}
    assert best_rates(slow, fast) == {"read_gb_s": 24.0, "gemm_gflop_s": 140.0, "gemm_dtype": "float32"}
    order = []
    got = interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=3, per_round=2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # one warm-up each, then turns of two runs
    assert set(got) == {"a", "b"} and all(v >= 0 for v in got.values())


def test_bench_engine_targets_carry_this_machines_floor_where_one_applies():
    from experiments.bench_engine import targets

    cache = {"end_to_end_s": 10.0, "ttft_mean_later": 1.0, "prefill_tokens": 100, "overhead_share": 0.02,
             **{f"cached_per_req_t{t}": 1100 for t in range(1, 5)}}
    summary = {"radix": cache, "hash": cache, "none": {**cache, "ttft_mean_later": 4.0}}
    ours = {"decode_ms_b1": 20.0, "decode_ms_b8": 30.0}
    floor = {"end_to_end_s": 8.0, "decode_ms_b1": 12.0, "decode_ms_b8": 19.0, "prefill_ms_per_token": 1.5}
    peer = {"end_to_end_s": 5.0, "decode_ms_b1": 15.0, "decode_ms_b8": 30.0,
            **{f"cached_per_req_t{t}": 1000 for t in range(1, 5)}}
    rows = targets(summary, ours, floor, peer)
    assert [r["floor"] for r in rows] == [None, None, None, 8.0 / 5.0, 12.0 / 15.0, 19.0 / 30.0, None]
    assert [r["met"] for r in rows] == [True, True, True, False, False, True, True]
    assert [r["reachable"] for r in rows] == [True] * 3 + [False] + [True] * 3  # floor 1.6x the peer's 5 s
    alone = targets(summary, ours, floor)  # no peer: only the targets that need none, no remembered figure
    assert len(alone) == 3 and all(r["floor"] is None for r in alone)


def test_bench_engine_reads_the_peer_file_and_prints_ratios(tmp_path):
    from experiments.bench_engine import ratios, read_peer

    turns = [{"turn": t, "mean_ttft_s_median": 0.1 * t, "cached_per_request": [480, 490]} for t in range(1, 5)]
    on = {"vllm_version": "0.32.0", "dtype": "bfloat16", "summary": {"total_s_median": 10.0, "per_turn": turns},
          "micro": {"summary": {"prefill_ms_per_tok_engine_median": 0.5, "decode_bs1_ms_per_step_median": 20.0,
                                "decode_bs8_ms_per_step_median": 40.0}}}
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"vllm_cpu_prefix_on": on, "vllm_cpu_prefix_off": {"summary": {"total_s_median": 30}}}))
    peer = read_peer(path)
    assert peer["end_to_end_s"] == 10.0 and peer["end_to_end_no_cache_s"] == 30
    assert peer["ttft_mean_t2"] == 0.2 and peer["cached_per_req_t1"] == 485 and peer["decode_ms_b8"] == 40.0
    summary = {"radix": {"end_to_end_s": 5.0, **{f"ttft_mean_t{t}": 0.05 * t for t in range(1, 5)}},
               "none": {"end_to_end_s": 15.0}}
    rows = {r["figure"]: r["ratio"] for r in ratios(summary, {"prefill_ms_per_token": 0.25, "decode_ms_b1": 10.0,
                                                              "decode_ms_b8": 20.0}, peer)}
    assert rows == pytest.approx({"end_to_end_s": 0.5, "end_to_end_no_cache_s": 0.5, "ttft_mean_t1": 0.5,
                                  "ttft_mean_t2": 0.5, "ttft_mean_t3": 0.5, "ttft_mean_t4": 0.5,
                                  "prefill_ms_per_token": 0.5, "decode_ms_b1": 0.5, "decode_ms_b8": 0.5})
    with pytest.raises(ValueError, match="no such file"):
        read_peer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="vllm_cpu_multiturn"):
        read_peer(tmp_path / "bad.json")


def test_bad_input_to_an_experiment_is_one_line_and_exit_status_2(capsys, tmp_path):
    from experiments.common import run_cli
    from radixkv.sim import CostModel

    def bad():
        raise ValueError("prefix_cache must be one of ...")

    with pytest.raises(SystemExit) as exit_:
        run_cli(bad)
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().endswith("error: prefix_cache must be one of ...")
    for flags in (["--caches", "none,bogus"], ["--threads", "0"], ["--kv-cache-tokens", "80"]):  # 40 + 3 x 16 - 1
        with pytest.raises(SystemExit):
            multiturn.parse_args([*TINY, *flags])
    assert multiturn.parse_args([*TINY, "--kv-cache-tokens", "87"]).kv_cache_tokens == 87
    for values in ({"foo": 1}, [1], {"prefill_per_token": -1.0}, {"decode_step": "x"}):
        with pytest.raises(ValueError):
            CostModel.from_dict(values)
    path = tmp_path / "cost.json"
    path.write_text('{"prefill_per_token": -1}')
    with pytest.raises(ValueError):
        multiturn.main([*TINY, "--simulate", "--cost-model", str(path), "--out", str(tmp_path / "s")])
    assert not (tmp_path / "s.jsonl").exists()
    with pytest.raises(ValueError, match="no request"):  # the simulator rejects what cannot fit; here, everything
        multiturn.main([*TINY, "--simulate", "--kv-cache-tokens", "10", "--out", str(tmp_path / "s")])
    from experiments import ablation, block_size, figures, mooncake, simulate

    out = ["--out", str(tmp_path / "x")]
    for main, flags in ((ablation.main, ["--workloads", "bogus"]), (ablation.main, ["--capacity-fracs", "-1"]),
                        (block_size.main, ["--scale", "0"]), (mooncake.main, ["--arms", "bogus"]),
                        (mooncake.main, ["--limit", "0"]), (simulate.main, ["--capacity-fracs", "abc"]),
                        (simulate.main, ["--scale", "0"])):
        with pytest.raises((ValueError, SystemExit)):  # SystemExit: argparse's own error, also exit status 2
            main([*flags, *out])
    with pytest.raises(ValueError, match="--only"):
        figures.main(["--only", "bogus", "--out-dir", str(tmp_path)])
    for flags in (["--results-dir", str(tmp_path / "nowhere")], ["--multiturn", str(tmp_path / "none.jsonl")]):
        with pytest.raises(FileNotFoundError):
            figures.main([*flags, "--out-dir", str(tmp_path)])
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 700}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1: record has no output_length, hash_ids"):
        mooncake.main(["--trace", str(trace), *out])
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("cache", ["none", "hash", "radix"])
def test_simulator_schedules_the_steps_the_engine_runs(cache):
    """Chunked prefill under a token budget, decodes first, turn by turn: the same steps, token for token."""
    args = multiturn.parse_args([*TINY, "--sessions", "3", "--user-tokens", "20", "--no-warmup",
                                 "--max-batch-tokens", "40", "--chunked-prefill-size", "24"])
    _, _, llm = multiturn.run_cache(cache, args, record_steps=True)
    engine = [(r.prefill_tokens, r.attention_pairs, r.decodes) for r in llm.step_log]
    res = multiturn.simulate_workload(cache, args, CostModel())
    simulated = [(tokens, pairs, decodes) for tokens, pairs, decodes, repeats in res.steps for _ in range(repeats)]
    assert any(0 < tokens < 40 and decodes for tokens, _, decodes in engine)  # chunks and decodes share steps
    assert simulated == engine


def test_serve_medians_pools_the_repeats_of_each_run():
    from experiments.serve_medians import medians

    rows = [{"kind": "summary", "run": f"{name}-{rep}", "ttft_p50": t, "request_throughput": 1.0 + rep}
            for name, ts in (("vllm-sp2", (3.0, 1.0, 2.0)), ("radixkv-sp2", (0.5,))) for rep, t in enumerate(ts)]
    rows.append({"kind": "request", "run": "vllm-sp2-0", "ttft": 9.0})
    got = {r["run"]: r for r in medians(rows)}
    assert got["vllm-sp2"]["runs"] == 3 and got["vllm-sp2"]["ttft_p50"] == 2.0
    assert got["vllm-sp2"]["request_throughput"] == 2.0 and got["radixkv-sp2"]["ttft_p50"] == 0.5
    assert "tpot_p50" not in got["vllm-sp2"]  # a figure the rows lack is left out, not made up


def test_cost_fit_fits_on_one_workload_and_predicts_another_out_of_sample(tmp_path):
    from experiments import cost_fit

    assert cost_fit.per_turn([{"turn": 0, "ttft": 1.0}, {"turn": 0, "ttft": 3.0}, {"turn": 1, "ttft": 4.0}],
                             [{"turn": 0, "ttft": 3.0}, {"turn": 1, "ttft": 2.0}]) == [
        {"turn": 1, "measured_s": 2.0, "predicted_s": 3.0, "error": 0.5},
        {"turn": 2, "measured_s": 4.0, "predicted_s": 2.0, "error": -0.5}]
    with pytest.raises(SystemExit):
        cost_fit.parse_args(["--fit-preset", "wide", "--predict-preset", "wide"])
    got = cost_fit.main(["--model", "tiny-random", "--quick", "--out", str(tmp_path / "fit")])
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert saved["cost"] == got["cost"] and CostModel.load(tmp_path / "fit.json") == CostModel.from_dict(got["cost"])
    assert got["cost"]["kv_bytes_per_token"] != CostModel().kv_bytes_per_token  # tiny-random's own layout
    assert set(TIME_CONSTANTS) < set(got["cost"]) and got["step_errors"]["steps"] == got["fit_steps"]
    assert got["fit_steps"] >= 5 and [r["turn"] for r in got["out_of_sample"]] == [1, 2]
    assert got["max_abs_error_out_of_sample"] == max(abs(r["error"]) for r in got["out_of_sample"])
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in got["out_of_sample"] + got["in_sample"])
