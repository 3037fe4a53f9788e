"""Decode under CUDA graphs, what a CPU can check: the switch (``EngineConfig.cuda_graphs``) is validated and
falls back to eager decode off CUDA with the same greedy tokens, and the buckets' and padding's arithmetic.
The graphs themselves against eager decode: tests/test_engine_gpu.py."""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest
import torch

from radixkv import LLM, SamplingParams
from radixkv.attention import AttentionBatch, TorchReferenceBackend
from radixkv.config import EngineConfig
from radixkv.decode_graphs import DecodeGraphs, buckets, padded_inputs
from radixkv.memory.allocator import SlotAllocator
from radixkv.memory.kv_pool import KVPool
from radixkv.model import load_model
from radixkv.model.step import run_step

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


class FakeDecodeWrapper:
    """FlashInfer's decode wrapper made for CUDA graphs, in PyTorch: ``plan`` copies the page table into the fixed
    buffers given at construction (its batch size fixed by them), ``run`` reads them, as the captured kernel does."""

    def __init__(self, workspace, layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                 paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
        assert use_cuda_graph and layout == "NHD"
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last = paged_kv_last_page_len_buffer
        assert len(self.indptr) == len(self.last) + 1

    def plan(self, indptr, indices, last_page_len, head_dim, num_qo_heads, num_kv_heads, page_size, sm_scale,
             q_data_type, kv_data_type):
        assert len(last_page_len) == len(self.last) and len(indices) <= len(self.indices)
        self.indptr.copy_(indptr)
        self.last.copy_(last_page_len)
        self.indices[: len(indices)].copy_(indices)
        self.page, self.scale = page_size, sm_scale

    def run(self, q, kv):
        k_pages, v_pages = kv  # [pages, page_size, kv_heads, head_dim] each
        group = q.shape[1] // k_pages.shape[2]
        out = torch.empty_like(q)
        for r in range(len(self.last)):
            pages = self.indices[self.indptr[r] : self.indptr[r + 1]].long()
            n = (len(pages) - 1) * self.page + int(self.last[r])
            k, v = (x[pages].flatten(0, 1)[:n].repeat_interleave(group, dim=1) for x in (k_pages, v_pages))
            weights = (torch.einsum("hd,nhd->hn", q[r], k) * self.scale).softmax(-1)
            out[r] = torch.einsum("hn,nhd->hd", weights, v)
        return out


class FakeGraph:
    """A captured step as its replays behave: each writes the step's output over the captured one."""

    def __init__(self, run):
        self.run, self.out = run, run()

    def replay(self):
        with torch.inference_mode():  # the model's output is an inference tensor, which a graph rewrites in place
            self.out.copy_(self.run())


def test_replayed_steps_pad_to_their_bucket_and_match_eager_decode(monkeypatch):
    """DecodeGraphs on a CPU, CUDA and FlashInfer stood in (FakeGraph, FakeDecodeWrapper): decode steps of 3, 1 and
    4 requests replay the buckets of 4, 1 and 4, give eager decode's logits, and write KV into their own slots
    and the padding page only."""
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecodeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(DecodeGraphs, "_record", lambda self, run, memory: (graph := FakeGraph(run), graph.out))
    model = load_model("tiny-random", dtype=torch.float32).model
    cfg, page = model.config, 4
    pools = [KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots=256 + page, page_size=page)
             for _ in range(2)]  # the graphs' and eager decode's, each with one padding page at its end
    reference = [TorchReferenceBackend(p, cfg.num_heads) for p in pools]
    scale = cfg.head_dim ** -0.5  # the reference backend's too
    backend = types.SimpleNamespace(_workspace=None, decode_tensor_cores=False, plan_args=lambda q_dtype=None: dict(
        num_qo_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, page_size=page, sm_scale=scale,
        q_data_type=torch.float32, kv_data_type=torch.float32))
    graphs = DecodeGraphs(model, pools[0], backend, max_rows=4)
    assert graphs.sizes == (1, 2, 4) and graphs.pad_slot == 256
    alloc = SlotAllocator(256, page_size=page)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (9, 4, 13, 6)]
    slots = [alloc.alloc(len(p) + 3) for p in prompts]  # each prompt and three decodes
    for pool, attn in zip(pools, reference, strict=True):  # the prompts' KV, the same in both pools
        run_step(model, pool, attn, prompts, AttentionBatch([0] * 4, [len(p) for p in prompts],
                                                            [s[: len(p)] for s, p in zip(slots, prompts, strict=True)]))
    for step, rows in enumerate(([0, 1, 2], [3], [0, 1, 2, 3])):
        done = [len(prompts[r]) + (step if r < 3 else step - 1) for r in rows]  # tokens whose KV is in the pool
        batch = AttentionBatch(done, [1] * len(rows), [slots[r][: d + 1] for r, d in zip(rows, done, strict=True)],
                               [False] * len(rows))
        tokens = [int(rng.integers(3, cfg.vocab_size)) for _ in rows]
        assert graphs.covers(batch)
        graphs.prepare(tokens, batch)
        ours = graphs.replay()
        eager = run_step(model, pools[1], reference[1], [[t] for t in tokens], batch)
        assert ours.shape == eager.shape == (len(rows), cfg.vocab_size)
        torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    assert graphs.replays == 3
    kv = [p._kv for p in pools]
    torch.testing.assert_close(kv[0][:, :, :256], kv[1][:, :, :256], rtol=1e-4, atol=1e-4)  # every request's KV
    assert kv[0][:, :, 256:].abs().sum() > 0 and kv[1][:, :, 256:].abs().sum() == 0  # padding wrote its page only
    assert not graphs.covers(AttentionBatch([0], [2], [np.arange(2)]))  # a prefill chunk runs eagerly
    assert not graphs.covers(AttentionBatch([1] * 5, [1] * 5, [np.arange(2)] * 5, [False] * 5))  # past the largest
