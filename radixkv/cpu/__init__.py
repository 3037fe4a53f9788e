"""Everything that exists only to make a CPU serve fast, behind one call: ``accelerate``.

* ``kernels``: the compiled kernels (``cpu_kernels.cpp``: paged attention,
  fused layer steps, decode-sized linear layers, ``DecodeStack``), built on
  first use for this machine's CPU.
* ``paged_attention``: the ``cpu`` attention backend (``CpuPagedBackend``),
  which reads K/V in place from the pool through those kernels.
* ``fused``: ``FusedLlama``, the model's forward with the kernels' RMSNorm,
  RoPE + KV store and SwiGLU, and pure-decode steps in one call.
* ``linear``: ``pack_linears`` and ``PackedLinear``, 16-bit linear layers in
  oneDNN's packed layout, with decode-sized tiles and exact 4-bit codes
  (``coded``) for the kernels.
* ``hugepages``: the KV pool and the weight tiles in 2 MiB pages.

None of it changes what the model computes beyond summation order.
Importing this package registers the ``cpu`` attention backend (``radixkv.attention.registry``), which
``make_backend`` then builds by name or picks for ``auto``.
``radixkv.forward.build_forward`` imports it and calls ``accelerate`` only on a CPU,
for a 16-bit model with ``attention_backend="auto"`` or any model with
``"cpu"`` (float32 with ``auto`` stays on the plain path, the oracle); every
other configuration imports nothing from this package.
"""

from __future__ import annotations

from radixkv.attention.backends import make_backend
from radixkv.attention.base import AttentionBackend
from radixkv.attention.registry import register
from radixkv.cpu import hugepages
from radixkv.cpu.fused import FusedLlama
from radixkv.cpu.linear import pack_linears
from radixkv.cpu.paged_attention import CpuPagedBackend, cpu_backend_unavailable_reason
from radixkv.memory.kv_pool import KVPool
from radixkv.model.llama import LlamaForCausalLM

register("cpu", cpu_backend_unavailable_reason, CpuPagedBackend)


def accelerate(model: LlamaForCausalLM, pool: KVPool, attention_backend: str = "auto",
               batch_invariant: bool = False) -> tuple[FusedLlama | LlamaForCausalLM, AttentionBackend]:
    """Serve ``model`` over ``pool`` as fast as this CPU allows: the forward to call and the attention backend.

    Packs the model's linear layers in place (``pack_linears``), moves the
    pool into huge pages (``KVPool.reallocate``, keeping its contents) unless it is there already, and
    builds ``attention_backend`` (``make_backend``: ``auto`` picks ``cpu``
    where the kernels build, else ``torch-cascade``). With the ``cpu``
    backend the forward is ``FusedLlama``; with any other it is the model.
    ``batch_invariant``: each token's logits do not depend on which other
    requests share its step (``PackedLinear``'s batch-invariant layers; no
    ``DecodeStack``, whose tiles take the row count's kernels; the attention
    kernels work request by request, splitting a decode's context by its
    length alone, and prefill chunks take ``paged_prefill``, not the AMX
    cascade); ``ValueError`` where the linear kernels cannot serve it.
    Call it before serving: views of the pool taken earlier go stale.
    """
    pack_linears(model, batch_invariant=batch_invariant)
    if pool.zeros is not hugepages.zeros:  # built elsewhere: moved (a pool built by radixkv.forward.pool_zeros is not)
        pool.reallocate(hugepages.zeros)
    backend = make_backend(attention_backend, pool, model.config.num_heads)
    if batch_invariant and isinstance(backend, CpuPagedBackend):  # its prefill by rows, not AMX's cascade
        backend = CpuPagedBackend(pool, model.config.num_heads, batch_invariant=True)
    return fused_forward(model, backend, use_stack=not batch_invariant), backend


def fused_forward(model: LlamaForCausalLM, backend: AttentionBackend,
                  use_stack: bool = True) -> FusedLlama | LlamaForCausalLM:
    """``FusedLlama`` over ``model`` for the ``cpu`` backend (whose kernels it runs with); else ``model``."""
    return FusedLlama(model, backend, use_stack) if isinstance(backend, CpuPagedBackend) else model


__all__ = ["CpuPagedBackend", "FusedLlama", "accelerate", "fused_forward", "hugepages", "pack_linears"]
