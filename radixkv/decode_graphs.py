"""Decode steps under CUDA graphs: one graph per batch-size bucket, captured once, replayed at each step.

A decode step of a small model is bound by kernel launches (about ten kernels a layer), not by memory or
arithmetic; a replayed graph launches them all at once. As in vLLM and SGLang, each bucket of B rows (1, 2,
4, ... up to the engine's ``max_running``) has a graph captured over fixed input buffers, with a FlashInfer
decode wrapper made for capture (``use_cuda_graph=True``): its page table lives in fixed buffers that
``plan`` refills before each replay, so one graph serves any contexts. A step of n decodes replays the
smallest bucket B >= n; its B - n padding rows write and read the pool's last page, which the engine keeps
out of its allocator (``EngineConfig.cuda_graphs``), so they touch no request's KV.

Only steps of decodes alone replay, and only with FlashInfer on CUDA; prefill chunks, mixed steps and every
other backend run eagerly. The arithmetic (``buckets``, ``padded_inputs``) needs no GPU, and the replays are
tested on a CPU too, CUDA's capture and FlashInfer's wrapper stood in (tests/test_decode_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from radixkv.attention.base import AttentionBatch
from radixkv.attention.flashinfer_backend import FlashInferBackend, page_table
from radixkv.memory.kv_pool import KVPool
from radixkv.model.llama import LlamaForCausalLM


def buckets(max_rows: int) -> tuple[int, ...]:
    """The batch sizes captured: the powers of two below ``max_rows``, then ``max_rows`` itself, so every
    decode batch the scheduler can form (at most ``max_running`` rows) has a bucket at most twice its size.

    >>> buckets(64), buckets(12), buckets(1)
    ((1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 12), (1,))
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return (*(1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows), max_rows)


def padded_inputs(tokens: Sequence[int], batch: AttentionBatch, rows: int,
                  pad_slot: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """A decode step's inputs padded to ``rows``: ``[3, rows]`` int64 (token ids, positions, output slots) and
    every row's slots for the page table. Padding rows decode token 0 at position 0 into ``pad_slot`` (the
    first slot of the padding page) and attend to that slot alone. O(rows + total slots)."""
    n = len(tokens)
    if n > rows or batch.prefills() or len(batch.new_lens) != n:
        raise ValueError(f"padded_inputs takes up to {rows} decodes, one token each (got {n} tokens, "
                         f"new_lens {list(batch.new_lens)}, prefills {batch.prefills()})")
    inputs = np.zeros((3, rows), dtype=np.int64)
    inputs[2] = pad_slot
    inputs[0, :n] = tokens
    inputs[1, :n] = batch.prefix_lens  # a decode's one token sits right after its cached prefix
    inputs[2, :n] = [s[-1] for s in batch.slots]
    pad = np.array([pad_slot], dtype=np.int64)
    return inputs, [*batch.slots, *[pad] * (rows - n)]


def capture(run: Callable[[], Any], device: torch.device | str, memory: Any = None
            ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run()`` captured in a CUDA graph on ``device`` (in the graph memory pool ``memory``, None: its own),
    after one run off the capture, on a side stream (lazy inits, cuBLAS workspaces): the graph and the output
    its replays write over."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory):
        out = run()
    return graph, out


class _GraphAttention:
    """The attention backend the captured model calls: one bucket's wrapper over the pool's pages."""

    name = "flashinfer"

    def __init__(self, wrapper, pool: KVPool):
        self.wrapper, self.pool = wrapper, pool

    def plan(self, batch: AttentionBatch) -> None:  # DecodeGraphs plans the wrapper itself, before each replay
        raise NotImplementedError

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [rows, num_qo_heads, head_dim] -> the same shape
        return self.wrapper.run(q, self.pool.pages(layer))


class DecodeGraphs:
    """Every bucket's graph (``buckets(max_rows)``), captured at construction, largest first so that the
    smaller ones reuse its memory; ``covers`` a step, then ``prepare`` and ``replay`` it.

    The pool's last page is the padding page: the caller must never hand out its slots.
    """

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, backend: FlashInferBackend, max_rows: int):
        import flashinfer  # lazy: only a GPU with the gpu extra gets here

        self.model, self.pool, self.backend = model, pool, backend
        self.sizes = buckets(max_rows)
        self.pad_slot = (pool.num_pages - 1) * pool.page_size
        big, dev = self.sizes[-1], pool.device
        pages_per_row = min(pool.num_pages, -(-model.config.max_position_embeddings // pool.page_size))
        # The fixed buffers every graph reads, shared by the buckets (a bucket of B uses the first B rows):
        # inputs [3, big] int64 (token ids, positions, output slots), which _fill rewrites before a replay;
        # the page table's indptr [big + 1], indices [big x pages per row] and last page lengths [big], int32,
        # which the wrapper's plan() rewrites.
        self.inputs = torch.zeros(3, big, dtype=torch.long, device=dev)
        indptr = torch.zeros(big + 1, dtype=torch.int32, device=dev)
        indices = torch.zeros(big * pages_per_row, dtype=torch.int32, device=dev)
        last = torch.zeros(big, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, torch.Tensor]] = {}
        self._ready: tuple[torch.cuda.CUDAGraph, torch.Tensor, int] | None = None
        self.replays = 0  # steps replayed so far (what tests and benchmarks check graphs ran)
        with torch.cuda.device(dev):  # captures run on the current device: make it the pool's
            memory = torch.cuda.graph_pool_handle()
            for b in reversed(self.sizes):
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    backend._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=backend.decode_tensor_cores,
                    paged_kv_indptr_buffer=indptr[: b + 1], paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last[:b])
                self._graphs[b] = self._capture(b, wrapper, memory)

    def _capture(self, b: int, wrapper, memory) -> tuple[torch.cuda.CUDAGraph, object, torch.Tensor]:
        ids, positions, slots = self.inputs[:, :b]
        attention = _GraphAttention(wrapper, self.pool)
        self._fill(wrapper, b, [], AttentionBatch([], [], []))  # every row padding while capturing
        graph, logits = self._record(lambda: self.model(ids, positions, slots, self.pool, attention), memory)
        return graph, wrapper, logits  # logits: [b, vocab]

    def _record(self, run, memory) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``capture`` on the pool's device (the CPU tests stand it in)."""
        return capture(run, self.pool.device, memory)

    def _fill(self, wrapper, b: int, tokens: Sequence[int], batch: AttentionBatch) -> None:
        inputs, slot_lists = padded_inputs(tokens, batch, b, self.pad_slot)
        self.inputs[:, :b].copy_(torch.from_numpy(inputs))
        # host tensors: plan() reads them on the CPU anyway, so nothing waits on the GPU
        indptr, indices, last = (torch.from_numpy(a) for a in page_table(slot_lists, self.pool.page_size))
        wrapper.plan(indptr=indptr, indices=indices, last_page_len=last, head_dim=self.pool.head_dim,
                     **self.backend.plan_args())

    def covers(self, batch: AttentionBatch) -> bool:
        """Whether ``batch`` replays a graph: decodes alone, no more than the largest bucket."""
        return len(batch.new_lens) <= self.sizes[-1] and not batch.prefills()

    def prepare(self, tokens: Sequence[int], batch: AttentionBatch) -> None:
        """Fill the inputs and plan the page table of a step that ``covers``: ``tokens[r]`` is decode r's token."""
        b = next(size for size in self.sizes if size >= len(tokens))
        graph, wrapper, logits = self._graphs[b]
        self._fill(wrapper, b, tokens, batch)
        self._ready = graph, logits, len(tokens)

    def replay(self) -> torch.Tensor:
        """Run the prepared step: logits ``[n, vocab]`` of its n decodes (padding rows dropped), a copy, since
        the graphs share one memory pool and the next replay writes over the graph's own output."""
        if self._ready is None:
            raise RuntimeError("DecodeGraphs.replay before prepare")
        (graph, logits, n), self._ready = self._ready, None
        graph.replay()
        self.replays += 1
        return logits[:n].clone()
