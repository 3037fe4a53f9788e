"""CPU kernels compiled on first use: paged attention that reads K/V in place, and fused layer steps.

PyTorch has no op that attends over a paged pool without first gathering
the K/V rows into a dense batch, and on a CPU that copy costs as much as the
attention itself; at decode batch sizes, a Llama layer's small elementwise
ops cost more in dispatch than in arithmetic. ``cpu_kernels.cpp`` has
``paged_decode`` and ``paged_prefill`` (gather-free attention), ``rms_norm``,
``rope_store`` and ``silu_mul`` (one call each), ``small_linear``
(decode-sized linear layers straight from 16-bit weights), ``coded_linear``
(the same outputs from exact 4-bit codes of those weights,
``radixkv.cpu.coded``) and ``DecodeStack`` (a pure-decode step's whole layer
stack in one call); its comments document shapes and dtypes. Each has an
AVX2 path with FMA and F16C (float32 arithmetic on any storage dtype: CPUs
such as Zen 3 have no 16-bit matrix instructions, and on AVX-512 CPUs decode
attention ran faster this way than in bfloat16 dot products) and portable
loops; ``paged_prefill`` also has an AVX-512 BF16 path, and ``small_linear``
multiplies bfloat16 blocks of 4 rows in BF16 dot products there.
``has_avx512_bf16()``, ``has_avx2()`` and ``prefill_supported(dtype,
head_dim)`` say which were compiled in. It is built with
``torch.utils.cpp_extension`` the first time it is asked for (tens of
seconds, then cached under ``~/.cache/torch_extensions``), for the
instruction sets ``radixkv.cpu.capabilities`` reports (``-march=native``,
or a ``RADIXKV_CPU_ISA`` ceiling's level), so the cache is keyed by those
flags and, for a native build, the CPU's feature flags; a loaded build whose
paths disagree with those capabilities is refused. Loading a finished build
takes no lock, and a build killed midway never blocks the next one
(``radixkv.cpu.kernels.build``).

``load_cpu_kernels()`` returns the compiled module, or raises
``RuntimeError`` saying why it cannot be built (no C++ compiler, no ninja);
``cpu_kernels_unavailable_reason()`` returns that reason without raising.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from types import ModuleType

from radixkv.cpu.capabilities import CpuCapabilities, cpu_capabilities
from radixkv.cpu.kernels.build import load_extension

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


def build_name(caps: CpuCapabilities) -> str:
    """The extension's name: a short hash of the source and what the build depends on (``build_key``), so a
    build never runs on the wrong CPU or under the wrong ceiling."""
    key = f"{caps.build_key()}|{SOURCE.read_text()}"
    return f"radixkv_cpu_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _check_paths(module: ModuleType, caps: CpuCapabilities) -> None:
    """A build whose compiled-in paths are not those ``caps`` reports is refused (``RuntimeError``)."""
    built = {"avx2": module.has_avx2(), "avx512_bf16": module.has_avx512_bf16()}
    expected = {"avx2": caps.avx2, "avx512_bf16": caps.avx512_bf16}
    if built != expected:
        raise RuntimeError(f"the build has paths {built}, this CPU ({caps.isa}) should have {expected}")


@functools.cache
def _build(caps: CpuCapabilities) -> ModuleType | str:
    """The compiled module for ``caps``, or the reason it could not be built (built once per process)."""
    try:
        module = load_extension(build_name(caps), [str(SOURCE)], ["-O3", *caps.compile_flags(), "-fopenmp"],
                                ["-fopenmp"], what=f"radixkv's CPU kernels for {caps.isa}")
        _check_paths(module, caps)
        return module
    except Exception as e:  # noqa: BLE001 - any build failure means "use the PyTorch path", with the reason kept
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def load_cpu_kernels() -> ModuleType:
    """The compiled CPU kernels (see the module docstring); builds them on first call."""
    built = _build(cpu_capabilities())
    if isinstance(built, str):
        raise RuntimeError(f"radixkv's CPU kernels could not be built: {built}")
    return built


def cpu_kernels_unavailable_reason() -> str | None:
    """Why the CPU kernels cannot be used here, or None when they can (may build them)."""
    built = _build(cpu_capabilities())
    return built if isinstance(built, str) else None


__all__ = ["cpu_kernels_unavailable_reason", "load_cpu_kernels"]
