"""The elementwise steps of a Llama layer, and the loop over layers, as swappable strategies.

``TorchOps`` is the eager PyTorch math (the oracle, used by default and for
float32). ``CpuKernelOps`` runs the same steps through the compiled CPU
kernels (``radixkv.kernels``): one call each for RMSNorm, RoPE plus the KV
store, and SwiGLU's ``silu(gate) * up``, instead of 3-15 small eager ops.
On a 2-core CPU at decode batch sizes those small ops, not their
arithmetic, are what costs. The kernels round where the eager ops round, so
results differ from ``TorchOps`` only in summation order (see the tests).
For the same reason ``CpuKernelOps.run_layers`` hands a pure-decode step's
whole layer stack to one compiled call (``DecodeStack``) where every linear
layer has ``small_linear`` tiles: the same kernels in the same order, so
the same bits, without ~11 Python calls a layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

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

    def run_layers(self, layers: Sequence[Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   out_slots: torch.Tensor, pool: KVPool, backend: Any) -> torch.Tensor:
        """The decoder layers over ``x`` ``[num_tokens, hidden]``, one module call each; returns the last output."""
        for layer in layers:
            x = layer(x, cos, sin, out_slots, pool, backend)
        return x


class CpuKernelOps(TorchOps):
    """The same steps through ``radixkv.kernels`` (CPU tensors, one dtype throughout)."""

    name = "cpu"

    def __init__(self, kernels: ModuleType):
        self.kernels = kernels
        # (layers, pool, (DecodeStack, max rows) or None where the layers have no tiles), for the last pair seen
        self._stack: tuple[Any, KVPool, tuple[Any, int] | None] | None = None

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

    def run_layers(self, layers: Sequence[Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   out_slots: torch.Tensor, pool: KVPool, backend: Any) -> torch.Tensor:
        """A pure-decode step of a stack with ``small_linear`` tiles in one ``DecodeStack`` call; else layer by layer.

        The stack is built on the first such step for these layers and this pool, and kept.
        """
        plan = backend.decode_plan() if hasattr(backend, "decode_plan") else None
        stack = self._decode_stack(layers, pool, backend) if plan is not None and x.dtype == pool.dtype else None
        if stack is None or x.shape[0] > stack[1]:
            return super().run_layers(layers, x, cos, sin, out_slots, pool, backend)
        n, d = x.shape[0], pool.head_dim
        return stack[0].forward(x, cos.reshape(n, d), sin.reshape(n, d), out_slots, *plan)

    def _decode_stack(self, layers: Sequence[Any], pool: KVPool, backend: Any) -> tuple[Any, int] | None:
        """``(DecodeStack, max rows)`` for ``layers`` over ``pool``, or None where a layer has no tiles.

        Either answer is kept for the pair, so a model that cannot use the stack pays for finding that out once.
        """
        if self._stack is None or self._stack[0] is not layers or self._stack[1] is not pool:
            self._stack = (layers, pool, self._build_stack(layers, pool, backend))
        return self._stack[2]

    def _build_stack(self, layers: Sequence[Any], pool: KVPool, backend: Any) -> tuple[Any, int] | None:
        found = []
        for layer in layers:
            weights = layer.small_linear_weights() if hasattr(layer, "small_linear_weights") else None
            if weights is None:
                return None
            found.append(weights)
        if not found or not self.kernels.has_avx2():
            return None
        attn, norm = layers[0].self_attn, layers[0].input_layernorm
        def layer(i: int, weights: dict[str, Any]) -> Any:
            tiled = {name: self.kernels.TiledLinear(**m.small_linear_args()) for name, m in weights.items()
                     if name not in ("input_norm", "post_norm")}
            return self.kernels.DecodeLayer(input_norm=weights["input_norm"], post_norm=weights["post_norm"],
                                            **tiled, k_pool=pool.k[i], v_pool=pool.v[i])

        stack = self.kernels.DecodeStack(
            [layer(i, weights) for i, (weights, _) in enumerate(found)],
            heads=attn.cfg.num_heads, kv_heads=attn.cfg.num_kv_heads, eps=norm.eps, scale=backend.scale)
        return stack, min(rows for _, rows in found)


def ops_for_backend(backend: object) -> TorchOps:
    """The ops that go with an attention backend: the compiled ones with a backend that holds the kernels."""
    kernels = getattr(backend, "kernels", None)
    return TorchOps() if kernels is None else CpuKernelOps(kernels)
