"""Per-layer K and V storage addressed by slot index: the memory the prefix caches point into."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch


class KVPool:
    """K and V tensors of every layer, one row per KV slot.

    ``k[layer]`` and ``v[layer]`` are ``[num_slots, num_kv_heads, head_dim]``
    (token-major, FlashInfer's NHD layout), viewable page by page as
    ``[num_pages, page_size, num_kv_heads, head_dim]`` (``pages``). Slot
    indices come from a ``SlotAllocator`` of the same page size; they are what
    the prefix caches hold.

    Size it from a slot count or from a byte budget (``max_bytes``: the
    largest whole number of pages whose K and V for every layer fit). All
    layers' K and V are views of one buffer, which ``reallocate`` can move
    (``radixkv.cpu.accelerate`` moves a CPU pool into huge pages). ``pin_memory``: page-locked host memory
    (a host tier beside a CUDA pool: loads from it copy without blocking the CPU). ``file``: a path to create
    (or extend), reserve on disk and map the buffer from instead (a storage tier on disk; CPU only).
    ``zeros``: how to allocate a CPU buffer (``zeros(shape, dtype)``, zero-filled; ``torch.zeros`` by default),
    recorded as ``self.zeros``: ``radixkv.forward.pool_zeros`` names the one ``build_forward`` would move the
    pool into, so a pool built with it is not allocated twice (and not touched until written).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int | None = None,
        *,
        max_bytes: int | None = None,
        page_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        file: str | None = None,
        zeros: Callable[[Sequence[int], torch.dtype], torch.Tensor] | None = None,
    ):
        if (num_slots is None) == (max_bytes is None):
            raise ValueError("give exactly one of num_slots and max_bytes")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"KVPool dtype must be float32, bfloat16 or float16, got {dtype}")
        if min(num_layers, num_kv_heads, head_dim, page_size) < 1:
            raise ValueError("num_layers, num_kv_heads, head_dim and page_size must be >= 1")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        if num_slots is None:
            num_slots = int(max_bytes) // self.slot_bytes(num_layers, num_kv_heads, head_dim, dtype)
        self.num_pages = int(num_slots) // page_size
        if self.num_pages < 1:
            raise ValueError(f"the pool must hold at least one page of {page_size} slots")
        # one buffer [layer, K or V, slot, head, dim]; k[layer], v[layer]: [num_slots, num_kv_heads, head_dim]
        self.zeros = zeros if file is None and not pin_memory and self.device.type == "cpu" else None
        if self.zeros is not None:
            self._use(self._checked(self.zeros(self.buffer_shape, dtype), "zeros"))
        elif file is None:
            self._use(torch.zeros(self.buffer_shape, dtype=dtype, device=self.device, pin_memory=pin_memory))
        else:  # a file of zeros, its disk space reserved (a pool larger than the disk fails here, not mid-run),
            numel = math.prod(self.buffer_shape)  # mapped shared: the OS pages it to disk
            with open(file, "ab") as f:
                os.posix_fallocate(f.fileno(), 0, numel * dtype.itemsize)
            self._use(torch.from_file(file, shared=True, size=numel, dtype=dtype).view(self.buffer_shape))

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """The shape of the one buffer that holds every layer's K and V: ``[layers, 2, slots, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.num_slots, self.num_kv_heads, self.head_dim)

    def reallocate(self, zeros: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> None:
        """Move K and V into a buffer from ``zeros(buffer_shape, dtype)`` (on the pool's device), keeping what is
        stored. Views of the old buffer taken earlier (``k[layer]``) no longer see the pool: call it before serving."""
        kv = self._checked(zeros(self.buffer_shape, self.dtype), "reallocate")
        kv.copy_(self._kv)
        self._use(kv)
        self.zeros = zeros

    def _checked(self, kv: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(kv.shape) != self.buffer_shape or kv.dtype != self.dtype or kv.device.type != self.device.type:
            raise ValueError(f"{what}: got a {tuple(kv.shape)} {kv.dtype} buffer on {kv.device}, not "
                             f"{self.buffer_shape} {self.dtype} on {self.device}")
        return kv

    def _use(self, kv: torch.Tensor) -> None:
        self._kv = kv
        self.k = [kv[i, 0] for i in range(self.num_layers)]
        self.v = [kv[i, 1] for i in range(self.num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token's K and V take over all layers."""
        return self.slot_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def slot_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take over all layers, without building a pool."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | np.ndarray) -> None:
        """Write new tokens' K and V into their slots.

        k, v: ``[num_tokens, num_kv_heads, head_dim]``; slots: ``[num_tokens]`` int64.
        """
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        if k.shape != v.shape or k.shape[0] != idx.shape[0] or k.shape[1:] != self.k[layer].shape[1:]:
            raise ValueError(f"store: k {tuple(k.shape)}, v {tuple(v.shape)} and {idx.shape[0]} slots do not match "
                             f"the pool's [*, {self.num_kv_heads}, {self.head_dim}]")
        self.k[layer].index_copy_(0, idx, k.to(self.dtype))
        self.v[layer].index_copy_(0, idx, v.to(self.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V of ``slots`` (int64 on this pool's device): ``[layers, 2, len(slots), kv_heads,
        head_dim]``, a copy."""
        return self._kv.index_select(2, slots)

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` (as ``gather`` returns it) into ``slots`` of every layer."""
        self._kv.index_copy_(2, slots, kv)

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_pages, page_size, num_kv_heads, head_dim]`` views (NHD)."""
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def __repr__(self) -> str:
        return (f"KVPool(layers={self.num_layers}, slots={self.num_slots}, page_size={self.page_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})")


def default_kv_tokens(bytes_per_slot: int, device: str = "cpu") -> int:
    """KV pool size when none is given: a quarter of the memory available now, at least 1,024 and at
    most 2**20 tokens. Available means the device's free memory on a GPU (after the weights are
    loaded), the host's free pages otherwise."""
    if torch.device(device).type == "cuda":
        avail = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 4 << 30
    return int(max(1024, min(avail // 4 // bytes_per_slot, 1 << 20)))
