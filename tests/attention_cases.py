"""Random paged-attention batches shared by the CPU and GPU attention tests."""

from __future__ import annotations

import torch

from radixkv import SlotAllocator
from radixkv.attention import AttentionBatch
from radixkv.kv_pool import KVPool


def make_case(prefix_lens, new_lens, page_size, num_kv_heads=2, group=2, head_dim=16,
              dtype=torch.float32, device="cpu", seed=0):
    """A pool holding every request's prefix + new K/V at page-aligned slots, and the step's queries.

    Returns (pool, batch, q, dense) where dense[r] = (k, v) of request r's whole sequence,
    ``[prefix + new, num_kv_heads, head_dim]``.
    """
    g = torch.Generator().manual_seed(seed)
    alloc = SlotAllocator(4 * sum(p + n for p, n in zip(prefix_lens, new_lens, strict=True)) + 64 * page_size,
                          page_size=page_size)
    alloc.alloc(3)  # so no request starts at slot 0
    pool = KVPool(1, num_kv_heads, head_dim, num_slots=alloc.capacity, page_size=page_size, dtype=dtype,
                  device=device)
    slots, dense = [], []
    for p, n in zip(prefix_lens, new_lens, strict=True):
        s = alloc.alloc(p + n)
        k = torch.randn(p + n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(p + n, num_kv_heads, head_dim, generator=g).to(dtype)
        pool.store(0, k.to(device), v.to(device), s)
        slots.append(s)
        dense.append((k, v))
    q = torch.randn(sum(new_lens), num_kv_heads * group, head_dim, generator=g).to(dtype).to(device)
    return pool, AttentionBatch(list(prefix_lens), list(new_lens), slots), q, dense


def dense_attention(q, dense, prefix_lens, new_lens, group):
    """Plain causal attention over each request's full sequence, in float32; the last new_len rows."""
    outs, start = [], 0
    for (k, v), p, n in zip(dense, prefix_lens, new_lens, strict=True):
        qr = q[start : start + n].float().cpu()  # [n, Hq, D]
        kk = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vv = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", qr, kk) / kk.shape[-1] ** 0.5
        causal = torch.arange(p + n)[None, :] <= (torch.arange(n)[:, None] + p)
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(outs)
