"""Attention backends by name: one registry of why each cannot serve a pool and how to build it. Torch-free.

``BACKENDS`` are the names a setting may take (``EngineConfig.attention_backend``): ``auto`` picks among the
others in ``AUTO_ORDER``. A backend's module registers it (``register``): ``radixkv.attention.backends`` the
PyTorch ones and FlashInfer, ``radixkv.cpu`` its ``cpu`` backend when it is imported (the engine's
``radixkv.forward.build_forward`` imports it on a CPU), so this package never imports the CPU speed path.
``FLASHINFER_DTYPE_NAMES``: the pool dtypes FlashInfer has kernels for (no float32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "torch", "torch-cascade", "cpu", "flashinfer")
AUTO_ORDER = ("flashinfer", "cpu", "torch-cascade")  # what ``auto`` tries, first available wins
FLASHINFER_DTYPE_NAMES = ("bfloat16", "float16")


@dataclass(frozen=True)
class Entry:
    """A registered backend: ``unavailable(pool)`` says why it cannot serve a pool here (None: it can), and
    ``build(pool, num_qo_heads, scale)`` makes one."""

    unavailable: Callable[[Any], str | None]
    build: Callable[..., Any]


_ENTRIES: dict[str, Entry] = {}


def register(name: str, unavailable: Callable[[Any], str | None], build: Callable[..., Any]) -> None:
    """Make backend ``name`` (one of ``BACKENDS`` but ``auto``) buildable; registering it again replaces it."""
    if name not in BACKENDS or name == "auto":
        raise ValueError(f"cannot register attention backend {name!r}: the names are {BACKENDS[1:]}")
    _ENTRIES[name] = Entry(unavailable, build)


def entry(name: str) -> Entry | None:
    """The registered entry of ``name``, None where its module was not imported."""
    return _ENTRIES.get(name)
