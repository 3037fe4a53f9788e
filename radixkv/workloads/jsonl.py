"""Reading a trace of one JSON object per line, strictly: what every trace reader shares (Mooncake's,
the agentic sessions'). A bad line is a ``ValueError`` naming the file and line; nothing is skipped but
blank lines."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from radixkv.checks import is_int


def read_records(path: str | Path, parse: Callable[[dict, str], dict], *, what: str, readme: str,
                 required: Sequence[str], limit: int | None = None) -> list[dict]:
    """Every line of ``path`` as ``parse(row, where)`` (``where`` is ``file:line``, for its errors), at most
    ``limit`` of them. ``FileNotFoundError`` for a missing file (naming ``readme``); ``ValueError`` for a file
    with no records and for a line that is not UTF-8, not a JSON object, or lacks a ``required`` field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found at {path} (see {readme})")
    rows: list[dict] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text") from None
            if line.strip():
                rows.append(parse(_json_object(line, where, required), where))
                if limit is not None and len(rows) >= limit:
                    break
    if not rows:
        raise ValueError(f"{what} {path} has no records")
    return rows


def _json_object(line: str, where: str, required: Sequence[str]) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON line ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    missing = [k for k in required if k not in row]
    if missing:
        raise ValueError(f"{where}: record has no {', '.join(missing)}")
    return row


def integer(x: object) -> int | None:
    """``x`` as an int where it is one (or an integral float), else None."""
    return int(x) if is_int(x) or (isinstance(x, float) and x.is_integer()) else None
