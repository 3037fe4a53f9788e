"""The paper figures: every plot function draws from tiny synthetic rows, figures.py redraws from JSONL, and the
block-size experiment runs small with radix >= hash hit rate at every block size when nothing is evicted."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments import block_size, figures, plots  # noqa: E402
from experiments.common import read_rows, write_rows  # noqa: E402

SCHEDULES = ("fcfs", "lpm", "lpm+in-batch")
EVICTIONS = ("lru", "lfu", "belady")


def ablation_rows() -> list[dict]:
    rows = []
    for w, ub in (("multi_turn", 0.6), ("shared_prefix", 0.9)):
        for frac in (0.05, 0.2):
            for e in EVICTIONS:
                for i, s in enumerate(SCHEDULES):
                    hit = ub * (0.5 + 0.2 * i) * (1 + frac)
                    rows.append({"workload": w, "capacity_frac": frac, "schedule": s, "eviction_policy": e,
                                 "schedule_policy": s.split("+")[0], "hit_rate": hit, "upper_bound": ub,
                                 "pct_of_upper_bound": 100 * hit / ub})
    return rows


def mooncake_rows() -> list[dict]:
    rows = []
    for arm in ("radix page 1", "hash block 16"):
        for cap, hit, bel in ((2_000_000, 0.08, 0.27), (8_000_000, 0.27, 0.37), (None, 0.37, 0.37)):
            rows.append({"arm": arm, "capacity_tokens": cap, "hit_rate": hit, "upper_bound": 0.374,
                         "belady_hit_rate": bel, "requests": 100})
    return rows


def multiturn_rows(with_source: bool = True) -> list[dict]:
    rows = []
    for source in ("measured", "simulated") if with_source else ("measured",):
        for cache, gain in (("none", 0.0), ("hash", 0.6), ("radix", 0.65)):
            for s in range(2):
                for t in range(3):
                    row = {"cache": cache, "session": s, "turn": t, "prompt_tokens": 100 * (t + 1),
                           "cached_tokens": int(gain * 100 * t), "ttft": 1.0 + t - gain * 2 * t + 0.1 * s}
                    if with_source:
                        row["source"] = source
                    rows.append(row)
    return rows + [{"summary": [{"cache": "none", "hit_rate": 0.0}], "args": {"turns": 3}}]


def block_size_rows() -> list[dict]:
    rows = []
    for w in ("multi_turn", "shared_prefix"):
        for label, cap in (("unlimited", None), ("50% of distinct tokens", 1000)):
            rows.append({"workload": w, "capacity_label": label, "capacity_tokens": cap, "arm": "radix page 1",
                         "granularity": 1, "hit_rate": 0.6, "upper_bound": 0.6, "evicted_tokens": 0})
            for b in (1, 4, 16):
                for arm in ("radix", "hash"):
                    rows.append({"workload": w, "capacity_label": label, "capacity_tokens": cap, "arm": arm,
                                 "granularity": b, "hit_rate": 0.6 - 0.01 * b, "upper_bound": 0.6,
                                 "evicted_tokens": 0 if cap is None else 10})
    return rows


@pytest.mark.parametrize("fn, rows", [
    (plots.fig2_policy_bounds, ablation_rows()),
    (plots.fig3_mooncake_capacity, mooncake_rows()),
    (plots.fig4_multiturn_ttft, multiturn_rows()),
    (plots.fig4_multiturn_ttft, multiturn_rows(with_source=False)),  # older files: no "source", all measured
    (plots.fig5_block_size, block_size_rows()),
    (plots.fig6_ablation, ablation_rows()),
])
def test_each_plot_draws_from_tiny_rows(fn, rows):
    fig = fn(rows)
    assert isinstance(fig, Figure)
    drawn = [ax for ax in fig.axes if ax.lines or ax.patches or ax.images]
    assert drawn, "nothing drawn"
    fig.canvas.draw()  # labels and layout render headless
    plt.close(fig)


@pytest.mark.parametrize("fn", [plots.fig2_policy_bounds, plots.fig3_mooncake_capacity, plots.fig4_multiturn_ttft,
                                plots.fig5_block_size, plots.fig6_ablation])
def test_plots_tolerate_rows_they_do_not_understand(fn):
    fig = fn([{"summary": []}, {"something": "else"}])
    assert isinstance(fig, Figure)
    plt.close(fig)


def test_policy_bounds_take_belady_from_the_belady_rows_when_not_recorded():
    rows = ablation_rows()
    data = plots.policy_bounds(rows)
    assert len(data) == 2 * 2 * len(SCHEDULES)  # lru rows only
    d = next(d for d in data if (d["workload"], d["capacity"], d["schedule"]) == ("multi_turn", 0.2, "lpm"))
    belady = next(r for r in rows if (r["workload"], r["capacity_frac"], r["schedule"], r["eviction_policy"])
                  == ("multi_turn", 0.2, "lpm", "belady"))
    assert d["belady_hit_rate"] == pytest.approx(belady["hit_rate"])
    summary = plots.policy_bounds_summary(rows)
    s = next(s for s in summary if s["capacity"] == 0.05 and s["schedule"] == "fcfs")
    assert s["workloads"] == 2 and s["mean_pct_of_upper_bound"] == pytest.approx(100 * 0.5 * 1.05)


def test_multiturn_by_turn_counts_rows_without_source_as_measured():
    stats = plots.multiturn_by_turn(multiturn_rows(with_source=False))
    assert {s["source"] for s in stats} == {"measured"}
    assert len(stats) == 3 * 3 and all(s["requests"] == 2 for s in stats)


def test_figures_redraws_what_exists_and_skips_the_rest(tmp_path, capsys):
    write_rows(tmp_path / "ablation", ablation_rows())
    write_rows(tmp_path / "multiturn-20260101-000000", multiturn_rows())
    written = figures.main(["--results-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert set(written) == {"fig2_policy_bounds", "fig4_multiturn_ttft", "fig6_ablation"}
    assert all(p.exists() and p.stat().st_size > 0 for p in written.values())
    out = capsys.readouterr().out
    assert "skip fig3_mooncake_capacity" in out and "skip fig5_block_size" in out


def test_figures_named_multiturn_file_needs_no_results_dir(tmp_path):
    write_rows(tmp_path / "mt", multiturn_rows())
    written = figures.main(["--only", "fig4_multiturn_ttft", "--multiturn", str(tmp_path / "mt.jsonl"),
                            "--results-dir", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path / "out")])
    assert set(written) == {"fig4_multiturn_ttft"}
    with pytest.raises(FileNotFoundError, match="nowhere"):  # any other figure reads the directory
        figures.main(["--only", "fig2_policy_bounds", "--multiturn", str(tmp_path / "mt.jsonl"),
                      "--results-dir", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path / "out")])


def test_block_size_runs_small_and_radix_matches_or_beats_hash(tmp_path):
    rows = block_size.main(["--scale", "0.1", "--block-sizes", "1,4,16,64", "--out", str(tmp_path / "bs")])
    assert read_rows(tmp_path / "bs.jsonl") and (tmp_path / "bs.png").exists()
    assert all("env" in r and "args" in r and "page_size" in r and "block_size" in r for r in rows)
    for w in ("multi_turn", "shared_prefix"):
        sel = [r for r in rows if r["workload"] == w and r["capacity_tokens"] is None]
        hit = {(r["arm"], r["granularity"]): r["hit_rate"] for r in sel}
        assert hit[("radix", 1)] == hit[("hash", 1)] == hit[("radix page 1", 1)]
        for b in (1, 4, 16, 64):
            assert hit[("radix", b)] >= hit[("hash", b)]
            assert hit[("hash-v0", b)] == hit[("hash", b)]  # unlimited: v0 and v1 hold the same blocks
            assert hit[("radix", b)] <= hit[("radix page 1", 1)]  # coarser pages never reuse more
            ub = next(r["upper_bound_at_block"] for r in sel if r["granularity"] == b)
            assert hit[("radix", b)] == pytest.approx(ub)  # nothing evicted: the bound at that granularity
        assert hit[("radix", 64)] < hit[("radix", 1)]  # the partial-block cost is visible
        limited = [r for r in rows if r["workload"] == w and r["capacity_tokens"] is not None]
        assert {r["arm"] for r in limited} == {"radix", "hash", "hash-v0", "radix page 1"}
        assert any(r["evicted_tokens"] for r in limited)  # the limited capacity does evict
