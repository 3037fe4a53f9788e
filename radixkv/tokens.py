"""Token ids and slot indices as the caches and the allocator take them: ``TokenSeq`` and ``as_token_array``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

TokenSeq = Sequence[int] | np.ndarray | Any


def as_token_array(tokens: TokenSeq) -> np.ndarray:
    """Token ids (or slot indices) as a 1-D int64 numpy array.

    Never modifies the caller's object; may return it unchanged when it already
    is a contiguous 1-D int64 numpy array (callers copy what they keep).
    O(n), and O(n) Python work only for lists and tuples.
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)  # an ndarray as it is, no copy
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of integer ids, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"expected integer ids, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    return np.ascontiguousarray(arr)
