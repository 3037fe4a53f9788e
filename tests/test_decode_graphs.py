"""Decode under CUDA graphs, what a CPU can check: the switch (``EngineConfig.cuda_graphs``) is validated and
falls back to eager decode off CUDA with the same greedy tokens, and the buckets' and padding's arithmetic.
The graphs themselves against eager decode: tests/test_engine_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import LLM, SamplingParams
from radixkv.attention import AttentionBatch
from radixkv.config import EngineConfig
from radixkv.decode_graphs import buckets, padded_inputs

PROMPTS = [list(range(5, 45)), list(range(50, 75)), list(range(80, 140))]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def test_the_switch_is_on_by_default_and_validated():
    assert EngineConfig().cuda_graphs is True
    assert EngineConfig(cuda_graphs=False).to_dict()["cuda_graphs"] is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
            EngineConfig(cuda_graphs=bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_decodes_eagerly_with_graphs_requested_and_gives_the_same_tokens(dtype):
    outs = []
    for graphs in (True, False):
        llm = LLM("tiny-random", dtype=dtype, kv_cache_tokens=1024, cuda_graphs=graphs)
        assert llm.decode_graphs is None  # the fallback: no CUDA, no graphs
        assert llm.allocator.capacity == llm.pool.num_slots == 1024  # no padding page kept off CUDA
        outs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
        llm.check_idle()
    assert outs[0] == outs[1]


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets(100)[-2:] == (64, 100)
    for max_rows in (1, 2, 3, 7, 64, 100):
        sizes = buckets(max_rows)
        for n in range(1, max_rows + 1):
            b = next(s for s in sizes if s >= n)
            assert b < 2 * n or b == max_rows  # at most twice the rows, so padding at most doubles a step
    with pytest.raises(ValueError):
        buckets(0)


def test_padding_rows_write_and_read_the_padding_page_alone():
    slots = [np.arange(10, 15), np.arange(40, 43)]  # contexts of 4 and 2 cached tokens, then the new one
    batch = AttentionBatch([4, 2], [1, 1], slots, [False, False])
    inputs, rows = padded_inputs([7, 9], batch, 4, pad_slot=96)
    assert inputs.tolist() == [[7, 9, 0, 0], [4, 2, 0, 0], [14, 42, 96, 96]]  # ids, positions, output slots
    assert [r.tolist() for r in rows] == [list(range(10, 15)), [40, 41, 42], [96], [96]]
    with pytest.raises(ValueError, match="decodes"):
        padded_inputs([7, 9], batch, 1, pad_slot=96)  # more rows than the bucket
    prefill = AttentionBatch([0], [3], [np.arange(3)])
    with pytest.raises(ValueError, match="decodes"):
        padded_inputs([1, 2, 3], prefill, 4, pad_slot=96)
