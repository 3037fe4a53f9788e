"""The elementwise steps of a Llama layer, as swappable strategies.

``TorchOps`` is the eager PyTorch math (the oracle, used by default and for
float32). ``CpuKernelOps`` runs the same steps through the compiled CPU
kernels (``radixkv.kernels``): one call each for RMSNorm, RoPE plus the KV
store, and SwiGLU's ``silu(gate) * up``, instead of 3-15 small eager ops.
On a 2-core CPU at decode batch sizes those small ops, not their
arithmetic, are what costs. The kernels round where the eager ops round, so
results differ from ``TorchOps`` only in summation order (see the tests).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from radixkv.kv_pool import KVPool


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    """Eager PyTorch, as ``transformers`` computes these steps."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: [num_tokens, hidden]; normalize in float32 as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, layer: int,
                   slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """RoPE on q and k of ``qkv`` ``[n, (H + 2 Hkv) D]``, k and v stored at ``slots``; returns q ``[n, H, D]``.

        cos, sin: ``[n, 1, D]`` in the model's dtype.
        """
        n, d = qkv.shape[0], pool.head_dim
        q, k, v = qkv.split((num_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
        q = q.reshape(n, num_heads, d)  # q: [num_tokens, num_heads, head_dim]
        k = k.reshape(n, num_kv_heads, d)  # k: [num_tokens, num_kv_heads, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        pool.store(layer, k, v.reshape(n, num_kv_heads, d), slots)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # each [num_tokens, intermediate]
        return F.silu(gate) * up


class CpuKernelOps(TorchOps):
    """The same steps through ``radixkv.kernels`` (CPU tensors, one dtype throughout)."""

    name = "cpu"

    def __init__(self, kernels: ModuleType):
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), None, weight, eps)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, layer: int,
                   slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        n, d = qkv.shape[0], pool.head_dim
        self.kernels.rope_store(qkv, cos.reshape(n, d), sin.reshape(n, d), pool.k[layer], pool.v[layer], slots,
                                num_heads, num_kv_heads)
        return qkv[:, : num_heads * d].view(n, num_heads, d)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


def ops_for_backend(backend: object) -> TorchOps:
    """The ops that go with an attention backend: the compiled ones with a backend that holds the kernels."""
    kernels = getattr(backend, "kernels", None)
    return TorchOps() if kernels is None else CpuKernelOps(kernels)
