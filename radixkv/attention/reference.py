"""The PyTorch reference backend: gather each request's KV and run SDPA with the offset causal mask.

It runs on CPU and GPU and is the oracle every other backend is tested against.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.attention.base import AttentionBatch
from radixkv.attention.split import SplitBackend, group_of, scale_for
from radixkv.memory.kv_pool import KVPool


class ReferencePrefill:
    """Exact attention of prefill chunks, one request at a time (a ``StepPart``).

    ``plan`` builds, per request, the slot index tensor (or a slice, for
    contiguous slots) and, for a chunk after a cached prefix, the boolean
    mask ``[new_len, prefix_len + new_len]`` with ``mask[i, j] = j <=
    prefix_len + i``; a request without a prefix is plain causal attention.
    ``run`` gathers the request's K/V from the pool and calls
    ``scaled_dot_product_attention`` (grouped-query heads without copies),
    except that a chunk of at most ``small_prefill`` tokens after a prefix is
    written out as two ``bmm`` calls (``short_chunk``).
    """

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None, small_prefill: int = 256):
        self.pool, self.group = pool, group_of(pool, num_qo_heads)
        self.scale, self.small_prefill = scale_for(pool, scale), small_prefill
        # per request: (first query row, new_len, slots, additive or boolean mask, mode)
        self._plan: list[tuple[int, int, torch.Tensor | slice, torch.Tensor | None, str]] = []

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        dev, start = self.pool.device, 0
        self._plan = []
        for r in requests:
            p, n = batch.prefix_lens[r], batch.new_lens[r]
            slots = np.asarray(batch.slots[r], dtype=np.int64)
            if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and (np.diff(slots) == 1).all():
                idx = slice(int(slots[0]), int(slots[-1]) + 1)  # contiguous slots: read a view, no gather
            else:
                idx = torch.as_tensor(slots, dtype=torch.long, device=dev)  # [p + n]
            # Only a chunk after a cached prefix needs the explicit offset mask: without a prefix the
            # causal kernel applies, and a single query (a one-token chunk) sees every position.
            mode, mask = ("causal" if n > 1 else "full"), None
            if p and n > 1:
                mask = torch.arange(p + n, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None] + p  # [n, p+n]
                mode = "masked"
                if n <= self.small_prefill:  # a short chunk after a long prefix: written out (see short_chunk)
                    mask, mode = torch.zeros(mask.shape, device=dev).masked_fill_(~mask, float("-inf")), "short"
            self._plan.append((start, n, idx, mask, mode))
            start += n

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [rows, num_qo_heads, head_dim], the planned requests' rows in order
        out = torch.empty_like(q)
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        for start, n, idx, mask, mode in self._plan:
            # contiguous slots (a slice) are read as views, no copy; other slots are gathered
            k, v = (t[idx] if isinstance(idx, slice) else torch.index_select(t, 0, idx) for t in (k_all, v_all))
            if mode == "short":
                out[start : start + n] = self.short_chunk(q[start : start + n], k, v, mask)
                continue
            # 4-D [1, heads, tokens, head_dim] inputs: the layout SDPA's fused CPU kernels take
            k, v = (t.to(q.dtype).transpose(0, 1)[None] for t in (k, v))  # [1, num_kv_heads, L, head_dim]
            qr = q[start : start + n].transpose(0, 1)[None]  # [1, num_qo_heads, n, head_dim]
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, is_causal=mode == "causal",
                                               scale=self.scale, enable_gqa=self.group > 1)
            out[start : start + n] = o[0].transpose(0, 1)  # o: [1, num_qo_heads, n, head_dim]
        return out

    def short_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention of a short chunk after a prefix, as two bmm calls (CPU SDPA with a mask is slower).

        q: ``[n, num_qo_heads, D]``; k, v: ``[L, num_kv_heads, D]``; bias: ``[n, L]`` float32, 0 or -inf.
        A long chunk would make the ``[num_kv_heads, group * n, L]`` score tensor the bottleneck; SDPA's
        blocked kernel wins there, hence the ``small_prefill`` threshold.
        """
        n, (h, d), g = q.shape[0], k.shape[1:], self.group
        qh = q.to(k.dtype).view(n, h, g, d).permute(1, 2, 0, 3).reshape(h, g * n, d)  # [Hkv, group * n, D]
        scores = torch.bmm(qh, k.permute(1, 2, 0)).float() * self.scale  # [Hkv, group * n, L]
        scores.view(h, g, n, -1).add_(bias)
        o = torch.bmm(scores.softmax(-1).to(v.dtype), v.transpose(0, 1))  # [Hkv, group * n, D]
        return o.view(h, g, n, d).permute(2, 0, 1, 3).reshape(n, h * g, d).to(q.dtype)


class PaddedDecode:
    """A step's decodes (one query each, even a lone one) as one padded batch of two ``bmm`` calls (a ``StepPart``).

    CPU SDPA is slow for a single query row and slower still with a padding
    mask, so the products are written out: the decodes' slots padded to the
    longest, a length mask, scores in the pool's dtype (as transformers'
    eager attention computes them), a float32 softmax.
    """

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None):
        self.pool, self.group, self.scale = pool, group_of(pool, num_qo_heads), scale_for(pool, scale)
        self._idx: torch.Tensor | None = None  # [B * Lmax] int64 slots, padding reads slot 0
        self._valid: torch.Tensor | None = None  # [1, B, 1, Lmax] bool

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        self.plan_slots([np.asarray(batch.slots[r], dtype=np.int64) for r in requests])

    def plan_slots(self, slot_lists: list[np.ndarray]) -> None:
        """Plan decodes over these slot lists (one per request, each at least one slot; possibly none)."""
        if not slot_lists:
            self._idx = self._valid = None
            return
        lens = np.array([len(s) for s in slot_lists])
        valid = np.arange(lens.max())[None, :] < lens[:, None]  # [B, Lmax]
        idx = np.zeros(valid.shape, dtype=np.int64)  # padding reads slot 0, masked out
        idx[valid] = np.concatenate(slot_lists)
        self._idx = torch.as_tensor(idx.reshape(-1), device=self.pool.device)
        self._valid = torch.as_tensor(valid, device=self.pool.device)[None, :, None, :]

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [B, num_qo_heads, head_dim], the planned decodes' rows in order
        b, h, g, d = q.shape[0], self.pool.num_kv_heads, self.group, q.shape[-1]
        qd = q.to(self.pool.dtype).reshape(b, h, g, d).transpose(0, 1).reshape(h * b, g, d)
        scores, v = self.scores(qd, layer)
        o = torch.bmm(scores.softmax(-1).to(v.dtype), v)  # [Hkv * B, group, head_dim]
        return o.view(h, b, g, d).transpose(0, 1).reshape(b, -1, d).to(q.dtype)

    def scores(self, qd: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked scores of the planned decodes over their padded slots, and those slots' V.

        qd: ``[Hkv * B, group, D]`` (head-major, the pool's dtype) -> scores
        ``[Hkv * B, group, Lmax]`` float32 with -inf on padding, V ``[Hkv * B, Lmax, D]``.
        ``index_select`` on the flat slot list is several times faster than advanced indexing, and
        head-major copies make both products plain ``bmm`` calls without hidden copies.
        """
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        b, width, h, d = self._valid.shape[1], self._valid.shape[-1], k_all.shape[1], k_all.shape[2]
        k, v = (torch.index_select(t, 0, self._idx).view(b * width, h, d).transpose(0, 1).reshape(h * b, width, d)
                for t in (k_all, v_all))
        scores = torch.bmm(qd, k.transpose(1, 2)).float() * self.scale  # [Hkv * B, group, Lmax]
        scores.view(h, b, -1, width).masked_fill_(~self._valid, float("-inf"))
        return scores, v


class TorchReferenceBackend(SplitBackend):
    """Exact attention over paged KV: prefills one request at a time (``ReferencePrefill``), the step's decodes
    together (``PaddedDecode``). Cost per layer: O(sum over requests of new_len * (prefix_len + new_len)).

    In float32 every path is exact. In 16-bit dtypes the written-out paths
    round scores to the pool's dtype before a float32 softmax (as
    transformers' eager attention does) while SDPA keeps them in float32, so
    outputs are within 16-bit rounding of exact attention, not bit-equal
    across the ``small_prefill`` threshold.
    """

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None, small_prefill: int = 256):
        super().__init__("torch", pool, num_qo_heads, scale,
                         prefill=ReferencePrefill(pool, num_qo_heads, scale, small_prefill),
                         decode=PaddedDecode(pool, num_qo_heads, scale))
