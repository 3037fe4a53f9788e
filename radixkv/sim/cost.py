"""What the simulator's clock is made of: ``CostModel`` (seconds per engine step from a few constants) and
``StepRecord`` (what one measured engine step computed and took, the data ``CostModel.fit`` calibrates from;
``LLM(record_steps=True)`` keeps them in ``LLM.step_log``). Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

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
    """

    prefill_per_token: float = 3.5e-4
    attention_per_pair: float = 2.0e-8
    decode_step: float = 0.013
    decode_per_seq: float = 0.002
    step_overhead: float = 0.0005

    def __post_init__(self) -> None:
        bad = {k: v for k, v in asdict(self).items() if not (is_real(v) and v >= 0)}
        if bad:
            raise ValueError(f"CostModel constants must be finite numbers >= 0 (seconds), got {bad}")

    @classmethod
    def from_dict(cls, values: object) -> CostModel:
        """A cost model from a dict of its constants (as ``--calibrate`` writes them); ``ValueError`` otherwise."""
        names = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - names:
            raise ValueError(f"a cost model is a JSON object with keys among {sorted(names)}, got {values!r}")
        return cls(**values)

    def prefill_time(self, new_tokens: int, prefix_len: int) -> float:
        return self.prefill_per_token * new_tokens + self.attention_per_pair * causal_pairs(new_tokens, prefix_len)

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
        c = [float(v) for v in coef]
        return cls(prefill_per_token=c[0], attention_per_pair=c[1], decode_step=c[2], decode_per_seq=c[3],
                   step_overhead=c[4])
