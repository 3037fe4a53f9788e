"""What this CPU can run, in one place: every CPU path radixkv chooses reads ``cpu_capabilities()``.

The choices that follow from it:

* the linear layers' compute dtype (``CpuCapabilities.compute_dtype``, read by
  ``radixkv.cpu.linear``): a 16-bit weight multiplies in its own dtype where oneDNN
  multiplies it natively (``onednn_bf16``, ``onednn_fp16``), else in float32;
* the compiled kernels (``radixkv.cpu.kernels``): the compiler flags and the build
  cache's key (``compile_flags``, ``build_key``), hence which of their AVX2 and
  AVX-512 BF16 paths exist (checked against this record when they load);
* the decode-sized linear kernels and the fused decode stack: ``avx2``;
* the flash prefill (``radixkv.cpu.flash_prefill``): bfloat16 with ``amx``.

A ceiling for tests: ``RADIXKV_CPU_ISA`` set to one of ``CEILINGS`` (``avx2``,
``avx512``, ``avx512_bf16``) caps what is reported, so an AVX-512 or AMX machine
takes exactly the paths of a CPU that has no more than that: an AVX2-only CPU
(AMD Zen 2 and 3, Intel client chips without AVX-512) under ``avx2``, with its
kernels built for that ISA (``-march=x86-64-v3``) under their own cache key.
oneDNN and ATen read their own ceilings (``ONEDNN_MAX_CPU_ISA=AVX2``,
``ATEN_CPU_CAPABILITY=avx2``); ``.ci/run`` sets all three for its capped pass. Any
other value is a ``ValueError`` on the first read. Without the variable the
hardware's own features are reported and the kernels are built for this very CPU
(``-march=native``), the fast path.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

import torch

CEILING_VARIABLE = "RADIXKV_CPU_ISA"
# Each level includes the ones before it; a ceiling keeps the features up to and including its own.
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
CEILINGS = LEVELS[:-1]
# The compiler flags of a build capped at a level: the x86-64 micro-architecture levels (gcc 11+, clang 12+)
# hold exactly the instructions each of our kernel paths tests for (__AVX2__/__FMA__/__F16C__; __AVX512F__).
_CAPPED_FLAGS = {"avx2": ["-march=x86-64-v3"], "avx512": ["-march=x86-64-v4"],
                 "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"]}


@dataclass(frozen=True)
class CpuCapabilities:
    """What this CPU can run, as radixkv's paths need to know it (``cpu_capabilities`` builds it).

    ``avx2``: AVX2 with FMA and F16C (the kernels' float32-arithmetic paths);
    ``avx512``: AVX-512 F, BW, VL and DQ; ``avx512_bf16``: that and AVX-512 BF16
    dot products; ``amx``: AMX tiles; ``onednn_bf16`` / ``onednn_fp16``: oneDNN
    multiplies that 16-bit type natively (PyTorch's own check, which also honours
    ``ONEDNN_MAX_CPU_ISA``). ``ceiling``: the ``RADIXKV_CPU_ISA`` cap applied, if any.
    """

    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    onednn_bf16: bool
    onednn_fp16: bool
    ceiling: str | None = None

    @property
    def isa(self) -> str:
        """The highest of ``LEVELS`` this CPU has (``"baseline"`` below AVX2)."""
        return next((lvl for lvl in reversed(LEVELS) if getattr(self, lvl)), "baseline")

    def capped(self, ceiling: str | None) -> CpuCapabilities:
        """These capabilities with everything above ``ceiling`` (one of ``CEILINGS``) cleared; None: unchanged."""
        if ceiling is None:
            return self
        if ceiling not in CEILINGS:
            raise ValueError(f"{CEILING_VARIABLE} must be one of {CEILINGS} (or unset), got {ceiling!r}")
        keep = LEVELS[: LEVELS.index(ceiling) + 1]
        # oneDNN's bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; a capped CPU is one without the latter.
        # Its float16 needs AVX-512 FP16 or AMX-FP16, above every ceiling.
        return replace(self, **{lvl: getattr(self, lvl) and lvl in keep for lvl in LEVELS},
                       onednn_bf16=self.onednn_bf16 and "avx512" in keep and self.avx512,
                       onednn_fp16=False, ceiling=ceiling)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a linear layer with ``dtype`` weights multiplies in: its own where oneDNN multiplies it
        natively (and for float32), else float32."""
        native = {torch.bfloat16: self.onednn_bf16, torch.float16: self.onednn_fp16}
        return dtype if native.get(dtype, True) else torch.float32

    @property
    def native_build(self) -> bool:
        """Whether the kernels are built for this very CPU (no ceiling, or none with a level of its own)."""
        return self.ceiling is None or self.isa not in _CAPPED_FLAGS

    def compile_flags(self) -> list[str]:
        """The instruction-set flags the compiled kernels are built with: this CPU's own without a ceiling,
        the capped level's otherwise (so a capped build has exactly that level's paths)."""
        return ["-march=native"] if self.native_build else list(_CAPPED_FLAGS[self.isa])

    def build_key(self) -> str:
        """What a build of the kernels depends on beyond their source: the machine's architecture and, for a
        native build, the CPU's feature flags; for a capped one, its flags alone."""
        native = _cpuinfo_flags() if self.native_build else ""
        return f"{platform.machine()}|{' '.join(self.compile_flags())}|{native}"


def _cpuinfo_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo ('' where there is none: not Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return ""
    return next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")


def detect() -> CpuCapabilities:
    """The hardware's capabilities, uncapped (PyTorch's cpuinfo, which also works off Linux)."""
    cpu, mkldnn = torch.cpu, torch.ops.mkldnn
    flags = set(_cpuinfo_flags().split())
    fma_f16c = not flags or {"fma", "f16c"} <= flags  # every AVX2 CPU has both; checked where the flags are known
    onednn = torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
    avx512 = cpu._is_avx512_supported()
    return CpuCapabilities(
        avx2=cpu._is_avx2_supported() and fma_f16c,
        avx512=avx512,
        avx512_bf16=avx512 and cpu._is_avx512_bf16_supported(),
        amx=cpu._is_amx_tile_supported(),
        onednn_bf16=onednn and mkldnn._is_mkldnn_bf16_supported(),
        onednn_fp16=onednn and mkldnn._is_mkldnn_fp16_supported(),
    )


@functools.cache
def _capabilities(ceiling: str | None) -> CpuCapabilities:
    return detect().capped(ceiling)


def cpu_capabilities() -> CpuCapabilities:
    """What this CPU can run (``CpuCapabilities``), capped by ``RADIXKV_CPU_ISA`` where it is set.

    Detected once per process and ceiling; O(1) after that.
    >>> cpu_capabilities().compute_dtype(torch.float32)
    torch.float32
    """
    return _capabilities(os.environ.get(CEILING_VARIABLE) or None)


__all__ = ["CEILINGS", "CEILING_VARIABLE", "LEVELS", "CpuCapabilities", "cpu_capabilities", "detect"]
