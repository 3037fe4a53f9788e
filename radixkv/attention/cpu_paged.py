"""Attention through the compiled CPU kernels: K/V read in place from the pool, no padded copies.

The reference backend gathers every request's K/V rows into dense (and, for
decodes, padded head-major) copies and runs ``bmm``/SDPA on them; on a CPU,
moving those rows and the float32 score tensors costs more than the
arithmetic. ``radixkv.kernels`` reads the pool through FlashInfer-style CSR
metadata (``kv_indices``, ``kv_indptr``, ``qo_indptr``) instead:

* ``paged_decode``: every decode of the step, each K/V row read once per KV
  head for its whole query group; any dtype.
* ``paged_prefill``: every prefill chunk of the step (causal after its
  cached prefix) in one call, where ``prefill_supported`` says the CPU has
  a path for the pool's dtype and head_dim: bfloat16 with head_dim 64 or
  128 on AVX-512 BF16 CPUs; any dtype with a head_dim that is a multiple of
  8 on AVX2 CPUs (float32 arithmetic). Elsewhere prefill chunks take the
  reference path.

Measured on 2 cores, bfloat16, one layer, old and new alternating in one
process, on an AVX-512 BF16 CPU: 8 decodes of 1,025 tokens 0.35 ms against
the reference's 1.0 ms (a BF16 dot-product decode kernel, since replaced by
the AVX2 one, which a Zen 4 ran at 0.66x its time at batch 1, 0.98x at 8);
8 chunks of 150 tokens after 500 cached ones 12.9 ms against 34.3 ms. On an AVX2-only EPYC (Zen 3), where the
reference's bfloat16 ``bmm`` is emulated: 2 chunks of 150 after 500 cached,
whole model, 15.0 ms per token before the AVX2 kernels, 3.6 after
(docs/experiments.md).
"""

from __future__ import annotations

import numpy as np
import torch

from radixkv.attention.base import AttentionBatch
from radixkv.attention.reference import TorchReferenceBackend
from radixkv.kernels import load_cpu_kernels
from radixkv.kv_pool import KVPool


def csr(slot_lists: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot lists as ``kv_indices`` ``[nnz]`` and ``kv_indptr`` ``[len + 1]``, both int64."""
    indptr = np.zeros(len(slot_lists) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in slot_lists], out=indptr[1:])
    return torch.from_numpy(np.concatenate(slot_lists).astype(np.int64, copy=False)), torch.from_numpy(indptr)


class CpuPagedBackend(TorchReferenceBackend):
    """The reference backend's interface with decodes, and bfloat16 prefills, through the compiled kernels.

    ``plan`` builds the CSR metadata of the step's decodes (``kv_indices``,
    ``kv_indptr``, their query rows ``[B]``) and, where the prefill kernel
    applies, of its prefill chunks (plus ``qo_indptr`` and their query
    rows); ``run`` is then at most two kernel calls per layer. Construction
    builds the kernels if needed and raises ``RuntimeError`` when they
    cannot be built.
    """

    name = "cpu"

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None):
        if pool.device.type != "cpu":
            raise ValueError(f"the cpu backend needs a CPU pool, not {pool.device}")
        super().__init__(pool, num_qo_heads, scale)
        self.kernels = load_cpu_kernels()
        self.prefill_kernel = self.kernels.prefill_supported(str(pool.dtype).removeprefix("torch."), pool.head_dim)
        self._prefills: tuple[torch.Tensor, ...] | None = None
        self._all_decodes = False

    def plan(self, batch: AttentionBatch) -> None:
        self._prefills = None
        self._all_decodes = bool(batch.new_lens) and all(n == 1 for n in batch.new_lens)  # an empty step is not
        if not self.prefill_kernel:
            return super().plan(batch)
        starts = batch.qo_indptr[:-1]
        decodes = [r for r, n in enumerate(batch.new_lens) if n == 1]
        prefills = [r for r, n in enumerate(batch.new_lens) if n > 1]
        self._plan = []
        self._decodes = self._plan_decodes(batch, decodes, starts) if decodes else None
        if prefills:
            indices, indptr = csr([np.asarray(batch.slots[r]) for r in prefills])
            qo_indptr = torch.from_numpy(np.cumsum([0] + [batch.new_lens[r] for r in prefills], dtype=np.int64))
            rows = None if not decodes else torch.from_numpy(batch.query_rows(prefills))  # None: every row, in order
            self._prefills = (indices, indptr, qo_indptr, rows)

    def decode_plan(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(kv_indices, kv_indptr)`` of the planned step when it is decodes only (request b's query is row b),
        for kernels that run the step's attention themselves (``CpuKernelOps.run_layers``); else None."""
        return self._decodes[:2] if self._all_decodes and self._decodes is not None else None

    def _plan_decodes(self, batch: AttentionBatch, rows: list[int], starts: np.ndarray):
        indices, indptr = csr([np.asarray(batch.slots[r]) for r in rows])
        return indices, indptr, torch.as_tensor(starts[rows], dtype=torch.long)

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [num_tokens, num_qo_heads, head_dim]
        if self._all_decodes:  # a pure decode step: one kernel call, no row gathering or scattering
            return self._paged_decode(q, layer)
        if self._prefills is not None and self._prefills[3] is None:  # prefills only: the same, one call
            return self._paged_prefill(q, layer).to(q.dtype)
        out = super().run(q, layer)  # reference prefills (if any) and the decodes
        if self._prefills is not None:
            rows = self._prefills[3]
            out[rows] = self._paged_prefill(q[rows], layer).to(q.dtype)
        return out

    def _paged_prefill(self, qp: torch.Tensor, layer: int) -> torch.Tensor:
        """The planned prefill chunks' attention; qp: their query rows ``[prefill rows, num_qo_heads, head_dim]``."""
        indices, indptr, qo_indptr, _ = self._prefills
        return self.kernels.paged_prefill(qp.to(self.pool.dtype).contiguous(), self.pool.k[layer], self.pool.v[layer],
                                          indices, indptr, qo_indptr, self.scale)

    def _run_decodes(self, q: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        rows = self._decodes[2]
        out[rows] = self._paged_decode(q[rows], layer)

    def _paged_decode(self, qd: torch.Tensor, layer: int) -> torch.Tensor:
        """The planned decodes' attention; qd: their query rows ``[B, num_qo_heads, head_dim]``, in order."""
        indices, indptr, _ = self._decodes
        o = self.kernels.paged_decode(qd.to(self.pool.dtype).contiguous(), self.pool.k[layer], self.pool.v[layer],
                                      indices, indptr, self.scale)
        return o.to(qd.dtype)
