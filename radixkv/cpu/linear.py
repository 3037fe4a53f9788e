"""16-bit linear layers as a CPU serves them fastest: oneDNN's packed layout, decode-sized tiles, exact 4-bit codes.

``pack_linears`` replaces a model's ``nn.Linear`` modules by ``PackedLinear``
ones in place (the same outputs up to the rounding of a 16-bit GEMM that
accumulates in float32); ``radixkv.cpu.accelerate`` calls it for a 16-bit
model on a CPU.
"""

from __future__ import annotations

import functools
import struct
from types import ModuleType
from typing import Any

import torch
from torch import nn

import radixkv.cpu.hugepages as hugepages
from radixkv.cpu.capabilities import CpuCapabilities, cpu_capabilities
from radixkv.cpu.coded import CodedTiles, q4_rows
from radixkv.cpu.kernels import cpu_kernels_unavailable_reason, load_cpu_kernels
from radixkv.timing import interleaved

SMALL_DTYPES = (torch.bfloat16, torch.float16)  # the weight dtypes small_linear's tiles hold
# small_linear's row block (the kernels' kRowBlock): each row of a whole block sums in one fixed order, however
# many blocks there are; the rows past the last whole block take other kernels (other bits). Batch-invariant
# layers pad every call to whole blocks.
ROW_BLOCK = 4


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered into its blocked CPU layout once, at load time.

    The blocked layout multiplies decode-sized batches faster than the plain
    one, with bit-identical outputs. With ``compute_dtype=torch.float32`` a
    16-bit layer keeps its 16-bit interface but multiplies in float32: the
    weight is upcast once (exactly) and each call computes
    ``round16(float32(x) @ W.T + b)``, the arithmetic of a 16-bit GEMM that
    accumulates in float32, for CPUs without 16-bit matrix instructions,
    where oneDNN and MKL emulate 16-bit GEMMs several times slower than
    float32 ones.
    Decode batches (at most ``small_rows`` tokens) of a 16-bit layer go
    through ``small_kernels.small_linear`` instead when given (the compiled
    AVX2 kernel reading the 16-bit weights, repacked into ``tiles``
    ``[out / 8, in, 8]``, accumulating in float32), whichever dtype oneDNN
    multiplies larger batches in: where it upcasts, a float32 copy would
    double what each decode step streams and its float32 GEMM is far from
    peak at 1-8 rows; where it multiplies bfloat16 natively, its GEMM is
    slower still at decode sizes than these tiles (docs/experiments.md).
    Where the weights were dequantized from a GGUF Q4_1 file, ``coded``
    holds their exact 4-bit codes (``radixkv.cpu.coded``, set by
    ``pack_linears``), which ``small_kernels.coded_linear`` multiplies for
    batches of at most ``coded_rows`` tokens: the same outputs, bit for bit,
    from 0.625 bytes a weight instead of 2.
    The packed weight is opaque: it cannot be moved, cast or saved, so
    packing is the last step before serving (``pack_linears``).

    Those kernel choices depend on the row count, so a row's output bits
    depend on how many rows share the call (oneDNN's own GEMM splits its
    reduction by batch size too, at some shapes). ``batch_invariant=True``
    makes them the row's alone (SGLang's deterministic inference, vLLM's
    batch invariance): every call of a layer with tiles goes through
    ``small_linear`` padded with zero rows to whole ``ROW_BLOCK``s, each row
    one reduction order whatever shares its block; a layer without tiles
    multiplies row by row. It needs the tiles' kernels (``pack_linears``
    checks). Cost on a Zen 4 (AVX-512 BF16): decode-sized calls as fast as
    the default, 1,024-row calls 0-20% slower than oneDNN's GEMM.
    """

    # The most rows coded_linear may serve: rebuilding each weight from its code costs vector ALU
    # throughput that more rows need for their own FMAs, so past 2 rows the 16-bit tiles win on the CPUs
    # measured (docs/experiments.md), and on some (a Zen 1) even 1 row does not pay: ``pack_linears``
    # measures how many of these rows pay on the CPU at hand (``measure_coded_rows``).
    CODED_ROWS = 2

    def __init__(self, linear: nn.Linear, batch_hint: int = 8, compute_dtype: torch.dtype | None = None,
                 small_kernels: ModuleType | None = None, small_rows: int = 16, batch_invariant: bool = False):
        super().__init__()
        self.batch_invariant = batch_invariant
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.compute_dtype = compute_dtype or self.dtype
        if self.compute_dtype != cpu_capabilities().compute_dtype(self.compute_dtype):
            raise ValueError(f"oneDNN cannot multiply {self.compute_dtype} natively on this CPU "
                             f"({cpu_capabilities().isa}): ask cpu_capabilities().compute_dtype for the dtype")
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute_dtype), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.compute_dtype)
        self.small_kernels, self.small_rows, self.tiles, self.small_bias = None, small_rows, None, None
        self.coded: CodedTiles | None = None
        self.coded_rows = self.CODED_ROWS
        if small_kernels is not None and self.dtype in SMALL_DTYPES and self.out_features % 8 == 0:
            self.small_kernels = small_kernels
            self.small_bias = None if linear.bias is None else linear.bias.detach().float()
            n, k = weight.shape
            self.tiles = weight.view(n // 8, 8, k).transpose(1, 2).contiguous()  # [out / 8, in, 8]

    def weight(self) -> torch.Tensor | None:
        """The 16-bit weight ``[out, in]`` rebuilt from ``tiles`` (None without tiles)."""
        return None if self.tiles is None else self.tiles.transpose(1, 2).reshape(self.out_features, -1)

    def small_linear_args(self) -> dict[str, Any]:
        """Keyword arguments of the kernels' ``TiledLinear`` for this layer (it must have tiles)."""
        c = self.coded
        return {"tiles": self.tiles, "bias": self.small_bias, "codes": c and c.codes, "scale": c and c.scale,
                "offset": c and c.offset, "coded_rows": self.coded_rows}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features], both in the layer's dtype
        if self.batch_invariant:
            return self._invariant(x)
        if self.small_kernels is not None and x.shape[0] <= self.small_rows:
            if self.coded is not None and x.shape[0] <= self.coded_rows:
                c = self.coded
                return self.small_kernels.coded_linear(x, c.codes, c.scale, c.offset, self.small_bias)
            return self.small_kernels.small_linear(x, self.tiles, self.small_bias)
        return self._onednn(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype), self.packed, self.bias, "none", [], "")
        return y.to(self.dtype)

    def _invariant(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's output independent of the other rows of ``x`` (``batch_invariant``)."""
        rows = x.shape[0]
        if self.tiles is None:
            return torch.cat([self._onednn(x[i : i + 1]) for i in range(rows)]) if rows else self._onednn(x)
        pad = -rows % ROW_BLOCK
        if pad:  # x: [rows + pad, in_features], zero rows completing the last block
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return self.small_kernels.small_linear(x.contiguous(), self.tiles, self.small_bias)[:rows]


def linear_compute_dtype(model: nn.Module, caps: CpuCapabilities | None = None) -> torch.dtype | None:
    """The dtype ``pack_linears`` multiplies ``model``'s weights in on this CPU, or None where it leaves them.

    16-bit weights multiply in their own dtype where oneDNN does so natively
    (``CpuCapabilities.compute_dtype``: AVX-512 BF16 / FP16, AMX) and in
    float32 elsewhere; float32 weights are left as they are (the exact
    oracle), as are weights on other devices. ``caps``: the CPU to answer for
    (``cpu_capabilities()`` by default).
    """
    p = next(model.parameters())
    mkldnn = torch.ops.mkldnn
    if p.device.type != "cpu" or p.dtype not in SMALL_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    if not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_is_mkldnn_bf16_supported")):
        return None
    return (caps or cpu_capabilities()).compute_dtype(p.dtype)


def pack_linears(model: nn.Module, coded_rows: int | None = None, batch_invariant: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` computing in ``linear_compute_dtype``.

    Where the layers get ``small_linear`` tiles and ``model.gguf_file`` names
    the GGUF file the weights were dequantized from, every layer whose weights
    its Q4_1 codes rebuild exactly also gets them (``PackedLinear.coded``),
    used for batches of at most ``coded_rows`` tokens (0 to
    ``PackedLinear.CODED_ROWS``); None measures that number on this CPU
    (``measure_coded_rows``, a fraction of a second for SmolLM2). Either
    way the outputs are the same bits.
    ``batch_invariant``: the layers compute each row independently of the
    others in a call (``PackedLinear``); a ``ValueError`` where the model
    is not packed (float32, not on the CPU) or the tiles' kernels do not
    build here.
    Returns how many were replaced (0 where that dtype is None).
    """
    if coded_rows is not None and (isinstance(coded_rows, bool) or not isinstance(coded_rows, int)
                                   or not 0 <= coded_rows <= PackedLinear.CODED_ROWS):
        raise ValueError(f"coded_rows must be None or an int in [0, {PackedLinear.CODED_ROWS}], got {coded_rows!r}")
    compute = linear_compute_dtype(model)
    if compute is None:
        if batch_invariant:
            raise ValueError("batch_invariant needs radixkv's CPU linear kernels, which serve 16-bit models on "
                             "the CPU only")
        return 0
    small = _small_kernels()
    if batch_invariant and small is None:
        why = cpu_kernels_unavailable_reason() or "this CPU lacks AVX2"
        raise ValueError(f"batch_invariant needs radixkv's CPU linear kernels: {why}")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, compute_dtype=compute, small_kernels=small,
                                           batch_invariant=batch_invariant))
    source = getattr(model, "gguf_file", None)
    if small is not None and source is not None and not batch_invariant:  # the codes serve 1-2 rows other bits
        try:
            rows = q4_rows(source, next(model.parameters()).dtype)
        except (OSError, ValueError, KeyError, struct.error):  # the codes only save time: serve without them
            rows = None
        for parent, name, _ in targets if rows is not None else ():
            packed = getattr(parent, name)
            weight = packed.weight()  # None where the layer has no tiles (out_features % 8 != 0)
            packed.coded = None if weight is None else rows.tiles(weight)
    _tiles_to_huge_pages([getattr(parent, name) for parent, name, _ in targets])
    coded = [m for parent, name, _ in targets if (m := getattr(parent, name)).coded is not None]
    chosen = measure_coded_rows(coded) if coded_rows is None else coded_rows
    for m in coded:
        m.coded_rows = chosen
    return len(targets)


def _small_kernels() -> ModuleType | None:
    """The compiled kernels where they build and this CPU has AVX2 (``small_linear``'s), else None."""
    if cpu_kernels_unavailable_reason() is not None:
        return None
    return load_cpu_kernels() if cpu_capabilities().avx2 else None


def measure_coded_rows(layers: list[PackedLinear], rounds: int = 5) -> int:
    """How many rows (0 to ``PackedLinear.CODED_ROWS``) ``coded_linear`` multiplies faster than ``small_linear``.

    Both give the same bits at these row counts, so only time is at stake,
    and which one wins depends on the CPU (``PackedLinear.CODED_ROWS``). For
    1, 2, ... rows, every layer of ``layers`` (which have codes) is timed
    both ways, in turns, ``rounds`` times each; the first row count at which
    the codes do not win ends the search. Costs ``2 * (rounds + 1)`` passes
    over the layers' weights per row count tried (a warm-up each way).
    """
    if not layers:
        return 0
    kernels = layers[0].small_kernels

    def run(x: dict[int, torch.Tensor], codes: bool) -> None:
        for m in layers:
            c, xm = m.coded, x[m.in_features]
            if codes:
                kernels.coded_linear(xm, c.codes, c.scale, c.offset, m.small_bias)
            else:
                kernels.small_linear(xm, m.tiles, m.small_bias)

    for rows in range(1, PackedLinear.CODED_ROWS + 1):
        x = {m.in_features: torch.ones(rows, m.in_features, dtype=m.dtype) for m in layers}  # values do not matter
        coded, tiles = functools.partial(run, x, True), functools.partial(run, x, False)
        times = interleaved({"coded": coded, "tiles": tiles}, rounds=rounds, per_round=1)
        if times["coded"] >= times["tiles"]:
            return rows - 1
    return PackedLinear.CODED_ROWS


def _tiles_to_huge_pages(layers: list[PackedLinear]) -> None:
    """Move the decode kernels' tiles and codes of ``layers`` into one huge-page buffer (``hugepages.pack``).

    A decode step streams all of them; in 4 KiB pages the loads wait on page walks.
    """
    tiled = [m for m in layers if m.tiles is not None]
    coded = [m for m in tiled if m.coded is not None]
    moved = iter(hugepages.pack([m.tiles for m in tiled] +
                                [t for m in coded for t in (m.coded.codes, m.coded.scale, m.coded.offset)]))
    for m in tiled:
        m.tiles = next(moved)
    for m in coded:
        m.coded = CodedTiles(next(moved), next(moved), next(moved))

