"""Attention backends behind one plan/run interface; ``make_backend`` picks one."""

from __future__ import annotations

import importlib.util

import torch

from radixkv.attention.base import AttentionBackend, AttentionBatch
from radixkv.attention.reference import TorchReferenceBackend
from radixkv.attention.shared_prefix import SharedPrefixTorchBackend
from radixkv.kernels import cpu_kernels_unavailable_reason
from radixkv.kv_pool import KVPool

BACKENDS = ("auto", "torch", "torch-cascade", "cpu", "flashinfer")


def flashinfer_unavailable_reason(pool: KVPool) -> str | None:
    """Why FlashInfer cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "CUDA is not available (FlashInfer runs on NVIDIA GPUs only)"
    if pool.device.type != "cuda":
        return f"the KV pool lives on {pool.device}, not on a CUDA device"
    if importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not installed (pip install -e '.[gpu]')"
    return None


def cpu_backend_unavailable_reason(pool: KVPool) -> str | None:
    """Why ``auto`` does not pick the ``cpu`` backend (the compiled kernels) for this pool, or None when it does.

    Only 16-bit pools qualify: float32 is the oracle dtype, kept on the reference path.
    """
    if pool.device.type != "cpu":
        return f"the KV pool lives on {pool.device}, not on the CPU"
    if pool.dtype == torch.float32:
        return "float32 pools stay on the reference path (the oracle)"
    return cpu_kernels_unavailable_reason()


def make_backend(name: str, pool: KVPool, num_qo_heads: int, scale: float | None = None) -> AttentionBackend:
    """``torch`` (the reference), ``torch-cascade`` (the reference with shared-prefix decode), ``cpu`` (the
    reference's interface with decodes and bfloat16 prefills through the compiled kernels), ``flashinfer``,
    or ``auto``: FlashInfer when CUDA and flashinfer are present; else ``cpu`` for a 16-bit CPU pool whose
    kernels build; else ``torch-cascade``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKENDS)}")
    reason = flashinfer_unavailable_reason(pool) if name in ("auto", "flashinfer") else "not asked for"
    if name == "flashinfer" and reason:
        raise RuntimeError(f"attention_backend='flashinfer' cannot run: {reason}")
    if name == "flashinfer" or (name == "auto" and reason is None):
        from radixkv.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(pool, num_qo_heads, scale)
    if name == "torch":
        return TorchReferenceBackend(pool, num_qo_heads, scale)
    if name == "cpu" or (name == "auto" and cpu_backend_unavailable_reason(pool) is None):
        from radixkv.attention.cpu_paged import CpuPagedBackend

        return CpuPagedBackend(pool, num_qo_heads, scale)
    return SharedPrefixTorchBackend(pool, num_qo_heads, scale)


__all__ = ["AttentionBackend", "AttentionBatch", "BACKENDS", "SharedPrefixTorchBackend", "TorchReferenceBackend",
           "make_backend"]
