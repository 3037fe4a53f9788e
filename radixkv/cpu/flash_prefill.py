"""Prefill chunks through PyTorch's fused CPU flash attention, a chunk's cached prefix as a cascade.

PyTorch's CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) multiplies through
oneDNN's GEMMs, which on CPUs with AMX tiles run several times faster than ``paged_prefill``'s
AVX-512 BF16 dot products; it only takes dense K/V and top-left causal masks, and a chunk after a
cached prefix needs a bottom-right one. So each chunk is two calls whose results are merged by their
log-sum-exp (FlashInfer's cascade merge): the prefix, with no mask, every query of a KV head's group
folded into rows of that head (no copy of K/V per query head); and the chunk itself, causal, with its
K/V repeated per query head. ``FlashPrefill`` is a ``StepPart``; ``radixkv.cpu.paged_attention`` picks
it over ``paged_prefill`` where it measures faster on this CPU (``prefer_flash``).
"""

from __future__ import annotations

import numpy as np
import torch

from radixkv.attention.base import AttentionBatch
from radixkv.attention.split import group_of, scale_for
from radixkv.cpu.capabilities import CpuCapabilities, cpu_capabilities
from radixkv.memory.kv_pool import KVPool

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def amx_prefill(dtype: torch.dtype, caps: CpuCapabilities | None = None) -> bool:
    """Whether prefill chunks go through ``FlashPrefill``: bfloat16 on a CPU with AMX tiles (Sapphire Rapids
    and later; ``caps``, ``cpu_capabilities()`` by default), whose oneDNN GEMMs outrun ``paged_prefill``'s
    dot products there."""
    return dtype == torch.bfloat16 and (caps or cpu_capabilities()).amx


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two key sets from each one's output and log-sum-exp.

    o: [heads, rows, head_dim]; lse: [heads, rows] float32 (natural log). Returns float32."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


class FlashPrefill:
    """A step's prefill chunks, one request at a time, through PyTorch's CPU flash kernel (a ``StepPart``);
    see the module docstring. Costs per request: a gather of its K/V rows and two kernel calls."""

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None):
        self.pool, self.group, self.scale = pool, group_of(pool, num_qo_heads), scale_for(pool, scale)
        self._plan: list[tuple[int, int, int, torch.Tensor]] = []  # per request: first row, new, prefix, slots

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        self._plan, start = [], 0
        for r in requests:
            p, n = batch.prefix_lens[r], batch.new_lens[r]
            self._plan.append((start, n, p, torch.from_numpy(np.asarray(batch.slots[r], dtype=np.int64))))
            start += n

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [rows, num_qo_heads, head_dim], the planned chunks' rows in order
        out = torch.empty_like(q)
        for start, n, p, slots in self._plan:
            out[start : start + n] = self.one(q[start : start + n].to(self.pool.dtype), layer, p, slots).to(q.dtype)
        return out

    def one(self, q: torch.Tensor, layer: int, p: int, slots: torch.Tensor) -> torch.Tensor:
        """One chunk: q [n, H, D] after ``p`` cached tokens, ``slots`` [p + n]; returns [n, H, D]."""
        n, heads, dim = q.shape
        kv_heads, g = heads // self.group, self.group
        k = torch.index_select(self.pool.k[layer], 0, slots).transpose(0, 1)  # [KVH, p + n, D]
        v = torch.index_select(self.pool.v[layer], 0, slots).transpose(0, 1)
        qh = q.transpose(0, 1)  # [H, n, D]
        k_new = k[:, p:].repeat_interleave(g, 0)[None]  # [1, H, n, D]: the causal part needs one per query head
        v_new = v[:, p:].repeat_interleave(g, 0)[None]
        o_new, lse_new = _FLASH(qh[None], k_new, v_new, 0.0, True, scale=self.scale)  # [1, H, n, D], [1, H, n]
        if p == 0:
            return o_new[0].transpose(0, 1)
        folded = qh.reshape(kv_heads, g * n, dim)[None]  # head h = kvh * g + j: a group's queries as rows
        o_pre, lse_pre = _FLASH(folded, k[None, :, :p], v[None, :, :p], 0.0, False, scale=self.scale)
        o = merge(o_pre[0].reshape(heads, n, dim), lse_pre[0].reshape(heads, n), o_new[0], lse_new[0])
        return o.transpose(0, 1)
