"""Decode attention that reads a prefix shared by the whole decode batch once (cascade attention).

When every decoding request of a step starts with the same KV slots (a
shared system prompt cached in the radix tree), the reference backend still
gathers and reads those slots once per request. Decode attention on a CPU is
bound by memory traffic, so this backend splits it in two levels, as
FlashInfer's cascade attention does:

* the shared prefix ``[S]``: every request's queries against one copy of its
  K/V, one ``bmm`` for the whole batch;
* each request's own remainder ``[R_b]``: the reference backend's padded batch
  (``PaddedDecode``, which this part holds).

The two partial softmaxes are merged exactly (common running maximum, summed
normalizers), so the result equals attention over the concatenation up to
rounding. Prefills are the reference backend's.
"""

from __future__ import annotations

import numpy as np
import torch

from radixkv.attention.base import AttentionBatch
from radixkv.attention.reference import PaddedDecode, ReferencePrefill
from radixkv.attention.split import SplitBackend, group_of, scale_for
from radixkv.memory.kv_pool import KVPool


def shared_slot_prefix(slots: list[np.ndarray]) -> int:
    """Length of the longest slot prefix common to every array, leaving each at least one slot of its own."""
    n = min(len(s) for s in slots) - 1
    if n <= 0:
        return 0
    head = np.stack([s[:n] for s in slots])  # [B, n]
    differs = (head != head[0]).any(axis=0)
    return int(np.argmax(differs)) if differs.any() else n


class CascadeDecode:
    """A step's decodes in two levels, shared prefix then own remainder (a ``StepPart``).

    A shared prefix shorter than ``min_shared`` tokens is not worth the second
    level; such steps run the reference's padded decode unchanged.
    """

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None, min_shared: int = 64):
        self.pool, self.group, self.scale = pool, group_of(pool, num_qo_heads), scale_for(pool, scale)
        self.min_shared = min_shared
        self.padded = PaddedDecode(pool, num_qo_heads, scale)  # the remainders, or everything without a prefix
        self.shared: torch.Tensor | None = None  # [S] int64 slots of the planned step's shared prefix, if any

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        slots = [np.asarray(batch.slots[r], dtype=np.int64) for r in requests]
        shared = shared_slot_prefix(slots) if len(requests) > 1 else 0
        short = shared < self.min_shared  # not worth the second level: the padded decode alone
        self.shared = None if short else torch.as_tensor(slots[0][:shared], device=self.pool.device)
        self.padded.plan_slots(slots if short else [s[shared:] for s in slots])

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [B, num_qo_heads, head_dim], the planned decodes' rows in order
        if self.shared is None:
            return self.padded.run(q, layer)
        k_all, v_all = self.pool.k[layer], self.pool.v[layer]
        b, h, g, d = q.shape[0], k_all.shape[1], self.group, q.shape[-1]
        qd = q.to(k_all.dtype).reshape(b, h, g, d).transpose(0, 1)  # [Hkv, B, group, D]
        # Level 1: the shared prefix, read once for the whole batch.
        ks, vs = (torch.index_select(t, 0, self.shared).transpose(0, 1) for t in (k_all, v_all))  # [Hkv, S, D]
        s1 = torch.bmm(qd.reshape(h, b * g, d), ks.transpose(1, 2)).float() * self.scale  # [Hkv, B * group, S]
        # Level 2: each request's own slots, padded to the longest.
        s2, v = self.padded.scores(qd.reshape(h * b, g, d), layer)  # [Hkv * B, group, R], [Hkv * B, R, D]
        s2 = s2.view(h, b * g, -1)
        # Exact merge: one running maximum, one normalizer over both levels.
        m = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True))  # [Hkv, B * group, 1]
        p1, p2 = (s1 - m).exp_(), (s2 - m).exp_()
        norm = p1.sum(-1, keepdim=True) + p2.sum(-1, keepdim=True)
        o = torch.bmm(p1.to(vs.dtype), vs).float()  # [Hkv, B * group, D]
        o += torch.bmm(p2.view(h * b, g, -1).to(v.dtype), v).view(h, b * g, d).float()
        return (o / norm).view(h, b, g, d).transpose(0, 1).reshape(b, -1, d).to(q.dtype)  # via [B, Hkv, group, D]


class SharedPrefixTorchBackend(SplitBackend):
    """The reference backend's prefills (``ReferencePrefill``) with two-level decode attention (``CascadeDecode``)."""

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None, min_shared: int = 64):
        super().__init__("torch-cascade", pool, num_qo_heads, scale,
                         prefill=ReferencePrefill(pool, num_qo_heads, scale),
                         decode=CascadeDecode(pool, num_qo_heads, scale, min_shared))
