"""``KVMover``: real copies between the device's KV pool and a host tier's (``radixkv.cache.tiered.Copy``).

On a CPU a copy is an indexed gather and scatter, done when the call returns. Beside a CUDA device the host
pool is pinned and copies run on a side stream:

* host -> device (a load): the rows are gathered into a pinned staging buffer on the CPU, then copied and
  scattered on the side stream without blocking the CPU (PyTorch keeps a pinned buffer alive until the copy
  that reads it is done); ``wait`` makes the compute stream wait for them before attention reads them;
* device -> host (a write): the side stream first waits for the compute that produced the KV, and the CPU
  waits for the copy before it writes the host rows, so the device slots it read may be reused at once
  (a write-back reads slots ``evict`` just freed). Writes therefore block the CPU for their copy.
"""

from __future__ import annotations

import torch

from radixkv.cache.tiered import Copy
from radixkv.memory.kv_pool import KVPool


class KVMover:
    """Runs ``Copy`` records between ``device`` (the engine's pool) and ``host`` (a pool of the same layout).

    Bit for bit: K and V move in the pools' own dtype, every layer at once (``KVPool.gather`` / ``scatter``).
    O(layers x tokens) bytes per copy.
    """

    def __init__(self, device: KVPool, host: KVPool):
        same = (device.num_layers, device.num_kv_heads, device.head_dim, device.page_size, device.dtype)
        if same != (host.num_layers, host.num_kv_heads, host.head_dim, host.page_size, host.dtype):
            raise ValueError(f"the host pool {host!r} does not match the device pool {device!r}")
        self.pools = {"device": device, "host": host}
        self.stream = torch.cuda.Stream(device.device) if device.device.type == "cuda" else None

    def __call__(self, copy: Copy) -> None:
        src, dst = self.pools[copy.src], self.pools[copy.dst]
        src_idx, dst_idx = _index(copy.src_slots, src), _index(copy.dst_slots, dst)
        if self.stream is None:
            dst.scatter(dst_idx, src.gather(src_idx))
            return
        compute = torch.cuda.current_stream(self.stream.device)
        if dst.device.type == "cuda":  # a load: pinned staging, then asynchronous on the side stream
            staging = torch.empty((src.num_layers, 2, len(src_idx), src.num_kv_heads, src.head_dim),
                                  dtype=src.dtype, pin_memory=True)
            torch.index_select(src._kv, 2, src_idx, out=staging)
            with torch.cuda.stream(self.stream):
                dst.scatter(dst_idx, staging.to(dst.device, non_blocking=True))
            return
        self.stream.wait_stream(compute)  # the KV it copies is computed
        with torch.cuda.stream(self.stream):
            kv = src.gather(src_idx).to("cpu")  # a write: the CPU waits for it (see the module docstring)
        dst.scatter(dst_idx, kv)

    def wait(self) -> None:
        """Make the compute stream wait for every copy issued so far (before a forward reads loaded KV)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def _index(slots, pool: KVPool) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.long).to(pool.device, non_blocking=True)
