"""Token sampling: greedy, temperature, top-k, top-p, with a generator per request for reproducibility."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures below this sample the argmax, their limit: a tinier one overflows float32


@dataclass(frozen=True)
class SamplingSpec:
    """How one request samples. ``temperature < GREEDY_BELOW`` is greedy; ``top_k <= 0`` and ``top_p == 1`` are
    off."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def seeded_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator for one request (None: the global RNG)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, specs: Sequence[SamplingSpec], generators: Sequence[torch.Generator | None],
           errors: list | None = None) -> torch.Tensor:
    """One token per row. logits: ``[batch, vocab]``; returns ``[batch]`` int64.

    Filters apply in the usual order: temperature, then top-k, then top-p
    (the smallest set of tokens whose probability reaches ``top_p``; the most
    likely token always stays). With ``errors`` (a list, one slot per row), a
    row that fails records its exception there and gets token 0 while the
    other rows are sampled as ever; without it the exception propagates.
    """
    out = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    for i, (spec, gen) in enumerate(zip(specs, generators, strict=True)):
        try:
            out[i] = _sample_row(logits[i], spec, gen)
        except Exception as e:
            if errors is None:
                raise
            errors[i] = e
    return out


def _sample_row(row: torch.Tensor, spec: SamplingSpec, gen: torch.Generator | None) -> torch.Tensor:
    """One row's token (a 0-d tensor). row: ``[vocab]``."""
    row = row.float()
    if spec.temperature < GREEDY_BELOW:
        return row.argmax()
    row = (row - row.max()) / spec.temperature  # shifted first: a tiny temperature gives -inf, never inf - inf
    if 0 < spec.top_k < row.numel():
        kth = torch.topk(row, spec.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if spec.top_p < 1:
        sorted_logits, order = row.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= spec.top_p  # tokens after the set reached top_p
        drop[0] = False  # the most likely token stays, even where top_p rounds to 0 in float32
        row = row.scatter(0, order[drop], float("-inf"))
    return torch.multinomial(row.softmax(-1), 1, generator=gen)[0]
