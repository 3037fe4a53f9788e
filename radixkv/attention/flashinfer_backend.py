"""The one place that talks to FlashInfer: paged prefill and decode wrappers over the KV pool.

Imported lazily (``make_backend``) so that CPU-only installs never need
flashinfer. Prefill rows (``new_len > 1``) go to
``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (FlashInfer aligns
the causal mask to the end of the KV, which is exactly the prefix offset);
decode rows (``new_len == 1``) go to ``BatchDecodeWithPagedKVCacheWrapper``.
Every ``plan`` argument is passed by keyword (flashinfer 0.7.4's names), so a
reordered signature in a later release fails loudly instead of shifting values.
Metadata is int32 CSR: ``qo_indptr [b+1]``, ``kv_indptr [b+1]`` (pages),
``kv_indices [total pages]``, ``kv_last_page_len [b]``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from radixkv.attention.base import AttentionBatch
from radixkv.attention.registry import FLASHINFER_DTYPE_NAMES
from radixkv.attention.split import group_of, scale_for
from radixkv.memory.kv_pool import KVPool

# What radixkv's FlashInfer path runs: FlashInfer has no float32 attention kernels, and its FA2/FA3
# prefill and decode kernels all exist only for these head dims (FA3 prefill is the narrowest).
FLASHINFER_DTYPES = tuple(getattr(torch, name) for name in FLASHINFER_DTYPE_NAMES)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


class FlashInferUnavailableError(RuntimeError, ValueError):
    """``attention_backend='flashinfer'`` cannot serve this pool here: a ``RuntimeError`` (the machine lacks
    something) and a ``ValueError`` (the pool's dtype or head dim is one FlashInfer has no kernels for)."""


def flashinfer_unsupported_shape(pool: KVPool) -> str | None:
    """Why FlashInfer's kernels cannot serve this pool's dtype or head dim, or None when they can."""
    reasons = []
    if pool.dtype not in FLASHINFER_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLASHINFER_DTYPES)
        reasons.append(f"FlashInfer has no {str(pool.dtype).removeprefix('torch.')} kernels "
                       f"(supported dtypes: {names})")
    if pool.head_dim not in FLASHINFER_HEAD_DIMS:
        reasons.append(f"FlashInfer has no kernels for head dim {pool.head_dim} "
                       f"(supported head dims: {', '.join(map(str, FLASHINFER_HEAD_DIMS))})")
    return "; ".join(reasons) or None


def flashinfer_unavailable_reason(pool: KVPool) -> str | None:
    """Why FlashInfer cannot run this pool here, or None when it can: every obstacle found, joined by
    '; ': no CUDA, a pool off the GPU, no flashinfer package, an unsupported dtype or head dim."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("CUDA is not available (FlashInfer runs on NVIDIA GPUs only)")
    elif pool.device.type != "cuda":
        reasons.append(f"the KV pool lives on {pool.device}, not on a CUDA device")
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append("the flashinfer package is not installed (pip install -e '.[gpu]')")
    if shape := flashinfer_unsupported_shape(pool):
        reasons.append(shape)
    return "; ".join(reasons) or None


WORKSPACE_BYTES = 128 * 1024 * 1024
CUDA_CORE_DECODE_GROUPS = (1, 2, 3, 4, 6, 8, 16)  # DISPATCH_GQA_GROUP_SIZE in flashinfer 0.7.4's utils.cuh


def page_table(slot_lists: list[np.ndarray], page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR page table (kv_indptr, kv_indices, kv_last_page_len), all int32, from slot lists.

    Every request's slots must fill whole pages in order (slot k of a page is
    ``page * page_size + k``), as a page-aligned ``SlotAllocator`` and the prefix
    caches guarantee; anything else is a clear ``ValueError``.
    """
    indptr, indices, last = [0], [], []
    for slots in slot_lists:
        slots = np.asarray(slots, dtype=np.int64)
        pages = slots[::page_size] // page_size
        expect = (pages[:, None] * page_size + np.arange(page_size)).ravel()[: len(slots)]
        if not np.array_equal(slots, expect):
            raise ValueError("a request's slots do not fill whole pages in order; cannot build a page table")
        indices.append(pages)
        indptr.append(indptr[-1] + len(pages))
        last.append(len(slots) - (len(pages) - 1) * page_size)
    cat = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    return np.asarray(indptr, np.int32), cat.astype(np.int32), np.asarray(last, np.int32)


class FlashInferBackend:
    """Paged attention with FlashInfer kernels (CUDA only). See the module docstring."""

    name = "flashinfer"

    def __init__(self, pool: KVPool, num_qo_heads: int, scale: float | None = None):
        import flashinfer  # lazy: only GPU users have it

        if pool.device.type != "cuda":
            raise FlashInferUnavailableError("FlashInferBackend needs the KV pool on a CUDA device")
        if reason := flashinfer_unsupported_shape(pool):
            raise FlashInferUnavailableError(reason)
        group = group_of(pool, num_qo_heads)
        self.pool, self.num_qo_heads, self.scale = pool, num_qo_heads, scale_for(pool, scale)
        # allocated once, zeroed: FlashInfer's wrappers document their float workspace as zeroed before first use
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        # FlashInfer's CUDA-core decode kernel is instantiated for these query heads per KV head only; other
        # groups decode through its tensor-core (prefill) kernel, which takes any group.
        self.decode_tensor_cores = group not in CUDA_CORE_DECODE_GROUPS
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
        self._parts = []  # (FlashInfer wrapper, its query rows [rows] int64) per kind of row the step has

    def plan(self, batch: AttentionBatch, q_dtype: torch.dtype | None = None) -> None:
        pool, ps, dev = self.pool, self.pool.page_size, self.pool.device
        pre, dec = batch.prefills(), batch.decodes()
        to_dev = lambda a: torch.as_tensor(a, dtype=torch.int32, device=dev)  # noqa: E731
        self._parts = [(wrapper, torch.as_tensor(batch.query_rows(reqs), dtype=torch.long, device=dev))
                       for wrapper, reqs in ((self._prefill, pre), (self._decode, dec)) if reqs]
        common = self.plan_args(q_dtype)
        if pre:
            indptr, indices, last = map(to_dev, page_table([batch.slots[r] for r in pre], ps))
            qo = np.concatenate([[0], np.cumsum([batch.new_lens[r] for r in pre])])
            self._prefill.plan(qo_indptr=to_dev(qo), paged_kv_indptr=indptr, paged_kv_indices=indices,
                               paged_kv_last_page_len=last, head_dim_qk=pool.head_dim, causal=True, **common)
        if dec:
            indptr, indices, last = map(to_dev, page_table([batch.slots[r] for r in dec], ps))
            self._decode.plan(indptr=indptr, indices=indices, last_page_len=last, head_dim=pool.head_dim, **common)

    def plan_args(self, q_dtype: torch.dtype | None = None) -> dict:
        """The keywords every ``plan`` of this pool takes, the prefill's and the decode's (and the graphs')."""
        pool = self.pool
        return dict(num_qo_heads=self.num_qo_heads, num_kv_heads=pool.num_kv_heads, page_size=pool.page_size,
                    sm_scale=self.scale, q_data_type=q_dtype or pool.dtype, kv_data_type=pool.dtype)

    def run(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        # q: [num_tokens, num_qo_heads, head_dim]
        out = torch.empty_like(q)
        kv = self.pool.pages(layer)  # ([num_pages, page_size, num_kv_heads, head_dim],) * 2
        for wrapper, rows in self._parts:
            out[rows] = wrapper.run(q[rows], kv)
        return out
