"""Attention backends behind one plan/run interface; ``make_backend`` builds one by name from the registry.

The package imports nothing heavy itself: ``import radixkv.attention.registry`` (the names, torch-free) is
what settings are checked against, and the backends load with the first name asked for. The ``cpu``
backend lives in ``radixkv.cpu`` with the compiled kernels it runs and registers itself there, so a
``torch`` or FlashInfer backend never loads anything of the CPU speed path.
"""

from __future__ import annotations

import importlib

from radixkv.attention.registry import AUTO_ORDER, BACKENDS, FLASHINFER_DTYPE_NAMES, register

_HOMES = {  # public name -> the module that defines it (loaded on first use: they need torch)
    "AttentionBackend": "base", "AttentionBatch": "base", "TorchReferenceBackend": "reference",
    "SharedPrefixTorchBackend": "shared_prefix", "make_backend": "backends",
    "FlashInferUnavailableError": "flashinfer_backend", "FLASHINFER_HEAD_DIMS": "flashinfer_backend",
    "FLASHINFER_DTYPES": "flashinfer_backend",
    "flashinfer_unavailable_reason": "flashinfer_backend", "flashinfer_unsupported_shape": "flashinfer_backend",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"radixkv.attention.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'radixkv.attention' has no attribute {name!r}")


__all__ = ["AUTO_ORDER", "BACKENDS", "FLASHINFER_DTYPE_NAMES", "register", *_HOMES]
