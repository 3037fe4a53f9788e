"""Large CPU tensors in memory advised for transparent huge pages (2 MiB pages where the OS grants them).

A batch-8 decode step of SmolLM2-135M streams about 200 MB of weight tiles and
190 MB of K/V from DRAM. In 4 KiB pages that is some 100,000 pages a step, far
more than the TLB maps, so the kernels' loads keep waiting on page walks.
Where Linux's THP mode is ``madvise`` (the default of many distributions, and
this project's machine) anonymous memory gets 2 MiB pages only if it is
advised before its first touch. These helpers map the memory themselves
(anonymous ``mmap``, zero until written), advise it, and wrap it as a tensor.
``radixkv.cpu.accelerate`` puts the KV pool (``KVPool.reallocate``) and the
decode kernels' weight tiles here.

Where THP is off, the memory is ordinary pages; where the platform has no
``MADV_HUGEPAGE`` (not Linux), the helpers are plain ``torch`` calls: the same
tensors either way, only the speed differs.
Below ``MIN_BYTES`` the helpers return plain ``torch`` tensors, so small
pools (tests, notebooks) do not round up to whole 2 MiB pages.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE
ALIGN = 4096  # where pack() starts each tensor: a page boundary
# Linux only (None elsewhere: Windows, macOS), where the helpers are plain torch calls.
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def _advised_bytes(nbytes: int) -> torch.Tensor | None:
    """A zero-filled uint8 CPU tensor of ``nbytes`` (rounded up to whole huge pages) in advised memory.

    The tensor keeps the mapping alive; the mapping is freed with its last view.
    None where memory cannot be advised here (the caller allocates plainly).
    """
    if _ADVICE is None or nbytes < MIN_BYTES:
        return None
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(_ADVICE)
    except OSError:  # THP compiled out or refused: ordinary pages, same contents
        pass
    return torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, in huge-page memory when it is at least ``MIN_BYTES``.

    The pages are faulted in (zeroed by the OS) on first write, 2 MiB at a time where granted.
    """
    buf = _advised_bytes(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
    if buf is None:
        return torch.zeros(tuple(shape), dtype=dtype)
    return buf.view(dtype).view(tuple(shape))


def pack(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` side by side in one huge-page buffer, each contiguous and page-aligned.

    One buffer for many tensors (a model's weight tiles: 121 of 0.7-56 MB for
    SmolLM2) wastes at most a page each, where a buffer per tensor would
    round each up to 2 MiB. Under ``MIN_BYTES`` in all, plain contiguous copies.
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, end = [], 0
    for n in sizes:
        starts.append(end)
        end += -(-n // ALIGN) * ALIGN
    buf = _advised_bytes(end)
    if buf is None:
        return [t.contiguous().clone() for t in tensors]
    out = []
    for t, start, n in zip(tensors, starts, sizes, strict=True):
        view = buf[start:start + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


__all__ = ["HUGE_PAGE", "MIN_BYTES", "pack", "zeros"]
