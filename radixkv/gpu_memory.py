"""The memory a GPU preset's node has for KV: HBM less the weights less an activation reserve.

A capacity in a simulation is only a claim about hardware when the hardware holds it. ``NodeMemory`` states,
for each GPU preset of ``radixkv.cost.COST_PRESETS``, the HBM, the weights (bfloat16), the KV bytes per token
and the reserve an engine keeps for activations, CUDA graphs and the allocator (10% of HBM: vLLM's default
``gpu_memory_utilization=0.9``), and from them the device tokens that fit. ``check_capacity`` refuses a
capacity above it with the arithmetic in the message, unless forced; a forced row is ``infeasible``.

The figures (datasheet HBM, decimal GB; Llama-3 shapes, 128-dim KV heads, bfloat16), as
preset: HBM, weights, KV bytes a token -> device tokens:

* ``llama3-8b-h100``: 80 GB, 16.1 GB, 131,072 -> 426,788
* ``llama3-8b-h200``: 141 GB, 16.1 GB, 131,072 -> 845,642
* ``llama3-70b-8xh100``: 640 GB, 141.2 GB, 327,680 -> 1,326,904
* ``llama3-70b-8xh200``: 1,128 GB, 141.2 GB, 327,680 -> 2,667,236
* ``llama3-70b-8xb200``: 1,440 GB, 141.2 GB, 327,680 -> 3,524,169

(``python -c "from radixkv.gpu_memory import table; print(table())"`` prints it.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATION_RESERVE = 0.10  # share of HBM an engine keeps out of its KV budget (vLLM: gpu_memory_utilization 0.9)


@dataclass(frozen=True)
class NodeMemory:
    """One node's memory for a model: ``gpus`` GPUs of ``hbm_per_gpu`` bytes, ``weight_bytes`` of weights
    (all GPUs together: tensor parallel shards them), ``kv_bytes_per_token`` (all layers, K and V, all GPUs),
    and ``activation_reserve``, the share of HBM kept for activations. Sizes in bytes."""

    gpus: int
    hbm_per_gpu: float
    weight_bytes: float
    kv_bytes_per_token: float
    activation_reserve: float = ACTIVATION_RESERVE

    def __post_init__(self) -> None:
        if self.gpus < 1 or min(self.hbm_per_gpu, self.weight_bytes, self.kv_bytes_per_token) <= 0:
            raise ValueError(f"NodeMemory: gpus >= 1 and sizes > 0, got {self}")
        if not 0 <= self.activation_reserve < 1:
            raise ValueError(f"NodeMemory: activation_reserve must be in [0, 1), got {self.activation_reserve}")

    @property
    def hbm(self) -> float:
        """Bytes of HBM on the node."""
        return self.gpus * self.hbm_per_gpu

    @property
    def kv_budget(self) -> float:
        """Bytes left for KV: HBM less the reserve less the weights (never below 0)."""
        return max(self.hbm * (1 - self.activation_reserve) - self.weight_bytes, 0.0)

    @property
    def device_tokens(self) -> int:
        """Tokens of KV that fit on the node."""
        return math.floor(self.kv_budget / self.kv_bytes_per_token)

    def arithmetic(self) -> str:
        """How ``device_tokens`` is reached, in words and GB."""
        return (f"{self.gpus} x {self.hbm_per_gpu / 1e9:g} GB HBM = {self.hbm / 1e9:g} GB, less the "
                f"{self.activation_reserve:.0%} activation reserve ({self.hbm * self.activation_reserve / 1e9:.1f} "
                f"GB), less {self.weight_bytes / 1e9:.1f} GB of weights = {self.kv_budget / 1e9:.1f} GB of KV; at "
                f"{self.kv_bytes_per_token:,.0f} bytes a token that is {self.device_tokens:,} tokens")


def _llama(params: float, layers: int, kv_heads: int, gpus: int, hbm_gb: float) -> NodeMemory:
    """A Llama of ``params`` parameters in bfloat16 on ``gpus`` GPUs of ``hbm_gb`` GB (128-dim KV heads)."""
    return NodeMemory(gpus=gpus, hbm_per_gpu=hbm_gb * 1e9, weight_bytes=2 * params,
                      kv_bytes_per_token=float(2 * layers * kv_heads * 128 * 2))


# HBM per GPU: H100 SXM 80 GB, H200 141 GB, B200 (HGX, DGX) 180 GB. Parameters: Llama-3-8B 8.03e9, 70B 70.6e9.
NODE_MEMORY: dict[str, NodeMemory] = {
    "llama3-8b-h100": _llama(8.03e9, 32, 8, 1, 80),
    "llama3-8b-h200": _llama(8.03e9, 32, 8, 1, 141),
    "llama3-70b-8xh100": _llama(70.6e9, 80, 8, 8, 80),
    "llama3-70b-8xh200": _llama(70.6e9, 80, 8, 8, 141),
    "llama3-70b-8xb200": _llama(70.6e9, 80, 8, 8, 180),
}
NODE_MEMORY["llama3-70b-8xh100-pcie"] = NODE_MEMORY["llama3-70b-8xh100"]  # the same node, its loads slower


class InfeasibleCapacity(ValueError):
    """A capacity above what the preset's node holds."""


def check_capacity(preset: str, device_tokens: float, force: bool = False) -> bool:
    """Whether ``device_tokens`` of KV fit on ``preset``'s node (``NODE_MEMORY``); a preset with no node (the
    CPU's, a fitted file) always fits. Above it: ``InfeasibleCapacity`` with the arithmetic, or, with ``force``,
    False (the caller marks the row ``infeasible``)."""
    node = NODE_MEMORY.get(preset)
    if node is None or device_tokens <= node.device_tokens:
        return True
    if force:
        return False
    raise InfeasibleCapacity(f"{device_tokens:,.0f} device tokens do not fit on {preset}: {node.arithmetic()}. "
                             f"Use a capacity that fits, or force it (the row then says infeasible)")


def table() -> str:
    """The presets' memory, one line each (the module doc's table)."""
    return "\n".join(f"{name}: {node.arithmetic()}" for name, node in NODE_MEMORY.items())
