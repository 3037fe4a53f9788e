"""The GPU floors' arithmetic (experiments.gpu_floors), on a CPU with given rates: no GPU needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.gpu_floors import (
    DECODE_BATCHES,
    KERNELS_PER_LAYER,
    KERNELS_PER_STEP,
    floor_rows,
    gpu_floors,
    model_shape,
)
from radixkv.model import load_model

# 1 GB/s: a byte a nanosecond; 1 TFLOP/s: a thousand FLOPs a nanosecond
RATES = {"read_gb_s": 1.0, "gemm_tflop_s": 1.0, "launch_us_eager": 5.0, "launch_us_graph": 1.0}


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_model("tiny-random", dtype=torch.bfloat16).model)


def test_the_shape_counts_every_linear_weight_and_each_tokens_kv(shape):
    model = load_model("tiny-random", dtype=torch.bfloat16).model
    cfg = model.config
    assert shape["params"] == sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight")) + (
        cfg.hidden_size * cfg.vocab_size)  # the LM head, tied to the embedding or not
    assert shape["head"] == cfg.hidden_size * cfg.vocab_size and shape["bytes"] == 2
    assert shape["kv_bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert shape["layers"] == cfg.num_layers


def test_decode_floors_take_the_most_of_memory_arithmetic_and_launches():
    shape = {"params": 1000, "head": 100, "bytes": 2, "kv_bytes_per_token": 10, "layers": 3}
    kernels = 3 * KERNELS_PER_LAYER + KERNELS_PER_STEP
    got = gpu_floors(shape, RATES, context=50, prefill_tokens=200, decode_steps=4)
    assert set(got) >= {f"decode_ms_b{b}" for b in DECODE_BATCHES}
    # memory: 2,000 weight bytes + B x 50 x 10 KV bytes at a byte a ns; launches: kernels x 1 us (graph)
    for b in DECODE_BATCHES:
        memory_ms = (2000 + b * 500) / 1e6
        flops_ms = 2 * b * 1000 / 1e12 * 1e3
        assert got[f"decode_ms_b{b}"] == pytest.approx(max(memory_ms, flops_ms, kernels * 1e-3))
    assert got["decode_ms_b1"] == pytest.approx(kernels * 1e-3)  # a small model's decode: bound by launches
    assert got["launch_bound_ms_eager"] == pytest.approx(5 * kernels * 1e-3)
    assert got["launch_bound_ms_graph"] == pytest.approx(kernels * 1e-3)
    assert got["prefill_ms_per_token"] == pytest.approx(2 * 900 / 1e9)  # the LM head left out
    assert got["end_to_end_s"] == pytest.approx((200 * got["prefill_ms_per_token"] + 4 * got["decode_ms_b8"]) / 1e3)
    slow_memory = gpu_floors(shape, RATES | {"read_gb_s": 1e-6}, context=50)  # memory bound everywhere
    assert slow_memory["decode_ms_b64"] == pytest.approx((2000 + 64 * 500) / 1e3 * 1e3)  # bytes at 1,000 B/s, in ms
    assert "end_to_end_s" not in slow_memory


def test_a_real_shape_at_h200_like_rates_is_bound_by_launches_at_batch_1(shape):
    h200 = {"read_gb_s": 4000.0, "gemm_tflop_s": 700.0, "launch_us_eager": 4.0, "launch_us_graph": 1.5}
    got = gpu_floors(shape, h200, context=1024)
    assert got["decode_ms_b1"] == pytest.approx(got["launch_bound_ms_graph"])
    assert got["launch_bound_ms_eager"] > got["launch_bound_ms_graph"]
    assert np.all(np.diff([got[f"decode_ms_b{b}"] for b in DECODE_BATCHES]) >= 0)  # more rows never cost less


def test_floor_rows_set_ours_against_each_floor_and_eager_against_graphs():
    floor = {"decode_ms_b1": 0.5, "decode_ms_b8": 1.0, "prefill_ms_per_token": 0.01, "end_to_end_s": 2.0,
             "launch_bound_ms_eager": 9.0}
    ours = {"decode_ms_b1": 1.5, "decode_ms_b8": 2.0, "prefill_ms_per_token": 0.02, "end_to_end_s": 3.0}
    rows = floor_rows(ours, floor, eager={"decode_ms_b1": 6.0, "decode_ms_b8": 4.0})
    assert [r["figure"] for r in rows] == ["decode_ms_b1", "decode_ms_b8", "prefill_ms_per_token", "end_to_end_s"]
    assert rows[0] == {"figure": "decode_ms_b1", "ours": 1.5, "floor": 0.5, "ratio": 3.0, "eager": 6.0,
                       "graphs_speedup": 4.0}
    assert rows[2]["ratio"] == pytest.approx(2.0) and "eager" not in rows[2]


def test_the_gpu_run_puts_its_figures_floors_and_ratios_together(monkeypatch, tmp_path):
    """``bench_engine``'s GPU run end to end on a CPU, its GPU parts stood in (the rates, the FlashInfer backend,
    the graphs' figures): every figure meets its floor in one table, eager against graphs beside decode."""
    import experiments.gpu_floors as gf
    from experiments import bench_engine

    real_run, real_micro = bench_engine.run_cache, bench_engine.ours_micro

    def run_cache(cache, args, record_steps=False):
        args.attention_backend = "auto"  # the CPU's, in place of FlashInfer
        return real_run(cache, args, record_steps)

    def ours_micro(model, context, repeats, rng, backend, batches, graphs=False):
        out = real_micro(model, context, repeats, rng, "auto", batches)
        return out | ({f"decode_ms_b{b}_graphs": out[f"decode_ms_b{b}"] / 2 for b in batches} if graphs else {})

    monkeypatch.setattr(bench_engine, "run_cache", run_cache)
    monkeypatch.setattr(bench_engine, "ours_micro", ours_micro)
    monkeypatch.setattr(gf, "gpu_rates", lambda *a, **k: dict(RATES))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a stand-in GPU")
    args = bench_engine.parse_args(["--model", "tiny-random", "--quick", "--context", "64", "--repeats", "1",
                                    "--out", str(tmp_path / "bench")])
    args.dtype = "float32"
    got = bench_engine.gpu_main(args)
    assert (tmp_path / "bench.json").is_file()
    assert set(got["micro"]) == {"flashinfer", "torch", "transformers"}
    assert got["machine"] == RATES and got["env"]["gpu"] == "a stand-in GPU"
    rows = {r["figure"]: r for r in got["floor_rows"]}
    assert set(rows) == {"decode_ms_b1", "decode_ms_b8", "decode_ms_b64", "prefill_ms_per_token", "end_to_end_s"}
    assert rows["decode_ms_b8"]["graphs_speedup"] == pytest.approx(2.0)
    assert rows["end_to_end_s"]["ours"] == got["multiturn"]["flashinfer/radix"]["end_to_end_s"]
    assert rows["end_to_end_s"]["eager"] == got["multiturn"]["flashinfer-eager/radix"]["end_to_end_s"]
    eager, graphs = got["multiturn"]["flashinfer-eager/radix"], got["multiturn"]["flashinfer/radix"]
    assert eager["prefill_tokens"] == graphs["prefill_tokens"]  # the same work, eager or replayed
    assert all(r["ratio"] == pytest.approx(r["ours"] / r["floor"]) for r in rows.values())
