"""The engine's real memory per tier: ``TierMemory`` makes each lower tier's KV buffer (pinned host memory
beside a CUDA pool, a file mapped from disk for storage), and ``KVMover`` runs each copy between them
(``radixkv.cache.tiered.Copy``).

On a CPU a copy is an indexed gather and scatter, done when the call returns. Beside a CUDA device the host
pool is pinned and copies run on a side stream:

* host -> device (a load): the rows are gathered into a pinned staging buffer on the CPU, then copied and
  scattered on the side stream without blocking the CPU (PyTorch keeps a pinned buffer alive until the copy
  that reads it is done); ``wait`` makes the compute stream wait for them before attention reads them. Every
  device tensor the side stream reads is made on it (the destination slots' index too): one made on the
  compute stream could be read before its copy landed, and once dropped its memory could go to the compute
  stream's next tensor before the scatter ran, which would then write KV into the wrong slots;
* device -> host (a write): the side stream first waits for the compute that produced the KV, and the CPU
  waits for the copy before it writes the host rows, so the device slots it read may be reused at once
  (a write-back reads slots ``evict`` just freed). Writes therefore block the CPU for their copy.

A mover made ``timed`` (the engine's ``record_steps``) measures each copy for the simulator's bandwidths
(``take_times``): the CPU's part with ``time.perf_counter``, and beside a CUDA device the side stream's part
with CUDA events, read once the copy is done, so timing never makes the CPU wait for the GPU. A write's wait
for the compute that produced its KV is not counted: it is the forward's time, not the copy's.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from radixkv.cache.tiers import DEVICE, HOST, STORAGE, Copy, TierSpec
from radixkv.memory.kv_pool import KVPool


class KVMover:
    """Runs ``Copy`` records between the tiers' pools (``pools``: tier name -> ``KVPool``, the device's the
    engine's; or a device pool and a host pool), all of one layout.

    Bit for bit: K and V move in the pools' own dtype, every layer at once (``KVPool.gather`` / ``scatter``).
    O(layers x tokens) bytes per copy. ``timed``: each copy's tokens and seconds are kept for ``take_times``.
    """

    def __init__(self, pools: dict[str, KVPool] | KVPool, host: KVPool | None = None, timed: bool = False):
        if isinstance(pools, KVPool):  # KVMover(device, host): the two-tier spelling
            pools = {DEVICE: pools, HOST: host}
        device = pools[DEVICE]
        same = (device.num_layers, device.num_kv_heads, device.head_dim, device.page_size, device.dtype)
        for pool in pools.values():
            if same != (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.page_size, pool.dtype):
                raise ValueError(f"the pool {pool!r} does not match the device pool {device!r}")
        self.pools = pools
        self.stream = torch.cuda.Stream(device.device) if device.device.type == "cuda" else None
        self.timed = timed
        # timed copies not yet taken: (src, dst, tokens, CPU seconds, CUDA start and end events or None)
        self._times: list[tuple[str, str, int, float, torch.cuda.Event | None, torch.cuda.Event | None]] = []

    def __call__(self, copy: Copy) -> None:
        t0 = time.perf_counter()
        src, dst = self.pools[copy.src], self.pools[copy.dst]
        src_idx = _index(copy.src_slots, src)
        if self.stream is None:
            dst.scatter(_index(copy.dst_slots, dst), src.gather(src_idx))
            self._count(copy, time.perf_counter() - t0)
            return
        if dst.device.type == "cuda":  # a load: pinned staging, then asynchronous on the side stream
            staging = torch.empty((src.num_layers, 2, len(src_idx), src.num_kv_heads, src.head_dim),
                                  dtype=src.dtype, pin_memory=True)
            torch.index_select(src._kv, 2, src_idx, out=staging)
            cpu = time.perf_counter() - t0
            with torch.cuda.stream(self.stream):  # the index made here, on the stream that reads it (docstring)
                start = self._event()
                dst.scatter(_index(copy.dst_slots, dst), staging.to(dst.device, non_blocking=True))
                self._count(copy, cpu, start, self._event())
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the KV it copies is computed
        with torch.cuda.stream(self.stream):
            start = self._event()  # after the wait: the forward's time is not the copy's
            kv = src.gather(src_idx).to("cpu")  # a write: the CPU waits for it (see the module docstring)
            end = self._event()
        t0 = time.perf_counter()
        dst.scatter(_index(copy.dst_slots, dst), kv)
        self._count(copy, time.perf_counter() - t0, start, end)

    def _event(self) -> torch.cuda.Event | None:
        """A timing event recorded now on the current stream, where copies are timed."""
        if not self.timed:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _count(self, copy: Copy, cpu_seconds: float, start: torch.cuda.Event | None = None,
               end: torch.cuda.Event | None = None) -> None:
        if self.timed:
            self._times.append((copy.src, copy.dst, len(copy), cpu_seconds, start, end))

    def take_times(self) -> dict[tuple[str, str], tuple[int, float]]:
        """Tokens and seconds copied per (source tier, destination tier) by the timed copies since the last call
        (``StepRecord.of`` takes them). A CUDA copy still running is left for a later call, so reading never
        waits for the GPU. O(copies)."""
        out: dict[tuple[str, str], tuple[int, float]] = {}
        pending = []
        for src, dst, tokens, cpu, start, end in self._times:
            if end is not None and not end.query():
                pending.append((src, dst, tokens, cpu, start, end))
                continue
            gpu = start.elapsed_time(end) / 1e3 if start is not None and end is not None else 0.0  # milliseconds
            n, seconds = out.get((src, dst), (0, 0.0))
            out[(src, dst)] = (n + tokens, seconds + cpu + gpu)
        self._times = pending
        return out

    def wait(self) -> None:
        """Make the compute stream wait for every copy issued so far (before a forward reads loaded KV)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def _index(slots, pool: KVPool) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.long).to(pool.device, non_blocking=True)


class TierMemory:
    """The engine's KV memory by tier: ``device``, the pool the model attends from, and a buffer per lower tier
    (``buffer``), the layout of the device's: pinned host memory beside a CUDA pool, plain memory on a CPU, and
    for the storage tier a file of ``directory`` (a temporary one by default, removed once mapped: the mapping
    lives as long as the pool). ``mover`` runs copies among all of them, ``timed`` ones where asked (see
    ``KVMover``)."""

    def __init__(self, device: KVPool, directory: str | None = None, timed: bool = False):
        self.pools = {DEVICE: device}
        self.directory = directory
        self.timed = timed
        self._mover: KVMover | None = None

    def buffer(self, spec: TierSpec) -> KVPool:
        """A zeroed KV buffer of ``spec.tokens`` slots for that tier, kept in ``pools``."""
        d, path = self.pools[DEVICE], None
        memory = {"pin_memory": d.device.type == "cuda"}
        if spec.name == STORAGE:  # a new file, which KVPool reserves on disk and maps
            fd, path = tempfile.mkstemp(prefix="radixkv-storage-", suffix=".kv", dir=self.directory)
            os.close(fd)
            memory = {"file": path}
        try:
            pool = KVPool(d.num_layers, d.num_kv_heads, d.head_dim, num_slots=spec.tokens, page_size=d.page_size,
                          dtype=d.dtype, **memory)
        finally:
            if path is not None:
                os.unlink(path)  # mapped: nothing is left on disk once the engine goes
        self.pools[spec.name] = pool
        return pool

    def mover(self) -> KVMover:
        """The one mover of copies among every buffer made so far (made at the first call: build the tiers first)."""
        if self._mover is None:
            self._mover = KVMover(self.pools, timed=self.timed)
        return self._mover
