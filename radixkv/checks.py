"""Value checks shared by the validated settings (``EngineConfig``, ``SamplingParams``, ``CostModel``,
``Request``, the trace reader): what counts as an integer and as a finite real number."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any


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


def checked_number(value: object, name: str, low: float = 0.0, integer: bool = False) -> Any:
    """``value`` if it is a finite number (an int where ``integer``) at least ``low``; else ``ValueError`` naming
    ``name``. A bool is not a number here."""
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be {'an int' if integer else 'a number'} >= {low}, got {value!r}")
    return value
