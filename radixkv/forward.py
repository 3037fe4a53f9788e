"""What the engine serves a model with: the forward to call and the attention backend, in one call.

``build_forward`` keeps the CPU speed path (``radixkv.cpu``) behind one
door: a 16-bit model on a CPU with ``attention_backend`` ``auto``, or any
model on a CPU with ``cpu`` (which asks for it by name), goes through
``radixkv.cpu.accelerate`` (packed 16-bit linear layers, huge pages,
compiled attention and fused layer steps); everything else (float32 with
``auto``, the oracle; the ``torch`` backends; a GPU) is the plain model with
``make_backend``'s backend, and imports nothing of ``radixkv.cpu``. It sits
above ``radixkv.model`` and ``radixkv.cpu`` (which wraps the model), so
neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixkv.attention.backends import make_backend
from radixkv.attention.base import AttentionBackend
from radixkv.memory.kv_pool import KVPool
from radixkv.model.forward import Forward
from radixkv.model.llama import LlamaForCausalLM


def takes_cpu_path(pool: KVPool, attention_backend: str) -> bool:
    """Whether ``build_forward`` serves this pool through ``radixkv.cpu``: a pool on the CPU with
    ``attention_backend="cpu"``, or a 16-bit one with ``auto`` (float32 stays on the plain path, the oracle)."""
    return _cpu_path(pool.device, pool.dtype, attention_backend)


def _cpu_path(device: str | torch.device, dtype: torch.dtype, attention_backend: str) -> bool:
    return torch.device(device).type == "cpu" and (
        attention_backend == "cpu" or (attention_backend == "auto" and dtype != torch.float32))


def pool_zeros(device: str | torch.device, dtype: torch.dtype,
               attention_backend: str) -> Callable[[Sequence[int], torch.dtype], torch.Tensor] | None:
    """The allocator to build a KV pool with (``KVPool(zeros=...)``) so that ``build_forward`` keeps it where
    it is: the CPU path's huge-page memory (``radixkv.cpu.hugepages.zeros``, zero until written, so a pool of
    gigabytes costs no time to build); None (``torch.zeros``) elsewhere."""
    if not _cpu_path(device, dtype, attention_backend):
        return None
    from radixkv.cpu import hugepages  # lazy: only this path loads the CPU speed-ups

    return hugepages.zeros


def build_forward(model: LlamaForCausalLM, pool: KVPool, attention_backend: str = "auto",
                  batch_invariant: bool = False) -> tuple[Forward, AttentionBackend]:
    """The forward to call for each step of ``model`` over ``pool``, and the attention backend to ``plan``.

    Call it once, after building the pool and before serving: on the CPU
    path it packs the model's linear layers in place and moves the pool's
    buffer (``radixkv.cpu.accelerate``). Raises as ``make_backend`` does
    for an unknown or unavailable backend.
    ``batch_invariant``: a token's logits are the same bits whichever requests
    share its step (``radixkv.cpu.accelerate``); only the CPU path has it, so
    anything else (float32, a GPU, the ``torch`` backends) is a ``ValueError``.
    """
    if takes_cpu_path(pool, attention_backend):
        from radixkv.cpu import accelerate  # lazy: only this path loads the CPU speed-ups

        return accelerate(model, pool, attention_backend, batch_invariant)
    if batch_invariant:
        raise ValueError("batch_invariant needs radixkv's CPU kernels path: a 16-bit model on the CPU with "
                         f"attention_backend 'auto' or 'cpu' (got {pool.dtype} on {pool.device}, "
                         f"attention_backend {attention_backend!r})")
    return model, make_backend(attention_backend, pool, model.config.num_heads)
