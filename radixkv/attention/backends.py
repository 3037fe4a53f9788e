"""The PyTorch backends and FlashInfer in the registry, and ``make_backend``, which builds any registered one.

``cpu`` is registered by ``radixkv.cpu`` (the CPU speed path behind its one door); nothing here imports it.
"""

from __future__ import annotations

import warnings

from radixkv.attention.base import AttentionBackend
from radixkv.attention.flashinfer_backend import FlashInferUnavailableError, flashinfer_unavailable_reason
from radixkv.attention.reference import TorchReferenceBackend
from radixkv.attention.registry import AUTO_ORDER, BACKENDS, entry, register
from radixkv.attention.shared_prefix import SharedPrefixTorchBackend
from radixkv.memory.kv_pool import KVPool


def _flashinfer(pool: KVPool, num_qo_heads: int, scale: float | None = None) -> AttentionBackend:
    from radixkv.attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(pool, num_qo_heads, scale)


register("torch", lambda pool: None, TorchReferenceBackend)
register("torch-cascade", lambda pool: None, SharedPrefixTorchBackend)
register("flashinfer", flashinfer_unavailable_reason, _flashinfer)


def make_backend(name: str, pool: KVPool, num_qo_heads: int, scale: float | None = None) -> AttentionBackend:
    """A backend from the registry (``radixkv.attention.registry``): ``torch`` (the reference),
    ``torch-cascade`` (the reference with shared-prefix decode), ``cpu`` (decodes and, where they have a
    path, prefills through ``radixkv.cpu``'s compiled kernels; registered once ``radixkv.cpu`` is imported),
    ``flashinfer``, or ``auto``: the first of ``AUTO_ORDER`` that can serve the pool here: FlashInfer when
    CUDA and flashinfer are present and its kernels serve the pool's dtype and head dim
    (``flashinfer_unavailable_reason`` says why not); else ``cpu`` for a 16-bit CPU pool whose kernels build;
    else ``torch-cascade``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKENDS)}")
    if name == "flashinfer" and (reason := flashinfer_unavailable_reason(pool)):
        raise FlashInferUnavailableError(f"attention_backend='flashinfer' cannot run: {reason}")
    if name == "auto":
        reason = flashinfer_unavailable_reason(pool)
        if reason and pool.device.type == "cuda":  # a GPU user would not expect the slow path
            warnings.warn(f"attention_backend='auto' serves this pool with the PyTorch backend: {reason}",
                          stacklevel=2)
        name = next(n for n in AUTO_ORDER if (e := entry(n)) is not None and e.unavailable(pool) is None)
    chosen = entry(name)
    if chosen is None:
        raise ValueError(f"attention backend {name!r} is not registered here: import radixkv.cpu first (the "
                         "engine's build_forward does) to serve a pool through the compiled CPU kernels")
    return chosen.build(pool, num_qo_heads, scale)


