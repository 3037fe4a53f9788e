"""The main job's command line on a tiny model: presets, --simulate, --calibrate, results written."""

from __future__ import annotations

import json

import pytest

from experiments import multiturn
from experiments.common import read_rows

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
    assert set(cost) == {"prefill_per_token", "attention_per_pair", "decode_step", "decode_per_seq", "step_overhead"}
    assert all(v >= 0 for v in cost.values())
    again = multiturn.main([*TINY, "--simulate", "--cost-model", str(tmp_path / "c-costmodel.json"),
                            "--out", str(tmp_path / "s")])
    assert {s["cache"] for s in again} == {"none", "hash", "radix"}
