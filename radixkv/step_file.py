"""The step file: an engine's ``StepRecord``s as JSON lines, what ``radixkv serve --record-steps PATH`` writes
(``StepWriter``) and ``python -m experiments.cost_fit --steps PATH`` fits ``CostModel.fit`` to (``read_steps``).

The first line is the header::

    {"format": "radixkv-steps/1", "kv_bytes_per_token": 23040, "config": {...}, "started": "2026-01-01T12:00:00"}

``kv_bytes_per_token`` is the engine's KV layout (``KVPool.bytes_per_slot``: 2 x layers x KV heads x head_dim x
the dtype's bytes), what the fit turns load seconds into bandwidths with; ``config`` is ``EngineConfig.to_dict()``.
Every later line is one step, ``StepRecord``'s fields as keys. Each write is flushed at once, so a server killed
part way leaves every step it finished; a last line cut short by the kill is skipped on reading. Torch-free.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from radixkv.cost import StepRecord

FORMAT = "radixkv-steps/1"


@dataclass(frozen=True)
class StepFile:
    """A step file read back: its ``header`` (a dict, see the module docstring) and its ``records``, in order."""

    header: dict[str, Any]
    records: list[StepRecord]

    @property
    def kv_bytes_per_token(self) -> float:
        return float(self.header["kv_bytes_per_token"])


class StepWriter:
    """Writes a step file at ``path`` (replacing one there): the header at once, then each ``write``'s records,
    flushed at the end of the call (``OSError`` where the file cannot be written)."""

    def __init__(self, path: str | os.PathLike, kv_bytes_per_token: float, config: dict[str, Any]):
        self.path = Path(path)
        self._file = self.path.open("w", encoding="utf-8")
        header = {"format": FORMAT, "kv_bytes_per_token": kv_bytes_per_token, "config": config,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self._lines([header])

    def write(self, records: Sequence[StepRecord]) -> None:
        """Append ``records``, one line each, and flush them (one system call for the lot)."""
        if records:
            self._lines([asdict(r) for r in records])

    def _lines(self, rows: list[dict[str, Any]]) -> None:
        self._file.write("".join(json.dumps(row) + "\n" for row in rows))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_steps(path: str | os.PathLike) -> StepFile:
    """A step file's header and records. ``ValueError`` for a file that is not one (no header, a line that is
    not a ``StepRecord``), naming the line; a last line cut short (a server killed mid-write) is dropped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    rows: list[Any] = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # cut short by a kill: the steps before it stand
                break
            raise ValueError(f"{path}:{number}: not JSON ({e})") from None
    if not rows or not isinstance(rows[0], dict) or rows[0].get("format") != FORMAT:
        raise ValueError(f"{path}: not a step file (its first line must be a header with \"format\": {FORMAT!r}, "
                         "as radixkv serve --record-steps writes)")
    records = []
    for number, row in enumerate(rows[1:], 2):
        try:
            records.append(StepRecord.from_dict(row))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: {e}") from None
    return StepFile(rows[0], records)
