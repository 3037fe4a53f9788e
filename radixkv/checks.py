"""Value checks shared by the validated settings (``EngineConfig``, ``SamplingParams``, ``CostModel``,
``Request``, the trace reader): what counts as an integer and as a finite real number."""

from __future__ import annotations

import math
from numbers import Integral, Real


def is_int(x: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A finite real number (not a bool); an int too large for a float is not one."""
    if not isinstance(x, Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
