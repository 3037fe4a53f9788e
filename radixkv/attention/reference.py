"""The PyTorch reference backend: gather each request's KV and run SDPA with the offset causal mask.

It runs on CPU and GPU and is the oracle every other backend is tested against.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.attention.base import AttentionBatch
from radixkv.kv_pool import KVPool


class TorchReferenceBackend:
    """Exact attention over paged KV: prefills one request at a time, the step's decodes together.

    ``plan`` builds, per request, the slot index tensor and, for a prefill
    after a cached prefix, the boolean mask ``[new_len, prefix_len + new_len]``
    with ``mask[i, j] = j <= prefix_len + i`` (a request without a prefix is
    plain causal attention; a decode sees every position).
    ``run`` gathers that request's K/V from the pool and calls
    ``scaled_dot_product_attention`` (grouped-query heads without copies; a
    request without a prefix uses the plain causal kernel).
    The decodes of a step (one query each, even a lone one) run as one padded
    batch with a length mask, written out as two ``bmm`` calls per layer: CPU
    SDPA is slow for a single query row and slower still with a padding mask.
    Cost per layer: O(sum over requests of new_len * (prefix_len + new_len)).

    In float32 every path is exact. In 16-bit dtypes the written-out paths
    round scores to the pool's dtype before a float32 softmax (as
    transformers' eager attention does) while SDPA keeps them in float32, so
    outputs are within 16-bit rounding of exact attention, not bit-equal
    across the ``small_prefill`` threshold.
    """

    name = "torch"

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None, small_prefill: int = 256):
        if num_qo_heads % pool.num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {pool.num_kv_heads}")
        self.pool, self.num_qo_heads = pool, num_qo_heads
        self.group = num_qo_heads // pool.num_kv_heads
        self.scale = scale if scale is not None else pool.head_dim**-0.5
        self.small_prefill = small_prefill
        self._plan: list[tuple[int, int, torch.Tensor | slice, torch.Tensor | None, str]] = []
        self._decodes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def plan(self, batch: AttentionBatch) -> None:
        dev = self.pool.device
        self._plan = []
        starts = batch.qo_indptr[:-1]
        decodes = [r for r, n in enumerate(batch.new_lens) if n == 1]
        self._decodes = self._plan_decodes(batch, decodes, starts) if decodes else None
        skip = set(decodes) if self._decodes is not None else set()
        for r, (p, n, slots) in enumerate(zip(batch.prefix_lens, batch.new_lens, batch.slots, strict=True)):
            start = int(starts[r])
            if r in skip:
                continue
            slots = np.asarray(slots, dtype=np.int64)
            if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and (np.diff(slots) == 1).all():
                idx = slice(int(slots[0]), int(slots[-1]) + 1)  # contiguous slots: read a view, no gather
            else:
                idx = torch.as_tensor(slots, dtype=torch.long, device=dev)  # [p + n]
            # Only a prefill after a cached prefix needs the explicit offset mask: without a prefix the
            # causal kernel applies, and a decode's single query sees every position.
            mode, mask = ("causal" if n > 1 else "full"), None
            if p and n > 1:
                mask = torch.arange(p + n, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None] + p  # [n, p+n]
                mode = "masked"
                if n <= self.small_prefill:  # a short chunk after a long prefix: written out (see _short_chunk)
                    mask, mode = torch.zeros(mask.shape, device=dev).masked_fill_(~mask, float("-inf")), "short"
            self._plan.append((start, n, idx, mask, mode))

    def _plan_decodes(self, batch: AttentionBatch, rows: list[int], starts: np.ndarray):
        """All decodes of the step as one padded batch: flat slots, mask and the decodes' query rows."""
        q_rows = torch.as_tensor(starts[rows], dtype=torch.long, device=self.pool.device)
        return (*self._padded_slots([batch.slots[r] for r in rows]), q_rows)

    def _padded_slots(self, slot_lists: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot lists padded to the longest: flat slots ``[B * Lmax]`` and valid mask ``[1, B, 1, Lmax]``."""
        dev = self.pool.device
        lens = [len(s) for s in slot_lists]
        width = max(lens)
        idx = np.zeros((len(slot_lists), width), dtype=np.int64)  # padding reads slot 0, masked out
        for i, s in enumerate(slot_lists):
            idx[i, : lens[i]] = s
        valid = torch.arange(width, device=dev)[None, :] < torch.as_tensor(lens, device=dev)[:, None]
        return torch.as_tensor(idx.reshape(-1), device=dev), valid[None, :, None, :]

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [num_tokens, num_qo_heads, head_dim]
        out = torch.empty_like(q)
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        for start, n, idx, mask, mode in self._plan:
            if isinstance(idx, slice):
                k, v = k_all[idx], v_all[idx]  # views, no copy
            else:
                k, v = torch.index_select(k_all, 0, idx), torch.index_select(v_all, 0, idx)
            if mode == "short":
                out[start : start + n] = self._short_chunk(q[start : start + n], k, v, mask)
                continue
            # 4-D [1, heads, tokens, head_dim] inputs: the layout SDPA's fused CPU kernels take
            k = k.to(q.dtype).transpose(0, 1)[None]  # [1, num_kv_heads, L, head_dim]
            v = v.to(q.dtype).transpose(0, 1)[None]
            qr = q[start : start + n].transpose(0, 1)[None]  # [1, num_qo_heads, n, head_dim]
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, is_causal=mode == "causal",
                                               scale=self.scale, enable_gqa=self.group > 1)
            out[start : start + n] = o[0].transpose(0, 1)  # o: [1, num_qo_heads, n, head_dim]
        if self._decodes is not None:  # every decode of the step in one call
            self._run_decodes(q, layer, out)
        return out

    def _short_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention of a short chunk after a prefix, as two bmm calls (2x faster than CPU SDPA with a mask).

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

    def _run_decodes(self, q: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        """The planned decodes as one padded batch, written into their rows of ``out``."""
        _, valid, rows = self._decodes
        b, h, g, d = valid.shape[1], self.pool.num_kv_heads, self.group, q.shape[-1]
        qd = q[rows].to(self.pool.dtype).view(b, h, g, d).transpose(0, 1).reshape(h * b, g, d)
        scores, v = self._padded_scores(qd, layer)
        o = torch.bmm(scores.softmax(-1).to(v.dtype), v)  # [Hkv * B, group, head_dim]
        out[rows] = o.view(h, b, g, d).transpose(0, 1).reshape(b, -1, d).to(q.dtype)

    def _padded_scores(self, qd: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked scores of the planned decodes over their padded slots, and those slots' V.

        qd: ``[Hkv * B, group, D]`` (head-major, the pool's dtype) -> scores
        ``[Hkv * B, group, Lmax]`` float32 with -inf on padding, V ``[Hkv * B, Lmax, D]``.
        Written out rather than SDPA: with a padding mask, CPU SDPA takes a slow path (5x in bf16).
        ``index_select`` on the flat slot list is several times faster than advanced indexing, and
        head-major copies make both products plain ``bmm`` calls without hidden copies. The products
        run in the pool's dtype (as transformers' eager attention does), the softmax in float32.
        """
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        idx, valid, _ = self._decodes
        b, width, h, d = valid.shape[1], valid.shape[-1], k_all.shape[1], k_all.shape[2]
        k = torch.index_select(k_all, 0, idx).view(b * width, h, d).transpose(0, 1).reshape(h * b, width, d)
        v = torch.index_select(v_all, 0, idx).view(b * width, h, d).transpose(0, 1).reshape(h * b, width, d)
        scores = torch.bmm(qd, k.transpose(1, 2)).float() * self.scale  # [Hkv * B, group, Lmax]
        scores.view(h, b, -1, width).masked_fill_(~valid, float("-inf"))
        return scores, v
