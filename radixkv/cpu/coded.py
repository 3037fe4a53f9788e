"""Exact 4-bit codes for 16-bit weights that were dequantized from a GGUF Q4_1 file.

A decode step at batch 1 streams every linear weight once and waits on
memory for most of it (about 270 MB of bfloat16 for SmolLM2-135M). The only
local copy of SmolLM2 here is a Q4_1 GGUF file, whose loader computes each
weight as ``T(float32(d * q) + m)``: a 4-bit code ``q`` and a float16 scale
``d`` and offset ``m`` per 32 inputs of an output row, rounded to the
model's dtype ``T``. Those 0.625 bytes per weight describe the 16-bit
weight exactly, so the ``coded_linear`` kernel (``cpu_kernels.cpp``) reads
them instead of the 2 bytes, rebuilds each weight in a register and
multiplies it as ``small_linear`` multiplies the stored one: the same
outputs, bit for bit, from a third of the bytes.

Nothing is approximated. ``Q4Rows.tiles`` rebuilds every weight of a layer
from the codes it found and returns None unless all of them equal the
layer's weights bit for bit, so a layer whose weights did not come from the
file (another checkpoint, weights changed after loading) keeps its 16-bit
tiles only. Rows are found by their values, not by tensor names, so the
loader's renaming, q/k row permutation and q/k/v stacking need no mirror
here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixkv.model.gguf import gguf_tensor_table

BLOCK = 32  # inputs per scale and offset in Q4_1
_Q4_1_BYTES = 20  # per block: float16 d, float16 m, 16 bytes of two 4-bit codes each
_Q4_1 = 3  # GGML's type id


@dataclass(frozen=True)
class CodedTiles:
    """One linear layer's weights as ``coded_linear`` reads them (8 output rows per tile).

    ``codes`` ``[out / 8, in / 2, 8]`` uint8 (byte ``[t, p, c]``: row ``8t + c``'s
    codes for inputs ``2p`` in the low nibble and ``2p + 1`` in the high one);
    ``scale`` and ``offset`` ``[out / 8, in / 32, 8]`` float16 (that row's ``d``
    and ``m`` for inputs ``32b .. 32b + 31``).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))


def q4_1_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every Q4_1 tensor of a GGUF file by name, as its blocks ``[rows, in / 32, 20]`` uint8 (a read-only map).

    Reads the file's header and tensor table only (``gguf_tensor_table``, milliseconds).
    """
    out = {}
    for t in gguf_tensor_table(path).tensors:
        if t.kind == _Q4_1:
            rows = int(np.prod(t.dims[1:], dtype=np.int64))
            out[t.name] = np.memmap(path, np.uint8, "r", t.offset, (rows, t.dims[0] // BLOCK, _Q4_1_BYTES))
    return out


def _unrounded(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``float32(d * q) + m`` ``[rows, k]``, as ``gguf``'s Q4_1 dequantization computes it (each step rounded)."""
    rows, k = codes.shape
    q = codes.to(torch.float32).view(rows, k // BLOCK, BLOCK)  # each block's 32 codes against its d and m
    return (q * d.to(torch.float32)[..., None] + m.to(torch.float32)[..., None]).view(rows, k)


def dequantize(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weights ``[rows, k]`` in ``dtype`` from codes ``[rows, k]`` and ``d``, ``m`` ``[rows, k / 32]``.

    As ``gguf``'s Q4_1 dequantization (which ``transformers`` loads through)
    and then the cast to ``dtype``.
    """
    return _unrounded(codes, d, m).to(dtype)


def rebuilds_exactly(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``coded_linear`` rebuilds ``weight`` ``[rows, k]`` from these codes bit for bit.

    ``dequantize`` must give ``weight``'s bits, and no unrounded value may be
    one the kernel's bfloat16 rounding does not handle as the cast does: -0
    (it gives +0), a float32 subnormal or one of 2^100 or more. With float16
    ``d`` and ``m`` only -0 can occur (a negative ``d`` with ``q = 0`` and
    ``m = -0``), and never in files that ``gguf`` writes; checked anyway.
    """
    raw = _unrounded(codes, d, m)
    if weight.dtype == torch.bfloat16:
        size = raw.abs()
        negative_zero = torch.signbit(raw) & (raw == 0)
        if bool((negative_zero | ((size > 0) & (size < torch.finfo(torch.float32).tiny)) | (size >= 2.0**100)).any()):
            return False
    return torch.equal(raw.to(weight.dtype).view(torch.int16), weight.view(torch.int16))


def _fingerprints(values: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint ``[rows]`` of the bit pattern of each row's first 64 values (16-bit ``[rows, k]``).

    The first 64 are enough to tell real weight rows apart, and a clash costs no
    exactness: ``Q4Rows.tiles`` compares every weight it rebuilds.
    """
    head = values[:, :64].view(torch.int16).to(torch.int64)
    gen = torch.Generator().manual_seed(head.shape[1])
    mult = torch.randint(-(2**62), 2**62, (head.shape[1],), dtype=torch.int64, generator=gen)
    return (head * mult).sum(dim=1)  # wraps modulo 2^64, which is fine for a hash


def _decode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 ``blocks`` ``[rows, k / 32, 20]`` uint8 as (codes ``[rows, k]`` uint8, d, m ``[rows, k / 32]`` float16)."""
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    packed = blocks[..., 4:]  # byte j: element j in the low nibble, element j + 16 in the high one
    return torch.cat([packed & 0xF, packed >> 4], dim=2).flatten(1), d, m


class Q4Rows:
    """Every output row of a GGUF file's Q4_1 tensors, found by its dequantized values in ``dtype``.

    Building reads the file's Q4_1 blocks (0.625 bytes a weight, kept) and
    dequantizes the first 64 inputs of each row: O(rows). ``tiles`` is
    O(weights of the layer).
    """

    def __init__(self, path: str | Path, dtype: torch.dtype):
        self.dtype = dtype
        by_width: dict[int, list[torch.Tensor]] = {}
        for blocks in q4_1_tensors(path).values():
            by_width.setdefault(blocks.shape[1] * BLOCK, []).append(torch.from_numpy(np.array(blocks)))
        self._blocks = {k: torch.cat(parts) for k, parts in by_width.items()}  # k -> [rows, k / 32, 20]
        self._where: dict[int, dict[int, int]] = {}  # k -> fingerprint -> row of _blocks[k]
        for k, blocks in self._blocks.items():
            head = dequantize(*_decode(blocks[:, :2]), dtype)  # the first 64 inputs (all, where k is 32)
            where = self._where[k] = {}
            for row, fp in enumerate(_fingerprints(head).tolist()):
                where.setdefault(fp, row)

    def __len__(self) -> int:
        """How many distinct rows the file holds."""
        return sum(len(w) for w in self._where.values())

    def tiles(self, weight: torch.Tensor) -> CodedTiles | None:
        """``weight`` ``[out, in]`` (in ``dtype``) as ``CodedTiles``, or None unless every row is found and
        rebuilds to the same bits (also None where ``out % 8`` or ``in % 32`` is not 0)."""
        n, k = weight.shape
        where = self._where.get(k)
        if where is None or weight.dtype != self.dtype or n % 8:
            return None
        rows = [where.get(fp) for fp in _fingerprints(weight.contiguous()).tolist()]
        if None in rows:
            return None
        codes, d, m = _decode(self._blocks[k][torch.tensor(rows)])
        if not rebuilds_exactly(codes, d, m, weight):
            return None

        def tiled(x: torch.Tensor) -> torch.Tensor:  # [out, j] -> [out / 8, j, 8]
            return x.reshape(n // 8, 8, -1).transpose(1, 2).contiguous()

        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [out, in / 2]
        return CodedTiles(tiled(pairs), tiled(d), tiled(m))


@functools.lru_cache(maxsize=1)
def _rows(path: str, size: int, mtime_ns: int, dtype: torch.dtype) -> Q4Rows:
    return Q4Rows(path, dtype)


def q4_rows(path: str | Path, dtype: torch.dtype) -> Q4Rows:
    """``Q4Rows`` of a GGUF file, kept for the last file and dtype asked for (size and mtime key it)."""
    file = Path(path).resolve()
    stat = file.stat()
    return _rows(str(file), stat.st_size, stat.st_mtime_ns, dtype)
