"""The memory GPU presets have for KV (``radixkv.gpu_memory``): the arithmetic, and refusals above it."""

from __future__ import annotations

import pytest

from radixkv.cost import COST_PRESETS
from radixkv.gpu_memory import NODE_MEMORY, InfeasibleCapacity, NodeMemory, check_capacity


def test_every_gpu_preset_states_its_memory_with_the_cost_models_kv_bytes():
    gpu = {name for name in COST_PRESETS if not name.startswith("cpu")}
    assert gpu == set(NODE_MEMORY)
    for name, node in NODE_MEMORY.items():
        assert node.kv_bytes_per_token == COST_PRESETS[name].kv_bytes_per_token


def test_the_70b_nodes_hold_what_their_hbm_less_weights_and_reserve_leaves():
    h100, h200 = NODE_MEMORY["llama3-70b-8xh100"], NODE_MEMORY["llama3-70b-8xh200"]
    assert h100.hbm == 640e9 and h100.weight_bytes == pytest.approx(141.2e9)
    assert h100.device_tokens == int((640e9 * 0.9 - 141.2e9) // 327_680) == 1_326_904  # only D = 1M fits
    assert 2.6e6 < h200.device_tokens < 3e6 < NODE_MEMORY["llama3-70b-8xb200"].device_tokens


def test_a_capacity_above_the_node_is_refused_with_its_arithmetic_unless_forced():
    assert check_capacity("llama3-70b-8xh100", 1_000_000)
    with pytest.raises(InfeasibleCapacity, match=r"640 GB.*141\.2 GB of weights.*1,326,904 tokens"):
        check_capacity("llama3-70b-8xh100", 2_000_000)
    assert check_capacity("llama3-70b-8xh100", 2_000_000, force=True) is False
    assert check_capacity("cpu-smollm2-135m", 10**9)  # no node: nothing to check against


def test_node_memory_rejects_nonsense():
    with pytest.raises(ValueError, match="activation_reserve"):
        NodeMemory(1, 80e9, 16e9, 131072.0, activation_reserve=1.0)
    with pytest.raises(ValueError, match="gpus"):
        NodeMemory(0, 80e9, 16e9, 131072.0)
    assert NodeMemory(1, 10e9, 16e9, 131072.0).device_tokens == 0  # weights alone overflow it
