"""Replay of Mooncake's public request traces (Qin et al., FAST'25).

Each trace line has ``timestamp`` (ms), ``input_length``, ``output_length``
and ``hash_ids``: one id per 512-token block of the prompt, where an id names
its whole prefix. The replay turns block id ``b`` into the 512 token ids
``b * 512 + [0, 512)``, so two prompts share exactly the blocks whose ids they
share; the last block is cut to ``input_length`` (it is usually partial). A
prompt is therefore ``input_length`` real tokens and every figure computed
from the replay is in real tokens. Output tokens are fresh negative ids, so no
prompt ever hits them (Mooncake's trace records no reuse of outputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from radixkv.workloads.request import Request

TRACE_BLOCK = 512


def read_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    """The trace's records (dicts), at most ``limit`` of them. A missing file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Mooncake trace not found at {path} (see shared/traces/README.md)")
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def block_tokens(hash_ids: list[int], input_length: int, block: int = TRACE_BLOCK) -> np.ndarray:
    """The token ids of a prompt made of ``hash_ids`` blocks, cut to ``input_length`` (int64)."""
    if len(hash_ids) != -(-input_length // block):
        raise ValueError(f"{len(hash_ids)} hash ids do not cover input_length {input_length} in blocks of {block}")
    ids = np.asarray(hash_ids, dtype=np.int64)
    return (ids[:, None] * block + np.arange(block, dtype=np.int64)).ravel()[:input_length]


def mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Mooncake trace as requests: arrival from ``timestamp``, prompt from ``hash_ids``."""
    requests = []
    next_output_id = -1
    for i, row in enumerate(read_trace(path, limit)):
        out_len = max(int(row["output_length"]), 1)
        output = np.arange(next_output_id, next_output_id - out_len, -1, dtype=np.int64)
        next_output_id -= out_len
        requests.append(Request(
            arrival=row["timestamp"] / 1000.0, session=None,
            prompt=block_tokens(row["hash_ids"], int(row["input_length"])),
            output_len=out_len, output=output, rid=i, meta={"hash_ids": row["hash_ids"]},
        ))
    return requests


def trace_upper_bound(rows: list[dict], block: int = TRACE_BLOCK) -> dict[str, float]:
    """The trace's own unlimited-cache hit bound, straight from ``hash_ids``.

    Requests are taken in trace order; a block hits as far as an earlier
    request held it (whole, or a partial last block's leading tokens), the
    match stops at the first block that was not (fully enough) held, and a
    request always computes at least its last token.
    """
    held: dict[int, int] = {}  # block id -> tokens of it cached so far
    hit = total = 0
    for row in rows:
        n, ids = int(row["input_length"]), row["hash_ids"]
        h = 0
        for j, b in enumerate(ids):
            need = min(block, n - j * block)
            got = held.get(b, 0)
            h += min(need, got)
            if got < need:
                break
        hit += min(h, n - 1)
        total += n
        for j, b in enumerate(ids):
            held[b] = max(held.get(b, 0), min(block, n - j * block))
    return {"prompt_tokens": total, "hit_tokens": hit, "hit_rate": hit / total if total else 0.0}
