"""Attention through the compiled CPU kernels: K/V read in place from the pool, no padded copies.

The reference backend gathers every request's K/V rows into dense (and, for
decodes, padded head-major) copies and runs ``bmm``/SDPA on them; on a CPU,
moving those rows and the float32 score tensors costs more than the
arithmetic. ``radixkv.cpu.kernels`` reads the pool through FlashInfer-style
CSR metadata (``kv_indices``, ``kv_indptr``, ``qo_indptr``) instead:

* ``PagedDecode`` (``paged_decode``): every decode of the step, each K/V row
  read once per KV head for its whole query group; any dtype.
* ``PagedPrefill`` (``paged_prefill``): every prefill chunk of the step
  (causal after its cached prefix) in one call, where ``prefill_supported``
  says the CPU has a path for the pool's dtype and head_dim: bfloat16 with
  head_dim 64 or 128 on AVX-512 BF16 CPUs; any dtype with a head_dim that is
  a multiple of 8 on AVX2 CPUs (float32 arithmetic). Elsewhere prefill
  chunks take the reference's ``ReferencePrefill``.
* ``FlashPrefill`` (``radixkv.cpu.flash_prefill``) instead of ``paged_prefill`` for a bfloat16 pool on a
  CPU with AMX tiles (``amx_prefill``), where PyTorch's flash kernel multiplies through oneDNN's AMX
  GEMMs: 1.3-2.2x faster per layer on a Xeon with AMX (a 1,024-token prompt, and 8 chunks of 150 after
  500 or 1,000 cached tokens).

The AVX2 prefill keeps each thread's scratch between calls, so a call faults
no pages in: it grows to the largest request seen, about 8 x head_dim bytes
per token of that request (its packed K and V in float32) plus the scores of
16 queries' rows, and is never freed. The AVX-512 BF16 prefill keeps its
packed K and V (4 x head_dim bytes per token of the largest step seen, all
its requests and KV heads) per calling thread and its scores per worker the
same way.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from radixkv.attention.base import AttentionBatch
from radixkv.attention.reference import ReferencePrefill
from radixkv.attention.split import SplitBackend, StepPart, scale_for
from radixkv.cpu.flash_prefill import FlashPrefill, amx_prefill
from radixkv.cpu.kernels import cpu_kernels_unavailable_reason, load_cpu_kernels
from radixkv.memory.kv_pool import KVPool


def csr(slot_lists: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot lists as ``kv_indices`` ``[nnz]`` and ``kv_indptr`` ``[len + 1]``, both int64."""
    indptr = np.zeros(len(slot_lists) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in slot_lists], out=indptr[1:])
    if not slot_lists:
        return torch.zeros(0, dtype=torch.int64), torch.from_numpy(indptr)
    return torch.from_numpy(np.concatenate(slot_lists).astype(np.int64, copy=False)), torch.from_numpy(indptr)


class PagedDecode:
    """A step's decodes through ``paged_decode``, one kernel call per layer (a ``StepPart``)."""

    def __init__(self, pool: KVPool, kernels: ModuleType, scale: float | None = None):
        self.pool, self.kernels, self.scale = pool, kernels, scale_for(pool, scale)
        self.csr: tuple[torch.Tensor, torch.Tensor] | None = None  # (kv_indices, kv_indptr) of the planned decodes

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        self.csr = csr([np.asarray(batch.slots[r]) for r in requests]) if requests else None

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [B, num_qo_heads, head_dim], the planned decodes' rows in order
        indices, indptr = self.csr
        o = self.kernels.paged_decode(q.to(self.pool.dtype).contiguous(), self.pool.k[layer], self.pool.v[layer],
                                      indices, indptr, self.scale)
        return o.to(q.dtype)


class PagedPrefill:
    """A step's prefill chunks through ``paged_prefill``, one kernel call per layer (a ``StepPart``)."""

    def __init__(self, pool: KVPool, kernels: ModuleType, scale: float | None = None):
        self.pool, self.kernels, self.scale = pool, kernels, scale_for(pool, scale)
        self._csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # kv_indices, kv_indptr, qo_indptr

    def plan(self, batch: AttentionBatch, requests: list[int]) -> None:
        if not requests:
            self._csr = None
            return
        indices, indptr = csr([np.asarray(batch.slots[r]) for r in requests])
        qo_indptr = torch.from_numpy(np.cumsum([0] + [batch.new_lens[r] for r in requests], dtype=np.int64))
        self._csr = (indices, indptr, qo_indptr)

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [rows, num_qo_heads, head_dim], the planned chunks' rows in order
        indices, indptr, qo_indptr = self._csr
        o = self.kernels.paged_prefill(q.to(self.pool.dtype).contiguous(), self.pool.k[layer], self.pool.v[layer],
                                       indices, indptr, qo_indptr, self.scale)
        return o.to(q.dtype)


class CpuPagedBackend(SplitBackend):
    """Decodes through ``PagedDecode``; prefill chunks through ``FlashPrefill`` on AMX CPUs in bfloat16
    (``amx_prefill``), else ``PagedPrefill`` where the kernels have a path for the pool's dtype and head_dim
    (``prefill_supported``), else ``ReferencePrefill``.

    ``batch_invariant``: never ``FlashPrefill``, whose cascade splits a row's keys where its chunk's cached
    prefix ends, so a prompt's last row computed alone (a resumed prompt) would not be the bits its chunk
    gave; ``paged_prefill`` reduces each row's keys in one order whatever the chunk.

    ``run`` is then at most two kernel calls per layer. Construction builds
    the kernels if needed and raises ``RuntimeError`` when they cannot be
    built, ``ValueError`` for a pool off the CPU.
    """

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None, batch_invariant: bool = False):
        if pool.device.type != "cpu":
            raise ValueError(f"the cpu backend needs a CPU pool, not {pool.device}")
        self.kernels = load_cpu_kernels()
        self.prefill_kernel = self.kernels.prefill_supported(str(pool.dtype).removeprefix("torch."), pool.head_dim)
        flash = amx_prefill(pool.dtype) and not batch_invariant
        prefill: StepPart = (FlashPrefill(pool, num_qo_heads, scale) if flash
                             else PagedPrefill(pool, self.kernels, scale) if self.prefill_kernel
                             else ReferencePrefill(pool, num_qo_heads, scale))
        self.paged_decode = PagedDecode(pool, self.kernels, scale)
        super().__init__("cpu", pool, num_qo_heads, scale, prefill=prefill, decode=self.paged_decode)

    def decode_plan(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(kv_indices, kv_indptr)`` of the planned step when it is decodes only (request b's query is row b),
        for kernels that run the step's attention themselves (``radixkv.cpu.fused``'s ``DecodeStack``); else
        None."""
        return self.paged_decode.csr if self.whole_step is self.paged_decode else None


def cpu_backend_unavailable_reason(pool: KVPool) -> str | None:
    """Why ``auto`` does not pick the ``cpu`` backend (the compiled kernels) for this pool, or None when it does.

    Only 16-bit pools qualify: float32 is the oracle dtype, kept on the reference path.
    """
    if pool.device.type != "cpu":
        return f"the KV pool lives on {pool.device}, not on the CPU"
    if pool.dtype == torch.float32:
        return "float32 pools stay on the reference path (the oracle)"
    return cpu_kernels_unavailable_reason()
