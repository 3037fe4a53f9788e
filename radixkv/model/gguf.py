"""GGUF files: their header, metadata and tensor table in milliseconds.

* ``gguf_tensor_table(path)``: the header and tensor table of a GGUF file (names,
  shapes, ggml types, where each tensor's bytes start) and its metadata, read through a
  memory map, arrays decoded only when asked for (``gguf.GGUFReader`` builds every
  field's parts, seconds for SmolLM2's 49,152-entry vocabulary). The loader's dtype,
  the converter (``radixkv.model.gguf_llama``) and the CPU kernels' 4-bit codes
  (``radixkv.cpu.coded``) read it.

Converting a file into a checkpoint kept on disk: ``radixkv.model.converted``.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ggml tensor types by id, those the loader names (the rest are other quantizations)
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 30: "BF16"}
# GGUF metadata value types by id: struct format of a scalar; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: ``dims`` as the file stores them (innermost first), the ggml type id,
    and the offset of its bytes from the file's start."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


@dataclass(frozen=True)
class GGUFTable:
    """A GGUF file's metadata (arrays None where skipped) and its tensor table."""

    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]


def gguf_tensor_table(path: str | Path, arrays: bool = False) -> GGUFTable:
    """The header and tensor table of a GGUF file (version 2 or 3, little-endian); ``ValueError`` otherwise.

    Reads through a memory map, skipping arrays (their values are None in ``metadata``) unless ``arrays``
    (then lists of strings, numpy arrays of numbers): 0.02 s for SmolLM2 skipping its 98,000 token and
    merge strings, 0.1 s reading them. Kept for the last 8 file versions.
    """
    file = Path(path).resolve()
    stat = file.stat()
    if stat.st_size < 24:  # not even a header (and an empty file cannot be mapped)
        raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3 ({stat.st_size} bytes)")
    return _table(str(file), stat.st_size, stat.st_mtime_ns, arrays)


@functools.lru_cache(maxsize=8)
def _table(path: str, size: int, mtime_ns: int, arrays: bool) -> GGUFTable:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            out = struct.unpack_from("<" + fmt, data, pos)
            pos += struct.calcsize("<" + fmt)
            return out[0] if len(out) == 1 else out

        def text() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return data[pos - n:pos].decode("utf-8", "replace")

        def value(kind: int):
            nonlocal pos
            if kind == 8:
                return text()
            if kind == 9:  # an array: skipped (numbers whole, strings by their lengths) unless asked for
                inner, count = take("IQ")
                if inner in _SCALARS:
                    fmt = "<" + _SCALARS[inner]
                    start, pos = pos, pos + count * struct.calcsize(fmt)
                    return np.frombuffer(data, fmt, count, start).copy() if arrays else None
                if arrays:
                    return [value(inner) for _ in range(count)]
                for _ in range(count):
                    skip(inner)
                return None
            return take(_SCALARS[kind])

        def skip(kind: int) -> None:
            nonlocal pos
            if kind == 8:
                pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            else:
                value(kind)

        try:
            magic, version, count, fields = take("4sIQQ")
        except struct.error:
            magic, version = b"", 0
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
        metadata = {}
        for _ in range(fields):
            key = text()
            metadata[key] = value(take("I"))
        table = []
        for _ in range(count):
            name = text()
            dims = take("Q" * take("I"))
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            kind, offset = take("IQ")
            table.append((name, dims, kind, offset))
        alignment = int(metadata.get("general.alignment") or 32)
        start = -(-pos // alignment) * alignment
    return GGUFTable(metadata, tuple(GGUFTensor(n, d, k, start + o) for n, d, k, o in table))


__all__ = ["GGML_TYPE_NAMES", "GGUFTable", "GGUFTensor", "gguf_tensor_table"]
