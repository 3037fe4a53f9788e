"""Build one flat forward step from per-request pieces and run it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixkv.attention.base import AttentionBackend, AttentionBatch
from radixkv.kv_pool import KVPool
from radixkv.model.llama import LlamaForCausalLM


def run_step(model: LlamaForCausalLM, pool: KVPool, backend: AttentionBackend,
             new_tokens: Sequence[Sequence[int]], batch: AttentionBatch, all_logits: bool = False) -> torch.Tensor:
    """Forward the new tokens of every request of ``batch``; logits of each request's last token.

    ``new_tokens[r]`` are request r's ``batch.new_lens[r]`` tokens, at positions
    ``prefix_lens[r] ..``, written to the last ``new_lens[r]`` of its slots.
    Returns ``[batch, vocab]`` (``[num_tokens, vocab]`` with ``all_logits``).
    """
    dev = pool.device
    ids = torch.as_tensor(np.concatenate([np.asarray(t, dtype=np.int64) for t in new_tokens]), device=dev)
    positions = torch.as_tensor(np.concatenate([np.arange(p, p + n) for p, n in zip(batch.prefix_lens,
                                batch.new_lens, strict=True)]), dtype=torch.long, device=dev)
    out_slots = torch.as_tensor(np.concatenate([np.asarray(s)[p:] for s, p in zip(batch.slots, batch.prefix_lens,
                                strict=True)]), dtype=torch.long, device=dev)
    if len(ids) != batch.num_tokens:
        raise ValueError(f"{len(ids)} new tokens given for a batch of {batch.num_tokens}")
    backend.plan(batch)
    qo = None if all_logits else torch.as_tensor(batch.qo_indptr, dtype=torch.long, device=dev)
    return model(ids, positions, out_slots, pool, backend, qo_indptr=qo)
