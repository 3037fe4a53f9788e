"""A Llama forward whose layer steps run through the compiled CPU kernels.

``FusedLlama`` serves a ``LlamaForCausalLM``'s own modules and weights, with
its elementwise steps through ``CpuKernelOps``: one kernel call each for
RMSNorm, RoPE plus the KV store, and SwiGLU's ``silu(gate) * up``, instead
of 3-15 small eager ops. On a CPU at decode batch sizes those small ops, not
their arithmetic, are what costs. The kernels round where the eager ops
round, so results differ from the eager model only in summation order (see
the tests). For the same reason a pure-decode step of a model whose linear
layers have ``small_linear`` tiles goes through all layers in one compiled
call (``DecodeStack``): the same kernels in the same order, so the same
bits, without about eleven Python calls a layer.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from radixkv.cpu.capabilities import cpu_capabilities
from radixkv.cpu.linear import PackedLinear
from radixkv.cpu.paged_attention import CpuPagedBackend
from radixkv.memory.kv_pool import KVPool
from radixkv.model.llama import DecoderLayer, LlamaForCausalLM, logit_rows


class CpuKernelOps:
    """RMSNorm, RoPE + KV store and SwiGLU through ``radixkv.cpu.kernels`` (CPU tensors, one dtype throughout)."""

    def __init__(self, kernels: ModuleType):
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), None, weight, eps)  # x: [num_tokens, hidden]

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool, layer: int,
                   slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        """RoPE on q and k of ``qkv`` ``[n, (H + 2 Hkv) D]`` in place, k and v stored at ``slots``; returns q
        ``[n, H, D]`` (a view of ``qkv``). cos, sin: ``[n, D]`` in the model's dtype."""
        n, d = qkv.shape[0], pool.head_dim
        self.kernels.rope_store(qkv, cos, sin, pool.k[layer], pool.v[layer], slots, num_heads, num_kv_heads)
        return qkv[:, : num_heads * d].view(n, num_heads, d)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)  # [num_tokens, 2 * inter] -> [num_tokens, inter]


def layer_weights(layer: DecoderLayer) -> tuple[dict[str, Any], int] | None:
    """The layer's norm weights and its ``PackedLinear``s by name, and the most rows their tiles serve
    (``PackedLinear.small_rows``); None unless every linear layer has tiles (``pack_linears`` on a 16-bit
    model on a CPU with AVX2, AVX-512 ones included). What ``DecodeStack`` runs the layer from."""
    linears = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
               "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    if not all(isinstance(m, PackedLinear) and m.tiles is not None for m in linears.values()):
        return None
    weights = {"input_norm": layer.input_layernorm.weight.detach(),
               "post_norm": layer.post_attention_layernorm.weight.detach(), **linears}
    return weights, min(m.small_rows for m in linears.values())


def build_decode_stack(kernels: ModuleType, model: LlamaForCausalLM, pool: KVPool,
                       scale: float) -> tuple[Any, int] | None:
    """``(DecodeStack, max rows)`` over ``model``'s layers and ``pool``, or None where a layer has no tiles."""
    found = [layer_weights(layer) for layer in model.model.layers]
    if not found or None in found or not cpu_capabilities().avx2:
        return None
    cfg = model.config

    def layer(i: int, weights: dict[str, Any]) -> Any:
        tiled = {name: kernels.TiledLinear(**m.small_linear_args()) for name, m in weights.items()
                 if name not in ("input_norm", "post_norm")}
        return kernels.DecodeLayer(input_norm=weights["input_norm"], post_norm=weights["post_norm"], **tiled,
                                   k_pool=pool.k[i], v_pool=pool.v[i])

    stack = kernels.DecodeStack([layer(i, weights) for i, (weights, _) in enumerate(found)], heads=cfg.num_heads,
                                kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps, scale=scale)
    return stack, min(rows for _, rows in found)


class FusedLlama(nn.Module):
    """``model``'s forward with the kernels' elementwise steps, and pure-decode steps through ``DecodeStack``.

    Called as the model is (``LlamaForCausalLM.forward``'s arguments), with
    the ``cpu`` backend it was built for: a pure-decode step reads that
    backend's CSR plan (``decode_plan``). The model's modules stay its own
    (``self.model``); the stack is built on the first pure-decode step over a
    pool, and kept for that pool. ``use_stack=False`` runs every step layer
    by layer (the tests compare the two).
    """

    def __init__(self, model: LlamaForCausalLM, backend: CpuPagedBackend, use_stack: bool = True):
        super().__init__()
        self.model, self.config, self.backend = model, model.config, backend
        self.ops = CpuKernelOps(backend.kernels)
        self.use_stack = use_stack
        self._stack: tuple[KVPool, tuple[Any, int] | None] | None = None  # (pool, its stack) for the last pool

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, pool: KVPool,
                backend: CpuPagedBackend, logits_rows: torch.Tensor | None = None,
                qo_indptr: torch.Tensor | None = None) -> torch.Tensor:
        x, cos, sin = self.model.embed(input_ids, positions)  # x: [n, hidden]; cos, sin: [n, 1, head_dim]
        n, d = x.shape[0], pool.head_dim
        cos, sin = cos.reshape(n, d), sin.reshape(n, d)
        plan = backend.decode_plan() if self.use_stack else None
        stack = self._decode_stack(pool, backend) if plan is not None and x.dtype == pool.dtype else None
        if stack is not None and n <= stack[1]:
            x = stack[0].forward(x, cos, sin, out_slots, *plan)
        else:
            for layer in self.model.model.layers:
                x = self._layer(layer, x, cos, sin, out_slots, pool, backend)
        x = logit_rows(x, logits_rows, qo_indptr)
        norm = self.model.model.norm
        return self.model.lm_head(self.ops.rms_norm(x, norm.weight, norm.eps))  # [rows, vocab_size]

    def _layer(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out_slots: torch.Tensor, pool: KVPool, backend: CpuPagedBackend) -> torch.Tensor:
        """``DecoderLayer.forward`` with the kernels' RMSNorm, RoPE + store and SwiGLU. cos, sin: ``[n, D]``."""
        ops, attn, mlp, cfg = self.ops, layer.self_attn, layer.mlp, self.config
        norm = layer.input_layernorm
        qkv = attn.qkv_proj(ops.rms_norm(x, norm.weight, norm.eps))  # [n, (H + 2 Hkv) D]
        q = ops.rope_store(qkv, cos, sin, pool, attn.layer, out_slots, cfg.num_heads, cfg.num_kv_heads)
        o = backend.run(q, attn.layer)  # o: [n, H, D]
        x = x + attn.o_proj(o.reshape(x.shape[0], -1))
        norm = layer.post_attention_layernorm
        return x + mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(ops.rms_norm(x, norm.weight, norm.eps))))

    def _decode_stack(self, pool: KVPool, backend: CpuPagedBackend) -> tuple[Any, int] | None:
        """``(DecodeStack, max rows)`` over ``pool``, or None where a layer has no tiles; either answer is kept
        for the pool, so a model that cannot use the stack pays for finding that out once."""
        if self._stack is None or self._stack[0] is not pool:
            self._stack = (pool, build_decode_stack(self.ops.kernels, self.model, pool, backend.scale))
        return self._stack[1]
