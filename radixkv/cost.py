"""What the simulator's clock is made of: ``CostModel`` (seconds per engine step from a few constants) and
``StepRecord`` (what one measured engine step computed and took, the data ``CostModel.fit`` calibrates from;
``LLM(record_steps=True)`` keeps them in ``LLM.step_log``). Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from radixkv.cache.tiers import HOST
from radixkv.checks import is_real
from radixkv.scheduling import causal_pairs


@dataclass(frozen=True)
class StepRecord:
    """What one engine step computed and how long it took: the simulator's calibration data.

    ``attention_pairs`` counts (new token, attended token) pairs of the
    prefill chunks, ``n * (p + (n + 1) / 2)`` for n new tokens after p.
    ``seconds`` is the whole step, ``model_seconds`` its model forward.
    """

    prefill_tokens: int
    attention_pairs: float
    decodes: int
    seconds: float
    model_seconds: float

    @classmethod
    def of(cls, prefix_lens: Sequence[int], new_lens: Sequence[int], seconds: float, model_seconds: float,
           prefill: Sequence[bool]) -> StepRecord:
        """One step's record from its rows' cached and new tokens (an ``AttentionBatch``'s ``prefix_lens`` and
        ``new_lens``). ``prefill[r]``: row r computes prompt tokens (a one-token chunk after a prefix looks like
        a decode)."""
        chunks = [(p, n) for p, n, f in zip(prefix_lens, new_lens, prefill, strict=True) if f]
        return cls(prefill_tokens=sum(n for _, n in chunks),
                   attention_pairs=float(sum(causal_pairs(n, p) for p, n in chunks)),
                   decodes=len(new_lens) - len(chunks), seconds=seconds, model_seconds=model_seconds)


# The constants in seconds, those ``CostModel.fit`` calibrates (the others are bytes and bandwidths).
TIME_CONSTANTS = ("prefill_per_token", "attention_per_pair", "decode_step", "decode_per_seq", "step_overhead")


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step, from a few named constants.

    Defaults are a 135M-parameter Llama (SmolLM2) in bfloat16 on 2 CPU cores
    (the engine's calibration replaces them with measured values):

    Attributes:
        prefill_per_token: seconds per computed prompt token (the linear layers).
        attention_per_pair: seconds per (new token, attended token) pair, the
            quadratic attention term of prefill: a chunk of n new tokens after
            a prefix of p costs ``n * (p + (n + 1) / 2)`` pairs.
        decode_step: fixed seconds per decode step (weights streamed once).
        decode_per_seq: extra seconds per sequence in the decode batch.
        step_overhead: fixed seconds per engine step (scheduling, launch).
        kv_bytes_per_token: bytes of one token's K and V over all layers (SmolLM2-135M in bfloat16:
            2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040).
        host_bandwidth: bytes per second from the host tier into the device's KV (PCIe on a GPU).
        storage_bandwidth: bytes per second from the storage tier into the device's KV.
        load_overlap: the share of a step's loads hidden under its compute, 0 (loads first, then the
            forward) to 1 (layer by layer: layer i computes while layer i + 1 loads, the step takes the
            longer of the two).

    A load is taken only where it beats recomputing (``worth_loading``, Mooncake's condition). Writes down
    the tiers run beside the forward (a side stream) and cost no step time. ``COST_PRESETS`` holds GPU
    classes with their derivation.
    """

    prefill_per_token: float = 3.5e-4
    attention_per_pair: float = 2.0e-8
    decode_step: float = 0.013
    decode_per_seq: float = 0.002
    step_overhead: float = 0.0005
    kv_bytes_per_token: float = 23040.0
    host_bandwidth: float = 5e9
    storage_bandwidth: float = 1e9
    load_overlap: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if not (is_real(v) and v >= 0)}
        if bad:
            raise ValueError(f"CostModel constants must be finite numbers >= 0 (seconds), got {bad}")
        if self.load_overlap > 1 or not (self.host_bandwidth > 0 and self.storage_bandwidth > 0):
            raise ValueError("CostModel: load_overlap must be in [0, 1] and the bandwidths > 0")

    @classmethod
    def from_dict(cls, values: object) -> CostModel:
        """A cost model from a dict of its constants (as ``--calibrate`` writes them); ``ValueError`` otherwise."""
        names = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - names:
            raise ValueError(f"a cost model is a JSON object with keys among {sorted(names)}, got {values!r}")
        return cls(**values)

    @classmethod
    def preset(cls, name: str) -> CostModel:
        """A named cost model from ``COST_PRESETS``; ``ValueError`` naming the presets otherwise."""
        if name not in COST_PRESETS:
            raise ValueError(f"unknown cost model preset {name!r}; choose one of {sorted(COST_PRESETS)}")
        return COST_PRESETS[name]

    def scaled(self, replicas: int) -> CostModel:
        """The cost of ``replicas`` such engines pooled into one: N x the compute and N x the load bandwidth."""
        return replace(self, **{k: getattr(self, k) / replicas for k in TIME_CONSTANTS},
                       host_bandwidth=self.host_bandwidth * replicas,
                       storage_bandwidth=self.storage_bandwidth * replicas)

    def load_time(self, tier: str, tokens: int) -> float:
        """Seconds to load ``tokens`` tokens' KV from the lower tier named ``tier`` into the device: the host
        tier's bandwidth, or the storage's for any tier further down."""
        bandwidth = self.host_bandwidth if tier == HOST else self.storage_bandwidth
        return tokens * self.kv_bytes_per_token / bandwidth

    def worth_loading(self, tier: str, tokens: int, prefix_len: int) -> bool:
        """Whether loading ``tokens`` from ``tier`` after ``prefix_len`` cached ones beats computing them."""
        return self.load_time(tier, tokens) < self.prefill_time(tokens, prefix_len)

    def with_loads(self, compute: float, loads: float) -> float:
        """A step's seconds from its compute and its loads' (``load_overlap`` of the shorter hidden)."""
        return compute + loads - self.load_overlap * min(compute, loads)

    def prefill_time(self, new_tokens: int, prefix_len: int) -> float:
        return self.prefill_per_token * new_tokens + self.attention_per_pair * causal_pairs(new_tokens, prefix_len)

    def saved_prefill_time(self, prompt_len: int, hit: int) -> float:
        """Seconds of prefill a request of ``prompt_len`` tokens saved by finding ``hit`` of them cached:
        ``prefill_time(n, 0) - prefill_time(n - h, h)``, which is ``prefill_per_token * h`` plus the
        attention among the cached tokens, ``attention_per_pair * h (h + 1) / 2``.

        >>> CostModel(prefill_per_token=1.0, attention_per_pair=0.5).saved_prefill_time(10, 4)
        9.0
        """
        return self.prefill_time(prompt_len, 0) - self.prefill_time(prompt_len - hit, hit)

    def decode_time(self, batch: int) -> float:
        return self.decode_step + self.decode_per_seq * batch if batch else 0.0

    def step_time(self, prefill_tokens: int, attention_pairs: float, decodes: int) -> float:
        """One step's seconds: its prefill chunks' tokens and pairs, its decode batch, the fixed overhead."""
        return (self.step_overhead + self.prefill_per_token * prefill_tokens
                + self.attention_per_pair * attention_pairs + self.decode_time(decodes))

    @classmethod
    def fit(cls, records: Sequence[Any]) -> CostModel:
        """Least-squares fit to measured steps (``LLM.step_log`` with ``record_steps=True``).

        Each record has ``prefill_tokens``, ``attention_pairs``, ``decodes`` and
        ``seconds``. It minimizes squared *relative* errors (so the many short
        decode steps count as much as the few long prefill ones), with every
        constant non-negative: exact non-negative least squares, by trying every
        subset of the five constants (the others fixed at zero) and keeping
        the best feasible one.
        """
        if len(records) < 5:
            raise ValueError(f"need at least 5 measured steps to fit 5 constants, got {len(records)}")
        x = np.array([[r.prefill_tokens, r.attention_pairs, r.decodes > 0, r.decodes, 1.0] for r in records],
                     dtype=np.float64)
        y = np.array([r.seconds for r in records], dtype=np.float64)
        # Relative errors: a few long prefill steps would otherwise outweigh a hundred decode steps.
        weight = 1.0 / np.maximum(y, 1e-9)
        x, y = x * weight[:, None], y * weight
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns differ by 10^6: solve on normalized ones
        best, coef = np.inf, np.zeros(x.shape[1])
        for mask in range(1, 2 ** x.shape[1]):  # every subset of free constants, the rest fixed at 0: exact NNLS
            cols = [c for c in range(x.shape[1]) if mask >> c & 1]
            sol, *_ = np.linalg.lstsq(x[:, cols] / scale[cols], y, rcond=None)
            if (sol < 0).any():
                continue
            err = float(np.sum((x[:, cols] @ (sol / scale[cols]) - y) ** 2))
            if err < best:
                best, coef = err, np.zeros(x.shape[1])
                coef[cols] = sol / scale[cols]
        return cls(**{name: float(v) for name, v in zip(TIME_CONSTANTS, coef, strict=True)})  # x's columns, in order


def _gpu_preset(params: float, layers: int, hidden: int, kv_heads: int, gpus: int, tflops: float, hbm_tbs: float,
                pcie_gbs: float, storage_gbs: float) -> CostModel:
    """A cost model for a Llama of ``params`` parameters in bfloat16 on ``gpus`` GPUs (tensor parallel), from
    datasheet peaks at the utilization serving engines reach (50% of the dense bfloat16 FLOPs in prefill,
    70% of the HBM bandwidth in decode):

    * prefill: 2 x params FLOPs per token; attention: 4 x layers x hidden FLOPs per (query, key) pair;
    * decode step: the weights (2 bytes each) streamed once; per sequence: its KV read for a context of
      8,192 tokens (the trace's mean prompt is about that order);
    * KV bytes per token: 2 (K, V) x layers x KV heads x 128 x 2 bytes;
    * host bandwidth: PCIe at ``pcie_gbs`` GB/s per GPU; storage: ``storage_gbs`` GB/s per node (RDMA).
    """
    flops, hbm = 0.5 * tflops * 1e12 * gpus, 0.7 * hbm_tbs * 1e12 * gpus
    kv = 2 * layers * kv_heads * 128 * 2
    return CostModel(prefill_per_token=2 * params / flops, attention_per_pair=4 * layers * hidden / flops,
                     decode_step=2 * params / hbm, decode_per_seq=8192 * kv / hbm, step_overhead=0.002,
                     kv_bytes_per_token=float(kv), host_bandwidth=pcie_gbs * 1e9 * gpus,
                     storage_bandwidth=storage_gbs * 1e9)


# Datasheet figures: H100 SXM 989 dense bf16 TFLOPS, 3.35 TB/s HBM3; H200 the same FLOPs, 4.8 TB/s HBM3e;
# both PCIe Gen5 x16 (about 50 GB/s achieved of 64). Storage: one 400 Gb/s RDMA link (50 GB/s), the
# order of Mooncake store's per-node transfer engine; the engine's CPU preset is ``CostModel()``.
COST_PRESETS: dict[str, CostModel] = {
    "cpu-smollm2-135m": CostModel(),
    "llama3-8b-h100": _gpu_preset(8.0e9, 32, 4096, 8, 1, 989, 3.35, 50, 50),
    "llama3-8b-h200": _gpu_preset(8.0e9, 32, 4096, 8, 1, 989, 4.8, 50, 50),
    "llama3-70b-8xh100": _gpu_preset(70.6e9, 80, 8192, 8, 8, 989, 3.35, 50, 50),
    "llama3-70b-8xh200": _gpu_preset(70.6e9, 80, 8192, 8, 8, 989, 4.8, 50, 50),
}
