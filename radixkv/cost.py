"""What the simulator's clock is made of: ``CostModel`` (seconds per engine step from a few constants) and
``StepRecord`` (what one measured engine step computed, loaded and took, the data ``CostModel.fit`` calibrates
from; ``LLM(record_steps=True)`` keeps them in ``LLM.step_log``, ``radixkv serve --record-steps PATH`` writes
them to a file, ``radixkv.step_file``). Torch-free."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from radixkv.cache.tiers import DEVICE, HOST, STORAGE
from radixkv.checks import is_real
from radixkv.scheduling import causal_pairs


@dataclass(frozen=True)
class StepRecord:
    """What one engine step computed and how long it took: the simulator's calibration data.

    ``attention_pairs`` counts (new token, attended token) pairs of the
    prefill chunks, ``n * (p + (n + 1) / 2)`` for n new tokens after p.
    ``prefill_seqs`` counts the prefill chunks (rows that compute prompt tokens; each also computes one row
    of logits and is sampled from, as a decode row is); None in a file written before it was recorded.
    ``seconds`` is the whole step, ``model_seconds`` its model forward.

    The copies between the tiers during the step, where the engine has lower tiers: ``loaded_tokens`` and
    ``load_seconds`` from the host tier into the device, ``storage_loaded_tokens`` and
    ``storage_load_seconds`` from any tier below it, ``written_tokens`` and ``write_seconds`` from the device
    down. Loads are part of ``seconds`` (they run before the forward); a step with neither prefill nor
    decodes is one of loads alone (a due prefetch while no request was in).
    """

    prefill_tokens: int
    attention_pairs: float
    decodes: int
    seconds: float
    model_seconds: float
    loaded_tokens: int = 0
    load_seconds: float = 0.0
    storage_loaded_tokens: int = 0
    storage_load_seconds: float = 0.0
    written_tokens: int = 0
    write_seconds: float = 0.0
    prefill_seqs: int | None = None

    @classmethod
    def of(cls, prefix_lens: Sequence[int], new_lens: Sequence[int], seconds: float, model_seconds: float,
           prefill: Sequence[bool], copies: Mapping[tuple[str, str], tuple[int, float]] | None = None) -> StepRecord:
        """One step's record from its rows' cached and new tokens (an ``AttentionBatch``'s ``prefix_lens`` and
        ``new_lens``). ``prefill[r]``: row r computes prompt tokens (a one-token chunk after a prefix looks like
        a decode). ``copies``: tokens and seconds copied per (source tier, destination tier), as
        ``KVMover.take_times`` gives them."""
        chunks = [(p, n) for p, n, f in zip(prefix_lens, new_lens, prefill, strict=True) if f]
        moved: dict[str, float] = {name: 0 if name.endswith("tokens") else 0.0 for name in TRANSFER_FIELDS}
        for (src, _), (tokens, secs) in (copies or {}).items():
            tokens_field, seconds_field = _copy_fields(src)
            moved[tokens_field] += tokens
            moved[seconds_field] += secs
        return cls(prefill_tokens=sum(n for _, n in chunks),
                   attention_pairs=float(sum(causal_pairs(n, p) for p, n in chunks)),
                   decodes=len(new_lens) - len(chunks), seconds=seconds, model_seconds=model_seconds,
                   prefill_seqs=len(chunks), **moved)

    @classmethod
    def from_dict(cls, values: object) -> StepRecord:
        """A record from a dict of its fields (a line of a step file; the copy fields may be missing: 0);
        ``ValueError`` otherwise."""
        names = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - names:
            raise ValueError(f"a step record is a JSON object with keys among {sorted(names)}, got {values!r}")
        try:
            return cls(**values)
        except TypeError as e:  # a required field missing
            raise ValueError(f"a step record needs {[f.name for f in fields(cls)][:5]}: {e}") from None

    @property
    def computes(self) -> bool:
        """Whether the step ran the model (prefill or decodes), not loads alone."""
        return self.prefill_tokens > 0 or self.decodes > 0


# StepRecord's copy fields, zero where a step copied nothing
TRANSFER_FIELDS = ("loaded_tokens", "load_seconds", "storage_loaded_tokens", "storage_load_seconds",
                   "written_tokens", "write_seconds")


def _copy_fields(src: str) -> tuple[str, str]:
    """``StepRecord``'s tokens and seconds fields for a copy from tier ``src``: a write leaves the device; a load
    from the host tier is charged at ``host_bandwidth``, one from any lower tier at ``storage_bandwidth``
    (``CostModel.load_time``)."""
    if src == DEVICE:
        return "written_tokens", "write_seconds"
    return ("loaded_tokens", "load_seconds") if src == HOST else ("storage_loaded_tokens", "storage_load_seconds")


# The constants in seconds, those ``CostModel.fit`` calibrates (the others are bytes and bandwidths).
TIME_CONSTANTS = ("prefill_per_token", "attention_per_pair", "prefill_per_seq", "decode_step", "decode_per_seq",
                  "step_overhead")


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
        prefill_per_seq: seconds per prefill chunk in a step, whatever its length: the row of logits
            and the sampling each chunk pays as a decode row does, and its attention's setup.
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
    prefill_per_seq: float = 0.0
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

    @classmethod
    def load(cls, source: str | os.PathLike) -> CostModel:
        """A cost model by name or file, what a ``--cost-model`` option takes:

        * a preset's name (``COST_PRESETS``);
        * a JSON file of a dict of its constants (``asdict``, or the ``-costmodel.json`` of ``multiturn
          --calibrate``: the constants it lacks are ``CostModel()``'s);
        * a JSON file ``experiments.cost_fit`` wrote, the model under ``"cost"`` (files written before it kept
          the time constants alone under ``"fitted"``: read too).

        ``ValueError`` saying what it expected otherwise.
        """
        if isinstance(source, str) and source in COST_PRESETS:
            return COST_PRESETS[source]
        expected = (f"a cost model is a preset ({', '.join(sorted(COST_PRESETS))}), a JSON file of CostModel "
                    f"constants, or a JSON file experiments.cost_fit wrote (the model under \"cost\")")
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{expected}; {os.fspath(source)!r} is neither")
        try:
            values = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{expected}; {path} is not JSON ({e})") from None
        if isinstance(values, dict):  # a fit's file: the model under one key, beside its tables and config
            values = values.get("cost", values.get("fitted", values))
        try:
            return cls.from_dict(values)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{expected}; {path}: {e}") from None

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

    def step_time(self, prefill_tokens: int, attention_pairs: float, decodes: int, prefill_seqs: int = 0) -> float:
        """One step's seconds: its prefill chunks' tokens, pairs and count, its decode batch, the fixed overhead."""
        return (self.step_overhead + self.prefill_per_token * prefill_tokens + self.prefill_per_seq * prefill_seqs
                + self.attention_per_pair * attention_pairs + self.decode_time(decodes))

    def record_time(self, record: StepRecord) -> float:
        """A recorded step's seconds as this model predicts them, its loads included (``with_loads``); a
        record without its chunk count (an older file) is charged for one chunk where it prefilled."""
        chunks = record.prefill_seqs if record.prefill_seqs is not None else int(record.prefill_tokens > 0)
        compute = self.step_time(record.prefill_tokens, record.attention_pairs, record.decodes, chunks)
        return self.with_loads(compute, self.load_time(HOST, record.loaded_tokens)
                               + self.load_time(STORAGE, record.storage_loaded_tokens))

    @classmethod
    def fit(cls, records: Sequence[StepRecord], kv_bytes_per_token: float | None = None,
            weighting: str = "relative") -> CostModel:
        """Least-squares fit to measured steps (``LLM.step_log`` with ``record_steps=True``, a step file's).

        The time constants, from the steps that ran the model (``StepRecord.computes``): each step's seconds
        less its loads' are its compute (the simulator adds a step's loads to it, ``with_loads``), fitted with
        every constant non-negative (``_nonnegative_lstsq``), minimizing squared errors by ``weighting``:

        * ``"relative"``: errors relative to each step's seconds, so the many short decode steps count as
          much as the few long prefill ones (each step's time right to a similar fraction);
        * ``"absolute"``: errors in seconds, so a step counts by its length: the long prefill steps that
          make up most of a request's time to first token are fitted best.

        Writes down the tiers stay in the compute: the simulator charges them nothing of their own. Steps
        recorded without their chunk count (``prefill_seqs`` None: files from before it was recorded) leave
        ``prefill_per_seq`` at 0.

        The bandwidths, from every step: ``kv_bytes_per_token`` x the tokens loaded from the host tier over
        their seconds is ``host_bandwidth``, the same from the tiers below it ``storage_bandwidth``; one
        nothing was loaded from keeps ``CostModel()``'s. ``kv_bytes_per_token``: the engine's KV bytes per
        token (``KVPool.bytes_per_slot``; None: ``CostModel()``'s, SmolLM2-135M in bfloat16), kept in the model.
        """
        if weighting not in FIT_WEIGHTINGS:
            raise ValueError(f"unknown weighting {weighting!r}; choose from {FIT_WEIGHTINGS}")
        steps = [r for r in records if r.computes]
        if len(steps) < 5:
            raise ValueError(f"need at least 5 measured steps that ran the model to fit the time constants, got "
                             f"{len(steps)}")
        x = np.array([[r.prefill_tokens, r.attention_pairs, r.prefill_seqs or 0, r.decodes > 0, r.decodes, 1.0]
                      for r in steps], dtype=np.float64)
        if any(r.prefill_seqs is None for r in steps):  # an older file: its chunks were not counted
            x[:, TIME_CONSTANTS.index("prefill_per_seq")] = 0.0
        seconds = np.array([r.seconds for r in steps], dtype=np.float64)
        loads = np.array([r.load_seconds + r.storage_load_seconds for r in steps], dtype=np.float64)
        # Relative errors (1 / seconds): else a few long prefill steps outweigh a hundred decode steps.
        weight = 1.0 / np.maximum(seconds, 1e-9) if weighting == "relative" else np.ones_like(seconds)
        coef = _nonnegative_lstsq(x * weight[:, None], (seconds - loads) * weight)
        kv = cls().kv_bytes_per_token if kv_bytes_per_token is None else float(kv_bytes_per_token)
        bandwidths = {}
        for name, tokens, secs in (("host_bandwidth", "loaded_tokens", "load_seconds"),
                                   ("storage_bandwidth", "storage_loaded_tokens", "storage_load_seconds")):
            n, t = sum(getattr(r, tokens) for r in records), sum(getattr(r, secs) for r in records)
            if n > 0 and t > 0:
                bandwidths[name] = kv * n / t
        return cls(**{name: float(v) for name, v in zip(TIME_CONSTANTS, coef, strict=True)},  # x's columns
                   kv_bytes_per_token=kv, **bandwidths)


FIT_WEIGHTINGS = ("relative", "absolute")  # CostModel.fit's ways to weigh a step's error


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The non-negative ``c`` minimizing ``|x c - y|^2``, exactly: every subset of the columns is solved by
    least squares with the others fixed at zero, and the best one whose solution is non-negative is kept.
    O(2^columns x rows x columns^2): for the six constants, 63 small solves."""
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns differ by 10^6: solve on normalized ones
    best, coef = np.inf, np.zeros(x.shape[1])
    for mask in range(1, 2 ** x.shape[1]):
        cols = [c for c in range(x.shape[1]) if mask >> c & 1]
        sol, *_ = np.linalg.lstsq(x[:, cols] / scale[cols], y, rcond=None)
        if (sol < 0).any():
            continue
        err = float(np.sum((x[:, cols] @ (sol / scale[cols]) - y) ** 2))
        if err < best:
            best, coef = err, np.zeros(x.shape[1])
            coef[cols] = sol / scale[cols]
    return coef


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
# B200 (HGX, 1,000 W) 2,250 dense bf16 TFLOPS, 8 TB/s HBM3e; all PCIe Gen5 x16 to the host (about 50 GB/s
# achieved of 64), summed over the node's GPUs. Storage: one 400 Gb/s RDMA link (50 GB/s), the order of
# Mooncake store's per-node transfer engine. The engine's CPU preset is ``CostModel()``. The memory each node
# has for KV is ``radixkv.gpu_memory.NODE_MEMORY``'s.
COST_PRESETS: dict[str, CostModel] = {
    "cpu-smollm2-135m": CostModel(),
    "llama3-8b-h100": _gpu_preset(8.0e9, 32, 4096, 8, 1, 989, 3.35, 50, 50),
    "llama3-8b-h200": _gpu_preset(8.0e9, 32, 4096, 8, 1, 989, 4.8, 50, 50),
    "llama3-70b-8xh100": _gpu_preset(70.6e9, 80, 8192, 8, 8, 989, 3.35, 50, 50),
    "llama3-70b-8xh200": _gpu_preset(70.6e9, 80, 8192, 8, 8, 989, 4.8, 50, 50),
    "llama3-70b-8xb200": _gpu_preset(70.6e9, 80, 8192, 8, 8, 2250, 8.0, 50, 50),
}
# Where loads matter: the 8xH100 node with its host tier behind one GPU's PCIe link (50 GB/s, not summed over
# 8: a host pool that one NUMA node's root complex serves) and a storage tier of local NVMe (10 GB/s).
COST_PRESETS["llama3-70b-8xh100-pcie"] = replace(COST_PRESETS["llama3-70b-8xh100"], host_bandwidth=50e9,
                                                 storage_bandwidth=10e9)
