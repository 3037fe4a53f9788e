"""Build one flat forward step from per-request pieces and run it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixkv.attention.base import AttentionBackend, AttentionBatch
from radixkv.memory.kv_pool import KVPool
from radixkv.model.forward import Forward


@dataclass(frozen=True)
class StepInputs:
    """The model's flat inputs for one step (all int64, on the pool's device).

    ids, positions, out_slots: ``[num_tokens]``; qo_indptr: ``[batch + 1]``.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    qo_indptr: torch.Tensor


def prepare_step(pool: KVPool, backend: AttentionBackend, new_tokens: Sequence[Sequence[int]],
                 batch: AttentionBatch) -> StepInputs:
    """Flatten the step's tokens, positions and output slots, and ``plan`` the backend for ``batch``.

    ``new_tokens[r]`` are request r's ``batch.new_lens[r]`` tokens, at positions
    ``prefix_lens[r] ..``, written to the last ``new_lens[r]`` of its slots.
    """
    dev = pool.device
    ids = torch.as_tensor(np.concatenate([np.asarray(t, dtype=np.int64) for t in new_tokens]), device=dev)
    if len(ids) != batch.num_tokens:
        raise ValueError(f"{len(ids)} new tokens given for a batch of {batch.num_tokens}")
    positions = torch.as_tensor(np.concatenate([np.arange(p, p + n) for p, n in zip(batch.prefix_lens,
                                batch.new_lens, strict=True)]), dtype=torch.long, device=dev)
    out_slots = torch.as_tensor(np.concatenate([np.asarray(s)[p:] for s, p in zip(batch.slots, batch.prefix_lens,
                                strict=True)]), dtype=torch.long, device=dev)
    backend.plan(batch)
    return StepInputs(ids, positions, out_slots, torch.as_tensor(batch.qo_indptr, dtype=torch.long, device=dev))


def run_step(model: Forward, pool: KVPool, backend: AttentionBackend,
             new_tokens: Sequence[Sequence[int]], batch: AttentionBatch, all_logits: bool = False) -> torch.Tensor:
    """Forward the new tokens of every request of ``batch``; logits of each request's last token.

    ``model`` is a model or the forward ``build_forward`` returned for it.
    Returns ``[batch, vocab]`` (``[num_tokens, vocab]`` with ``all_logits``).
    """
    x = prepare_step(pool, backend, new_tokens, batch)
    return model(x.ids, x.positions, x.out_slots, pool, backend, qo_indptr=None if all_logits else x.qo_indptr)
