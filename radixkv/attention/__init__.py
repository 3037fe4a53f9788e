"""Attention backends behind one plan/run interface; ``make_backend`` picks one.

The ``cpu`` backend lives in ``radixkv.cpu`` with the compiled kernels it
runs, and is imported only when asked for (or picked by ``auto``), so a
``torch`` or FlashInfer backend never loads anything of the CPU speed path.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from radixkv.attention.base import AttentionBackend, AttentionBatch
from radixkv.attention.reference import TorchReferenceBackend
from radixkv.attention.shared_prefix import SharedPrefixTorchBackend
from radixkv.config import ATTENTION_BACKENDS
from radixkv.config import FLASHINFER_DTYPES as FLASHINFER_DTYPE_NAMES
from radixkv.kv_pool import KVPool

BACKENDS = ATTENTION_BACKENDS  # the one list of names (radixkv.config, torch-free)


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


def cpu_backend_unavailable_reason(pool: KVPool) -> str | None:
    """Why ``auto`` does not pick the ``cpu`` backend (the compiled kernels) for this pool, or None when it does.

    Only 16-bit pools qualify: float32 is the oracle dtype, kept on the reference path.
    """
    if pool.device.type != "cpu":
        return f"the KV pool lives on {pool.device}, not on the CPU"
    if pool.dtype == torch.float32:
        return "float32 pools stay on the reference path (the oracle)"
    from radixkv.cpu.kernels import cpu_kernels_unavailable_reason  # lazy: only 16-bit CPU pools look

    return cpu_kernels_unavailable_reason()


def make_backend(name: str, pool: KVPool, num_qo_heads: int, scale: float | None = None) -> AttentionBackend:
    """``torch`` (the reference), ``torch-cascade`` (the reference with shared-prefix decode), ``cpu``
    (decodes and, where they have a path, prefills through ``radixkv.cpu``'s compiled kernels), ``flashinfer``,
    or ``auto``: FlashInfer when CUDA and flashinfer are present and its kernels serve the pool's dtype and
    head dim (``flashinfer_unavailable_reason`` says why not); else ``cpu`` for a 16-bit CPU pool whose
    kernels build; else ``torch-cascade``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKENDS)}")
    reason = flashinfer_unavailable_reason(pool) if name in ("auto", "flashinfer") else "not asked for"
    if name == "flashinfer" and reason:
        raise FlashInferUnavailableError(f"attention_backend='flashinfer' cannot run: {reason}")
    if name == "auto" and reason and pool.device.type == "cuda":  # a GPU user would not expect the slow path
        warnings.warn(f"attention_backend='auto' serves this pool with the PyTorch backend: {reason}", stacklevel=2)
    if name == "flashinfer" or (name == "auto" and reason is None):
        from radixkv.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(pool, num_qo_heads, scale)
    if name == "torch":
        return TorchReferenceBackend(pool, num_qo_heads, scale)
    if name == "cpu" or (name == "auto" and cpu_backend_unavailable_reason(pool) is None):
        from radixkv.cpu.paged_attention import CpuPagedBackend  # lazy: the CPU speed path, asked for

        return CpuPagedBackend(pool, num_qo_heads, scale)
    return SharedPrefixTorchBackend(pool, num_qo_heads, scale)


__all__ = ["AttentionBackend", "AttentionBatch", "BACKENDS", "FLASHINFER_DTYPES", "FLASHINFER_HEAD_DIMS",
           "FlashInferUnavailableError", "SharedPrefixTorchBackend", "TorchReferenceBackend",
           "cpu_backend_unavailable_reason", "flashinfer_unavailable_reason", "flashinfer_unsupported_shape",
           "make_backend"]
