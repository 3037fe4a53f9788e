"""The attention interface: ``plan(batch)`` once per forward step, ``run(q, layer)`` per layer.

A step's batch is a list of requests, each contributing ``new_len`` query
tokens (consecutive in the flat query tensor, in request order) that sit
after ``prefix_len`` tokens whose K/V are already in the pool. Query token i
of a request attends to KV positions ``0 .. prefix_len + i`` (causal, offset
by the prefix). A decode is ``new_len == 1``; a prefill with a cached prefix
has ``prefix_len > 0``; a one-token prefill chunk (a prompt cached but for its
last token) is told apart from a decode by ``prefilling`` where the caller
knows it. The step's own new K/V must be stored in the pool
(``KVPool.store``) before ``run`` is called for that layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionBatch:
    """Per-request metadata of one forward step.

    Attributes:
        prefix_lens: KV tokens already in the pool before this step, per request.
        new_lens: query tokens this step, per request (1 for a decode).
        slots: per request, the slot of every KV position,
            ``len(slots[r]) == prefix_lens[r] + new_lens[r]`` (int64).
        prefilling: per request, whether its tokens are a prefill chunk (None: those of more than one
            token). The CPU backends run a one-token chunk through their prefill kernel, as the rest of its
            prompt would have gone, so a token's KV and logits are the bits of one algorithm whether its
            prompt was cached (a resumed or repeated request) or not.
    """

    prefix_lens: Sequence[int]
    new_lens: Sequence[int]
    slots: Sequence[np.ndarray]
    prefilling: Sequence[bool] | None = None

    def __post_init__(self) -> None:
        if not (len(self.prefix_lens) == len(self.new_lens) == len(self.slots)):
            raise ValueError("prefix_lens, new_lens and slots must have one entry per request")
        for r, (p, n, s) in enumerate(zip(self.prefix_lens, self.new_lens, self.slots, strict=True)):
            if p < 0 or n < 1 or len(s) != p + n:
                raise ValueError(f"request {r}: prefix {p}, new {n} and {len(s)} slots are inconsistent")
        if self.prefilling is not None and (
                len(self.prefilling) != len(self.new_lens)
                or any(n > 1 and not f for n, f in zip(self.new_lens, self.prefilling, strict=True))):
            raise ValueError("prefilling needs one flag per request, and a request of several new tokens is a "
                             f"prefill chunk (new_lens {list(self.new_lens)}, prefilling {list(self.prefilling)})")

    def prefills(self) -> list[int]:
        """The requests (indices) whose rows are prefill chunks; the rest are decodes (``decodes``)."""
        return [r for r, f in enumerate(self._prefill_flags()) if f]

    def decodes(self) -> list[int]:
        """The requests (indices) that decode one token each."""
        return [r for r, f in enumerate(self._prefill_flags()) if not f]

    def _prefill_flags(self) -> Sequence[bool]:
        return self.prefilling if self.prefilling is not None else [n > 1 for n in self.new_lens]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.new_lens))

    @property
    def qo_indptr(self) -> np.ndarray:
        """``[batch + 1]`` int32 offsets of each request's query rows."""
        return np.concatenate([[0], np.cumsum(self.new_lens)]).astype(np.int32)

    def query_rows(self, requests: Sequence[int]) -> np.ndarray:
        """The flat query rows of ``requests`` (request indices, in order), int64."""
        starts = self.qo_indptr
        return np.concatenate([np.zeros(0, dtype=np.int64),
                               *(np.arange(starts[r], starts[r + 1], dtype=np.int64) for r in requests)])


class AttentionBackend(Protocol):
    """What the model calls: plan once per step, run once per layer.

    Every backend has exactly these; none has optional capabilities that
    callers look for. Code that needs more of a backend (``radixkv.cpu``'s
    decode stack reads the cpu backend's CSR plan) holds its concrete type.
    """

    name: str  # the make_backend name that builds it ("torch", "torch-cascade", "cpu", "flashinfer")

    def plan(self, batch: AttentionBatch) -> None:
        """Prepare this step's metadata; ``run`` then serves every layer of the step."""

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q: ``[num_tokens, num_qo_heads, head_dim]`` -> out of the same shape."""
