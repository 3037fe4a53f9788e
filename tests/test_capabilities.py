"""The one door for CPU capabilities (``radixkv.cpu.capabilities``): every CPU path reads it, and its ceiling
(``RADIXKV_CPU_ISA``) makes any x86 machine take the paths of a CPU with no more than that, so that an AVX2 break
shows on an AVX-512 or AMX machine before it lands (``.ci/run``'s capped pass)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from torch import nn

import radixkv.cpu.capabilities as capabilities
from radixkv.cpu.capabilities import CEILINGS, CpuCapabilities, cpu_capabilities, detect
from radixkv.cpu.flash_prefill import amx_prefill
from radixkv.cpu.kernels import build_name
from radixkv.cpu.linear import linear_compute_dtype

# A Zen 3 (AMD EPYC 7003, Ryzen 5000): AVX2 with FMA and F16C, nothing of AVX-512, no native oneDNN bfloat16.
AVX2_ONLY = CpuCapabilities(avx2=True, avx512=False, avx512_bf16=False, amx=False, onednn_bf16=False,
                            onednn_fp16=False)
# A Sapphire Rapids Xeon: everything.
AMX_XEON = CpuCapabilities(avx2=True, avx512=True, avx512_bf16=True, amx=True, onednn_bf16=True, onednn_fp16=True)
# The instruction-set macros cpu_kernels.cpp chooses its paths by.
KERNEL_MACROS = ("__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512BF16__")


def path_choices(caps: CpuCapabilities) -> dict[str, object]:
    """Every CPU path choice radixkv makes from ``caps``: linear compute dtypes, flash prefill, the kernels'
    AVX2 (decode-sized linears, the fused decode stack) and AVX-512 BF16 paths."""
    bf16 = nn.Linear(8, 8).bfloat16()
    fp16 = nn.Linear(8, 8).half()
    return {"linear bfloat16": linear_compute_dtype(bf16, caps), "linear float16": linear_compute_dtype(fp16, caps),
            "flash prefill": amx_prefill(torch.bfloat16, caps), "avx2 kernels": caps.avx2,
            "avx512_bf16 kernels": caps.avx512_bf16}


def compiled_macros(flags: list[str]) -> set[str]:
    """Which of ``KERNEL_MACROS`` the C++ compiler defines under ``flags``."""
    out = subprocess.run(["c++", *flags, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True,
                         check=True).stdout
    return {m for m in KERNEL_MACROS if f"#define {m} " in out}


def test_an_amx_machine_capped_at_avx2_takes_an_avx2_cpus_paths():
    assert path_choices(AMX_XEON.capped("avx2")) == path_choices(AVX2_ONLY)
    assert path_choices(AVX2_ONLY)["linear bfloat16"] == torch.float32  # oneDNN would emulate bfloat16 slowly
    assert path_choices(AMX_XEON)["linear bfloat16"] == torch.bfloat16 and path_choices(AMX_XEON)["flash prefill"]


def test_this_machine_capped_at_avx2_takes_an_avx2_cpus_paths():
    real = detect()
    if not real.avx2:
        pytest.skip(f"this CPU has no AVX2 ({real.isa}): a ceiling of avx2 cannot raise it")
    assert path_choices(real.capped("avx2")) == path_choices(AVX2_ONLY)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to ask which macros a build defines")
def test_a_capped_build_has_exactly_its_levels_instruction_sets():
    capped = AMX_XEON.capped("avx2")
    assert compiled_macros(capped.compile_flags()) == {"__AVX2__", "__FMA__", "__F16C__"}
    assert compiled_macros(AMX_XEON.capped("avx512").compile_flags()) >= {"__AVX2__", "__AVX512F__"}
    assert "__AVX512BF16__" not in compiled_macros(AMX_XEON.capped("avx512").compile_flags())
    assert "__AVX512BF16__" in compiled_macros(AMX_XEON.capped("avx512_bf16").compile_flags())


def test_the_build_cache_key_follows_the_ceiling():
    real = detect()
    names = {build_name(real.capped(c)) for c in (None, *CEILINGS)}
    assert build_name(real.capped("avx2")) != build_name(real) or real.isa == "baseline"
    assert len(names) >= 2 or real.isa in ("baseline", "avx2")
    assert AMX_XEON.capped("avx2").compile_flags() == ["-march=x86-64-v3"]
    assert AMX_XEON.compile_flags() == ["-march=native"]


def test_the_ceiling_is_read_from_radixkv_cpu_isa(monkeypatch):
    monkeypatch.setenv(capabilities.CEILING_VARIABLE, "avx2")
    caps = cpu_capabilities()
    assert caps.ceiling == "avx2" and not (caps.avx512 or caps.avx512_bf16 or caps.amx or caps.onednn_bf16)
    monkeypatch.setenv(capabilities.CEILING_VARIABLE, "avx-512")
    with pytest.raises(ValueError, match="RADIXKV_CPU_ISA must be one of"):
        cpu_capabilities()
    monkeypatch.delenv(capabilities.CEILING_VARIABLE)
    assert cpu_capabilities() == detect()


def test_a_ceiling_never_raises_what_the_cpu_has():
    for ceiling in CEILINGS:
        capped = AVX2_ONLY.capped(ceiling)
        assert path_choices(capped) == path_choices(AVX2_ONLY) and capped.isa == "avx2"


def test_packed_linear_refuses_a_compute_dtype_onednn_lacks(monkeypatch):
    """A hand-built PackedLinear asking for bfloat16 where the door says oneDNN lacks it gets a clear error
    (not oneDNN's, nor a slow emulation): the test that asked for it must ask the door."""
    import radixkv.cpu.linear as linear

    monkeypatch.setattr(linear, "cpu_capabilities", lambda: AVX2_ONLY)
    with pytest.raises(ValueError, match="cannot multiply torch.bfloat16 natively"):
        linear.PackedLinear(nn.Linear(16, 16).bfloat16(), compute_dtype=torch.bfloat16)


def test_loaded_kernels_have_the_paths_the_door_reports():
    from radixkv.cpu.kernels import cpu_kernels_unavailable_reason, load_cpu_kernels

    if reason := cpu_kernels_unavailable_reason():
        pytest.skip(f"CPU kernels unavailable: {reason}")
    kernels, caps = load_cpu_kernels(), cpu_capabilities()
    assert (kernels.has_avx2(), kernels.has_avx512_bf16()) == (caps.avx2, caps.avx512_bf16)
