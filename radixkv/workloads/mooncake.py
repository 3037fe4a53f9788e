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

from pathlib import Path

import numpy as np

from radixkv.checks import is_int, is_real
from radixkv.workloads.jsonl import integer, read_records
from radixkv.workloads.request import Request

TRACE_BLOCK = 512
MAX_LENGTH = 1 << 24  # tokens: past any model's context, and small enough that a replay's arrays fit in memory
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MAX_HASH_ID = 1 << 54  # block ids b * 512 + 511 must fit in int64 (and stay clear of the outputs' negative ids)


def read_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    """The trace's records (dicts), at most ``limit`` of them, each checked as it is read.

    A missing file is a ``FileNotFoundError``; a ``limit`` below 1, a trace
    with no records, and any line that is not a valid record are
    ``ValueError``s, a line's naming the file and line: not UTF-8 or not a
    JSON object, one of the four fields missing, ``input_length`` not an
    integer in [1, 2^24], ``output_length`` not in [0, 2^24], ``timestamp``
    not a finite number, ``hash_ids`` not one integer in [0, 2^54) per
    512-token block. Integral floats (``700.0``) are read as integers.
    """
    if limit is not None and (not is_int(limit) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1 or None, got {limit!r}")
    return read_records(path, _record, what="Mooncake trace", readme="shared/traces/README.md", required=FIELDS,
                        limit=limit)


def _record(row: dict, where: str) -> dict:
    """One trace line's object as a checked record, lengths as ints; ``where`` (file:line) goes into every
    error."""
    n, out, ts, ids = integer(row["input_length"]), integer(row["output_length"]), row["timestamp"], row["hash_ids"]
    if n is None or not 1 <= n <= MAX_LENGTH:
        raise ValueError(f"{where}: input_length must be an integer in [1, {MAX_LENGTH}], got {row['input_length']!r}")
    if out is None or not 0 <= out <= MAX_LENGTH:
        raise ValueError(f"{where}: output_length must be an integer in [0, {MAX_LENGTH}], "
                         f"got {row['output_length']!r}")
    if not is_real(ts):
        raise ValueError(f"{where}: timestamp must be a finite number, got {ts!r}")
    if not isinstance(ids, list) or not all(integer(b) is not None and 0 <= b < MAX_HASH_ID for b in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers in [0, 2^54)")
    if len(ids) != -(-n // TRACE_BLOCK):
        raise ValueError(f"{where}: {len(ids)} hash ids do not cover input_length {n} in blocks of {TRACE_BLOCK}")
    return {**row, "input_length": n, "output_length": out, "hash_ids": [int(b) for b in ids]}


def block_tokens(hash_ids: list[int], input_length: int, block: int = TRACE_BLOCK) -> np.ndarray:
    """The token ids of a prompt made of ``hash_ids`` blocks, cut to ``input_length`` (int64)."""
    if len(hash_ids) != -(-input_length // block):
        raise ValueError(f"{len(hash_ids)} hash ids do not cover input_length {input_length} in blocks of {block}")
    ids = np.asarray(hash_ids, dtype=np.int64)
    return (ids[:, None] * block + np.arange(block, dtype=np.int64)).ravel()[:input_length]


def mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Mooncake trace as requests: arrival from ``timestamp``, prompt from ``hash_ids``."""
    return trace_requests(read_trace(path, limit))


def trace_requests(rows: list[dict]) -> list[Request]:
    """``read_trace``'s records as requests (for callers that also need the records, e.g. ``trace_upper_bound``)."""
    requests = []
    next_output_id = -1
    for i, row in enumerate(rows):
        out_len = max(int(row["output_length"]), 1)
        output = np.arange(next_output_id, next_output_id - out_len, -1, dtype=np.int64)
        next_output_id -= out_len
        requests.append(Request(arrival=row["timestamp"] / 1000.0, session=None,
                                prompt=block_tokens(row["hash_ids"], int(row["input_length"])), output_len=out_len,
                                output=output, rid=i, meta={"hash_ids": row["hash_ids"]}))
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
