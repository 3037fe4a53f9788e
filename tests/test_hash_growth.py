"""experiments.hash_growth on tiny prompts: what it writes, and v0's quadratic hashing count.

Timings are only checked to be there and positive (the machine is noisy); the
growth claims are asserted on the deterministic hashed-token counts.
"""

from __future__ import annotations

import json

import pytest

from experiments import hash_growth

LENGTHS = [64, 256, 1024]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, object]:
    """One tiny run (three lengths, one repeat): what main returns, the JSON it wrote, and the output folder."""
    out = tmp_path_factory.mktemp("hash_growth")
    doc = hash_growth.main(["--lengths", ",".join(map(str, LENGTHS)), "--repeats", "1", "--seed", "3",
                            "--out", str(out / "growth"), "--figure", str(out / "growth.png")])
    return doc, json.loads((out / "growth.json").read_text()), out


def test_writes_config_results_and_figure(run):
    doc, written, out = run
    config = written["config"]
    assert config["lengths"] == LENGTHS and config["caches"] == ["hash-v0", "hash", "radix"]
    assert (config["block_size"], config["page_size"], config["repeats"], config["seed"]) == (16, 1, 1, 3)
    assert written["results"] == json.loads(json.dumps(doc["results"]))
    assert (out / "growth.png").stat().st_size > 0


def test_every_cache_and_length_has_positive_times_and_a_full_warm_hit(run):
    _, written, _ = run
    cases = {(c["cache"], c["length"]): c for c in written["results"]}
    assert set(cases) == {(name, n) for name in hash_growth.CACHES for n in LENGTHS}
    for case in cases.values():
        assert case["repeats"] == 1 == len(case["per_repeat"])
        assert all(case[key] > 0 for key in hash_growth.MEASURES)
        assert case["cold_s"] == pytest.approx(case["lookup_miss_s"] + case["insert_s"])
        assert case["warm_hit_tokens"] == case["length"]  # lengths are whole blocks: the resent prompt hits fully


def test_v0_hashes_every_prefix_from_token_0(run):
    """Block i hashes (i + 1) x 16 tokens: a cold request's miss hashes block 0, its insert every prefix."""
    _, written, _ = run
    for case in written["results"]:
        if case["cache"] != "hash-v0":
            assert case["cold_hashed_tokens"] is None and case["warm_hashed_tokens"] is None
            continue
        blocks = case["length"] // 16
        every_prefix = 16 * blocks * (blocks + 1) // 2
        assert case["warm_hashed_tokens"] == every_prefix
        assert case["cold_hashed_tokens"] == 16 + every_prefix


def test_v0_hashed_tokens_grow_quadratically(run):
    _, written, _ = run
    warm = written["summary"]["hash-v0"]["warm_hashed_tokens"]
    by = warm["by_length"]
    assert 14 < by["1024"] / by["256"] < 16.5  # 4x the tokens, about 16x the hashing
    assert warm["exponent"] == pytest.approx(2, abs=0.1)
    assert "warm_hashed_tokens" not in written["summary"]["hash"]


def test_fit_exponent_recovers_a_power_law():
    assert hash_growth.fit_exponent([1, 4, 16], [3.0, 48.0, 768.0]) == pytest.approx(2)
    assert hash_growth.fit_exponent([1, 4], [2.0, None]) is None
    assert hash_growth.local_exponents([1, 2, 4], [1.0, 2.0, 8.0]) == pytest.approx([1, 2])


def test_bad_input_is_refused(tmp_path):
    for bad in (["--lengths", "0,16"], ["--lengths", "16,16"], ["--lengths", "a"], ["--caches", "radix,nope"]):
        with pytest.raises(ValueError):
            hash_growth.main([*bad, "--out", str(tmp_path / "x"), "--no-plot"])
    with pytest.raises(SystemExit):
        hash_growth.main(["--repeats", "0", "--out", str(tmp_path / "x"), "--no-plot"])
