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
seconds, then cached under ``~/.cache/torch_extensions``), for this
machine's CPU (``-march=native``), so the cache is keyed by the CPU's
feature flags.

``load_cpu_kernels()`` returns the compiled module, or raises
``RuntimeError`` saying why it cannot be built (no C++ compiler, no ninja);
``cpu_kernels_unavailable_reason()`` returns that reason without raising.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags and the source, so a build never runs on the wrong CPU."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    key = f"{platform.machine()}|{flags}|{SOURCE.read_text()}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@functools.cache
def _build() -> ModuleType | str:
    """The compiled module, or the reason it could not be built (built once per process)."""
    try:
        from torch.utils.cpp_extension import load

        return load(f"radixkv_cpu_{_cpu_tag()}", [str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the PyTorch path", with the reason kept
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def load_cpu_kernels() -> ModuleType:
    """The compiled CPU kernels (see the module docstring); builds them on first call."""
    built = _build()
    if isinstance(built, str):
        raise RuntimeError(f"radixkv's CPU kernels could not be built: {built}")
    return built


def cpu_kernels_unavailable_reason() -> str | None:
    """Why the CPU kernels cannot be used here, or None when they can (may build them)."""
    built = _build()
    return built if isinstance(built, str) else None


__all__ = ["cpu_kernels_unavailable_reason", "load_cpu_kernels"]
