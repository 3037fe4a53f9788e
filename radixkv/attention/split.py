"""A backend built from two parts: one for a step's prefill chunks, one for its decodes.

Every CPU backend splits a step the same way: prefill chunks
(``AttentionBatch.prefills``: more than one new token, or one a caller marks
``prefilling``) and decodes (the other one-token rows), and the
two kinds take different algorithms (a causal mask after a prefix, or one
query against a whole context). ``SplitBackend`` does the split once; each
backend is a choice of parts (``StepPart``), so none overrides another's
internals, and each part keeps its own plan in its own fields.
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixkv.attention.base import AttentionBatch
from radixkv.memory.kv_pool import KVPool


class StepPart(Protocol):
    """Attention for some of a step's requests (its decodes, or its prefill chunks)."""

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        """Plan the requests (indices into ``batch``, in order; possibly none) for every layer of the step."""

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q: the planned requests' query rows, request after request ``[rows, num_qo_heads, head_dim]``;
        returns their attention output, same shape and dtype."""


class SplitBackend:
    """An attention backend whose ``plan`` hands the step's prefill chunks to ``prefill`` and its decodes to
    ``decode``, and whose ``run`` calls each part on its rows.

    When one part holds every row of the step, ``run`` returns that part's
    output as it is: no gathering of query rows, no scattering of outputs.
    """

    def __init__(self, name: str, pool: KVPool, num_qo_heads: int, scale: float | None,
                 prefill: StepPart, decode: StepPart):
        self.name, self.pool, self.num_qo_heads = name, pool, num_qo_heads
        self.group, self.scale = group_of(pool, num_qo_heads), scale_for(pool, scale)
        self.prefill, self.decode = prefill, decode
        self._parts: list[tuple[StepPart, torch.Tensor]] = []  # (part, its query rows [rows] int64), mixed steps
        self._whole: StepPart | None = None  # the part that holds every row of the step, if one does

    def plan(self, batch: AttentionBatch) -> None:
        decodes, prefills = batch.decodes(), batch.prefills()
        self.prefill.plan(batch, prefills)
        self.decode.plan(batch, decodes)
        kinds = [(part, reqs) for part, reqs in ((self.prefill, prefills), (self.decode, decodes)) if reqs]
        self._whole = kinds[0][0] if len(kinds) == 1 else None
        dev = self.pool.device
        self._parts = [] if len(kinds) != 2 else [
            (part, torch.as_tensor(batch.query_rows(reqs), dtype=torch.long, device=dev)) for part, reqs in kinds]

    @property
    def whole_step(self) -> StepPart | None:
        """The part that holds every row of the planned step (None for a mixed or an empty step)."""
        return self._whole

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [num_tokens, num_qo_heads, head_dim]
        if self._whole is not None:
            return self._whole.run(q, layer)
        out = torch.empty_like(q)
        for part, rows in self._parts:
            out[rows] = part.run(q[rows], layer)
        return out


def scale_for(pool: KVPool, scale: float | None) -> float:
    """The softmax scale: ``scale`` when given, else ``head_dim ** -0.5``."""
    return scale if scale is not None else pool.head_dim**-0.5


def group_of(pool: KVPool, num_qo_heads: int) -> int:
    """Query heads per KV head; ``ValueError`` unless ``num_qo_heads`` is a multiple of the pool's KV heads."""
    if num_qo_heads % pool.num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {pool.num_kv_heads}")
    return num_qo_heads // pool.num_kv_heads
