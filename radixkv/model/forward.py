"""``Forward``: what a model's step forward takes and gives (the model itself, or ``radixkv.cpu``'s fused
forward over it). ``radixkv.forward.build_forward`` picks which one the engine calls."""

from __future__ import annotations

from typing import Protocol

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.memory.kv_pool import KVPool


class Forward(Protocol):
    """A model's step forward: ``LlamaForCausalLM.forward``'s arguments and result."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, pool: KVPool,
                 backend: AttentionBackend, logits_rows: torch.Tensor | None = None,
                 qo_indptr: torch.Tensor | None = None) -> torch.Tensor: ...
