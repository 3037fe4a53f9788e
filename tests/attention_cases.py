"""Random paged-attention batches, the float32 oracle and the 16-bit tolerance, shared by the CPU and GPU
attention tests.

The tolerance. A 16-bit backend and the oracle read the same K, V and q (already rounded to the pool's
dtype); the backend adds only rounding, of unit roundoff ``u`` (2**-8 for bfloat16, 2**-11 for float16):
its output's (at most ``u * |o|``), and either the probabilities' before the P.V product (FlashInfer's
FA2/FA3 kernels) or the scores' before the softmax (the reference's written-out paths), each within ``u``
of the term it rounds. With unit-scale K/V those sum to about ``u * (|o| + 1)``: the reference measures at
most 1.98x that over every case, shape, page size, dtype and seed of the GPU tests. The bound is five
times that, ``|out - oracle| <= 10u * (|oracle| + 1)``: 0.039 * (|o| + 1) in bfloat16, 0.0049 * (|o| + 1)
in float16. A wrong mask or page moves some output of every case by 0.25 or more (``FAULTS``: 0.25 for a
mask off by one, 0.36 for pages read from the next one, 2.6 for a prefix ignored), far outside it.
``test_tolerance_separates_rounding_from_a_wrong_mask_or_page`` re-measures both sides on every run.
"""

from __future__ import annotations

import torch

from radixkv import SlotAllocator
from radixkv.attention import AttentionBatch
from radixkv.memory.kv_pool import KVPool

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ROUNDING_UNITS = 10  # the bound, in units of u * (|o| + 1); rounding reaches at most 2 of them
FAULTS = ("mask off by one", "prefix ignored", "pages shifted")


def make_layered_case(prefix_lens, new_lens, page_size, num_kv_heads=2, group=2, head_dim=16, num_layers=1,
                      dtype=torch.float32, device="cpu", seed=0):
    """A pool of ``num_layers`` layers holding every request's prefix + new K/V at page-aligned slots (other
    values per layer), and the step's queries per layer.

    Returns (pool, batch, qs, dense): ``qs[layer]`` ``[sum(new), num_kv_heads * group, head_dim]``;
    ``dense[layer][r] = (k, v)`` of request r's whole sequence, ``[prefix + new, num_kv_heads, head_dim]``.
    """
    g = torch.Generator().manual_seed(seed)
    alloc = SlotAllocator(4 * sum(p + n for p, n in zip(prefix_lens, new_lens, strict=True)) + 64 * page_size,
                          page_size=page_size)
    alloc.alloc(3)  # so no request starts at slot 0
    pool = KVPool(num_layers, num_kv_heads, head_dim, num_slots=alloc.capacity, page_size=page_size, dtype=dtype,
                  device=device)
    slots = [alloc.alloc(p + n) for p, n in zip(prefix_lens, new_lens, strict=True)]
    dense = []
    for layer in range(num_layers):
        dense.append([])
        for s in slots:
            k = torch.randn(len(s), num_kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(len(s), num_kv_heads, head_dim, generator=g).to(dtype)
            pool.store(layer, k.to(device), v.to(device), s)
            dense[layer].append((k, v))
    qs = [torch.randn(sum(new_lens), num_kv_heads * group, head_dim, generator=g).to(dtype).to(device)
          for _ in range(num_layers)]
    return pool, AttentionBatch(list(prefix_lens), list(new_lens), slots), qs, dense


def make_case(prefix_lens, new_lens, page_size, num_kv_heads=2, group=2, head_dim=16,
              dtype=torch.float32, device="cpu", seed=0):
    """``make_layered_case`` with one layer: (pool, batch, q, dense) with ``dense[r] = (k, v)``."""
    pool, batch, qs, dense = make_layered_case(prefix_lens, new_lens, page_size, num_kv_heads, group, head_dim, 1,
                                               dtype, device, seed)
    return pool, batch, qs[0], dense[0]


def dense_attention(q, dense, prefix_lens, new_lens, group, fault=None, page_size=1):
    """Plain causal attention over each request's full sequence, in float32; the last new_len rows.

    ``fault`` (one of ``FAULTS``) computes what a buggy backend would: every query missing its own key
    (the first position of a sequence seeing one key too many instead), causal attention counted from the
    chunk's start instead of after the prefix, or every page read from the next one (the last from elsewhere).
    """
    outs, start = [], 0
    for (k, v), p, n in zip(dense, prefix_lens, new_lens, strict=True):
        qr = q[start : start + n].float().cpu()  # [n, Hq, D]
        kk = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vv = v.float().repeat_interleave(group, dim=1)
        if fault == "pages shifted":  # page i read from page i + 1; the last from a page of other values
            other = torch.randn((2, page_size, *kk.shape[1:]), generator=torch.Generator().manual_seed(1))
            kk, vv = torch.cat([kk[page_size:], other[0]])[: len(kk)], torch.cat([vv[page_size:], other[1]])[: len(vv)]
        scores = torch.einsum("nhd,lhd->hnl", qr, kk) / kk.shape[-1] ** 0.5
        last = torch.arange(n)[:, None] + p  # [n, 1]: the last key each query sees
        if fault == "mask off by one":
            last = torch.where(last > 0, last - 1, last + 1)
        elif fault == "prefix ignored":
            last = last - p
        causal = torch.arange(p + n)[None, :] <= last
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(outs)


def rounding_bound(oracle: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, how far a correct ``dtype`` backend may be from the float32 oracle (module docstring)."""
    return ROUNDING_UNITS * UNIT_ROUNDOFF[dtype] * (oracle.abs() + 1)


def assert_within_rounding(out: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    """Fail unless every element of ``out`` is within ``rounding_bound``; returns the worst error / bound."""
    oracle = oracle.float().cpu()
    ratio = ((out.float().cpu() - oracle).abs() / rounding_bound(oracle, dtype)).max().item()
    assert ratio <= 1, f"{what}: error reaches {ratio:.2f}x the rounding bound (a wrong mask, page or scale?)"
    return ratio
